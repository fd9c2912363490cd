"""``csi.ramdisk``: the RAM disk set up, reused or resized at start, over ``MemoryMounter``:
no root, no sockets (``test_real_mounts.py`` mounts a real one)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mtc_replicator.csi.errors import RamDiskError
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at, tmpfs_size
from mtc_replicator.csi.ramdisk import Action, ensure_ram_disk, plan_ram_disk
from tests.csi.conftest import RAM_DISK_BYTES, Failing

SIZE = RAM_DISK_BYTES


def visible(mounter: MemoryMounter, path: Path) -> MountInfo | None:
    return mount_at(mounter.mounts(), str(path))


def test_the_ram_disk_is_mounted_when_absent(mounter: MemoryMounter, tmp_path: Path) -> None:
    mounted = ensure_ram_disk(mounter, tmp_path / "a" / "ram", SIZE)
    assert (tmp_path / "a" / "ram").is_dir()
    assert (mounted.fs_type, tmpfs_size(mounted)) == ("tmpfs", SIZE)
    assert "mode=1770" in mounted.super_options


def test_an_existing_ram_disk_is_reused(
    mounter: MemoryMounter, ram: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = visible(mounter, ram)
    caplog.set_level(logging.INFO, logger="mtc_replicator.csi.ramdisk")
    again = ensure_ram_disk(mounter, ram, SIZE)
    assert again == before
    assert [op for op, _ in mounter.calls].count("mount_tmpfs") == 1
    assert "RAM disk reused" in caplog.text


def test_a_ram_disk_of_another_size_is_resized_in_place(mounter: MemoryMounter, ram: Path) -> None:
    before = visible(mounter, ram)
    assert before is not None
    resized = ensure_ram_disk(mounter, ram, 2 * SIZE)
    assert (resized.mount_id, resized.device) == (before.mount_id, before.device)
    assert tmpfs_size(resized) == 2 * SIZE


def test_a_failed_resize_keeps_the_ram_disk(
    mounter: MemoryMounter, ram: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mounter.before = Failing("resize_tmpfs")
    kept = ensure_ram_disk(mounter, ram, SIZE // 2)
    assert tmpfs_size(kept) == SIZE
    assert "reused at its old size" in caplog.text


def test_a_foreign_mount_at_the_ram_dir_is_refused(mounter: MemoryMounter, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "ram").mkdir()
    mounter.bind(tmp_path / "data", tmp_path / "ram")
    with pytest.raises(RamDiskError, match="ext4 mount"):
        ensure_ram_disk(mounter, tmp_path / "ram", SIZE)


def test_a_failed_mount_is_a_ram_disk_error(mounter: MemoryMounter, tmp_path: Path) -> None:
    mounter.before = Failing("mount_tmpfs")
    with pytest.raises(RamDiskError, match="cannot set up"):
        ensure_ram_disk(mounter, tmp_path / "ram", SIZE)


@pytest.mark.parametrize(
    ("size_option", "wanted", "action"),
    [
        ("size=65536k", 64 * 2**20, Action.REUSE),
        ("size=65536k", 64 * 2**20 - 100, Action.REUSE),  # the kernel rounds up to pages
        ("size=65536k", 32 * 2**20, Action.RESIZE),
        ("mode=755", 64 * 2**20, Action.RESIZE),  # no limit shown: the kernel's default
    ],
)
def test_plan_ram_disk(size_option: str, wanted: int, action: Action) -> None:
    existing = MountInfo(5, 1, "0:50", "/", "/ram", frozenset({"rw"}), "tmpfs", "t", (size_option,))
    assert plan_ram_disk([existing], Path("/ram"), wanted, page_size=4096).action is action
    assert plan_ram_disk([], Path("/ram"), wanted).action is Action.MOUNT
