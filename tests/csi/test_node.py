"""The Node logic and the RAM disk set-up over ``MemoryMounter``: no root, no sockets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mtc_replicator.csi.errors import (
    InvalidRequest,
    MountError,
    OperationPending,
    PublishConflict,
    RamDiskError,
    RamDiskMissing,
    TargetCleanupError,
)
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at, tmpfs_size
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.ramdisk import Action, ensure_ram_disk, plan_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import (
    Decision,
    NodeVolumes,
    check_target,
    decide_publish,
    published_targets,
)

SIZE = 64 * 2**20
POD = PodInfo("team-a", "trainer-0", "uid-a0", "default")


class Failing:
    """A ``MemoryMounter.before`` hook that fails the named operations."""

    def __init__(self, *operations: str) -> None:
        self.operations = set(operations)

    def __call__(self, operation: str, target: Path) -> None:
        if operation in self.operations:
            raise MountError(f"{operation} {target}: injected failure")


@pytest.fixture
def mounter() -> MemoryMounter:
    return MemoryMounter()


@pytest.fixture
def ram(tmp_path: Path, mounter: MemoryMounter) -> Path:
    path = tmp_path / "ram"
    ensure_ram_disk(mounter, path, SIZE)
    return path


@pytest.fixture
def pods(tmp_path: Path) -> Path:
    path = tmp_path / "pods"
    path.mkdir()
    return path


@pytest.fixture
def volumes(mounter: MemoryMounter, ram: Path) -> NodeVolumes:
    return NodeVolumes(mounter, ram)


def visible(mounter: MemoryMounter, path: Path) -> MountInfo | None:
    return mount_at(mounter.mounts(), str(path))


# --- publish -------------------------------------------------------------------------------


def test_publish_binds_the_checkpoint_dir_onto_a_new_target(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, pods: Path
) -> None:
    target = pods / "mount"
    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is True
    assert target.is_dir()
    bind, disk = visible(mounter, target), visible(mounter, ram)
    assert bind is not None
    assert disk is not None
    assert (bind.device, bind.root, bind.readonly) == (disk.device, "/checkpoint", False)


def test_publish_again_is_a_no_op(volumes: NodeVolumes, mounter: MemoryMounter, pods: Path) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    calls = len(mounter.calls)
    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is False
    assert len(mounter.calls) == calls


def test_read_only_publish_is_a_bind_then_a_read_only_remount(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=True, pod=POD))
    assert [op for op, path in mounter.calls if path == str(target)] == ["bind", "remount_readonly"]
    bind = visible(mounter, target)
    assert bind is not None
    assert bind.readonly
    assert volumes.publish(Publish("v1", target, readonly=True, pod=POD)) is False


@pytest.mark.parametrize(("first", "second"), [(False, True), (True, False)])
def test_publish_in_the_other_mode_is_refused(
    volumes: NodeVolumes, pods: Path, first: bool, second: bool
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=first, pod=POD))
    with pytest.raises(PublishConflict, match="already published"):
        volumes.publish(Publish("v1", target, readonly=second, pod=POD))


def test_publish_onto_someone_elses_mount_is_refused(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    target.mkdir()
    mounter.mount_tmpfs(target, 4096, 0o755)  # same fs type, another filesystem
    with pytest.raises(PublishConflict, match="not of the checkpoint directory"):
        volumes.publish(Publish("v1", target, readonly=False, pod=POD))


def test_publish_onto_a_file_is_refused(volumes: NodeVolumes, pods: Path) -> None:
    target = pods / "mount"
    target.write_text("")
    with pytest.raises(PublishConflict, match="not a directory"):
        volumes.publish(Publish("v1", target, readonly=False, pod=POD))


def test_publish_into_a_missing_parent_fails_cleanly(volumes: NodeVolumes, pods: Path) -> None:
    with pytest.raises(TargetCleanupError, match="cannot create"):
        volumes.publish(Publish("v1", pods / "gone" / "mount", readonly=False, pod=POD))


def test_publish_without_a_ram_disk_is_refused(mounter: MemoryMounter, tmp_path: Path) -> None:
    volumes = NodeVolumes(mounter, tmp_path / "ram")
    assert not volumes.ram_disk_mounted()
    with pytest.raises(RamDiskMissing, match="not mounted"):
        volumes.publish(Publish("v1", tmp_path / "mount", readonly=False, pod=POD))
    assert not (tmp_path / "mount").exists()


def test_a_failed_bind_leaves_nothing_behind(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    mounter.before = Failing("bind")
    with pytest.raises(MountError, match="injected"):
        volumes.publish(Publish("v1", pods / "mount", readonly=False, pod=POD))
    assert not (pods / "mount").exists()


def test_a_failed_read_only_remount_undoes_the_writable_bind(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    mounter.before = Failing("remount_readonly")
    target = pods / "mount"
    with pytest.raises(MountError, match="injected"):
        volumes.publish(Publish("v1", target, readonly=True, pod=POD))
    assert visible(mounter, target) is None
    assert not target.exists()


def test_a_target_that_existed_is_kept_after_a_failure(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    target.mkdir()
    mounter.before = Failing("bind")
    with pytest.raises(MountError):
        volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    assert target.is_dir()


# --- unpublish -----------------------------------------------------------------------------


def test_unpublish_unmounts_and_removes_the_target(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, pods: Path
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    assert volumes.unpublish(Unpublish("v1", target)) is True
    assert visible(mounter, target) is None
    assert not target.exists()
    assert visible(mounter, ram) is not None, "the RAM disk itself stays mounted"


def test_unpublish_of_a_path_that_is_gone_is_ok(volumes: NodeVolumes, pods: Path) -> None:
    assert volumes.unpublish(Unpublish("v1", pods / "never-published")) is False
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    volumes.unpublish(Unpublish("v1", target))
    assert volumes.unpublish(Unpublish("v1", target)) is False


def test_unpublish_removes_an_unmounted_empty_target(volumes: NodeVolumes, pods: Path) -> None:
    # A publish that died between mkdir and mount leaves an empty directory.
    target = pods / "mount"
    target.mkdir()
    assert volumes.unpublish(Unpublish("v1", target)) is True
    assert not target.exists()


def test_unpublish_peels_stacked_mounts(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, pods: Path
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    mounter.bind(ram, target)  # as if a crashed plugin had bound it twice
    volumes.unpublish(Unpublish("v1", target))
    assert visible(mounter, target) is None
    assert not target.exists()


def test_unpublish_never_deletes_data_outside_the_mount(volumes: NodeVolumes, pods: Path) -> None:
    target = pods / "mount"
    target.mkdir()
    (target / "written-while-unmounted").write_text("x")
    with pytest.raises(TargetCleanupError, match="cannot remove"):
        volumes.unpublish(Unpublish("v1", target))
    assert (target / "written-while-unmounted").exists()


def test_a_failed_unmount_is_reported(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    mounter.before = Failing("unmount")
    with pytest.raises(MountError, match="injected"):
        volumes.unpublish(Unpublish("v1", target))
    assert target.exists()


@pytest.mark.parametrize("where", ["ram", "ram/sub", "."])
def test_targets_overlapping_the_ram_disk_are_refused(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, where: str
) -> None:
    target = Path(ram.parent / where).resolve() if where == "." else ram.parent / where
    with pytest.raises(InvalidRequest, match="overlaps the RAM disk"):
        volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    with pytest.raises(InvalidRequest, match="overlaps the RAM disk"):
        volumes.unpublish(Unpublish("v1", target))
    assert visible(mounter, ram) is not None


def test_check_target_accepts_siblings() -> None:
    check_target(Path("/var/lib/kubelet/pods/u/mount"), Path("/var/lib/mtc/ram"))
    check_target(Path("/var/lib/mtc/ram2"), Path("/var/lib/mtc/ram"))


# --- one call per target at a time ---------------------------------------------------------


def test_a_second_call_for_a_busy_target_is_aborted(volumes: NodeVolumes, pods: Path) -> None:
    target = pods / "mount"
    with volumes.locks.hold(target):
        with pytest.raises(OperationPending, match="already in progress"):
            volumes.publish(Publish("v1", target, readonly=False, pod=POD))
        with pytest.raises(OperationPending):
            volumes.unpublish(Unpublish("v1", target))
        volumes.publish(Publish("v2", pods / "other", readonly=False, pod=POD))  # others go on
    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is True


def test_the_lock_is_released_when_a_call_fails(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    mounter.before = Failing("bind")
    with pytest.raises(MountError):
        volumes.publish(Publish("v1", target, readonly=False, pod=POD))
    mounter.before = None
    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is True


# --- pure decisions ------------------------------------------------------------------------


def _mount(
    mount_id: int, point: str, device: str, options: str = "rw", root: str = "/checkpoint"
) -> MountInfo:
    return MountInfo(
        mount_id, 1, device, root, point, frozenset(options.split(",")), "tmpfs", "x", ("rw",)
    )


def test_decide_publish() -> None:
    ram, target = Path("/ram"), Path("/pods/u/mount")
    disk = _mount(2, "/ram", "0:40", root="/")
    assert decide_publish([disk], ram, target, readonly=False) is Decision.MOUNT
    rw = _mount(3, str(target), "0:40")
    assert decide_publish([disk, rw], ram, target, readonly=False) is Decision.ALREADY_PUBLISHED
    ro = _mount(3, str(target), "0:40", "ro,relatime")
    assert decide_publish([disk, ro], ram, target, readonly=True) is Decision.ALREADY_PUBLISHED
    with pytest.raises(PublishConflict, match="published read-only, asked for read-write"):
        decide_publish([disk, ro], ram, target, readonly=False)
    with pytest.raises(RamDiskMissing):
        decide_publish([rw], ram, target, readonly=False)
    # A bind of the whole RAM disk (an older plugin's) is not what we publish now.
    whole = _mount(3, str(target), "0:40", root="/")
    with pytest.raises(PublishConflict, match="not of the checkpoint directory"):
        decide_publish([disk, whole], ram, target, readonly=False)
    other = _mount(3, str(target), "0:40", root="/store")
    with pytest.raises(PublishConflict, match="not of the checkpoint directory"):
        decide_publish([disk, other], ram, target, readonly=False)
    renamed = _mount(3, str(target), "0:40", root="/ckpt")
    assert decide_publish([disk, renamed], ram, target, False, "ckpt") is Decision.ALREADY_PUBLISHED


def test_published_targets_are_every_other_mount_of_the_ram_disk() -> None:
    ram = Path("/ram")
    disk = _mount(2, "/ram", "0:40", root="/")
    mine = _mount(3, "/pods/a/mount", "0:40")
    legacy = _mount(4, "/pods/b/mount", "0:40", root="/")
    foreign = _mount(5, "/pods/c/mount", "0:41")
    assert published_targets([disk, mine, legacy, foreign], ram) == [mine, legacy]
    assert published_targets([disk], ram) == []


# --- the RAM disk --------------------------------------------------------------------------


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
