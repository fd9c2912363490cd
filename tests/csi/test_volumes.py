"""``csi.volumes``, the Node service's logic (publish, unpublish, one call per target at a
time, and its pure decisions), over ``MemoryMounter``: no root, no sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.csi.errors import (
    InvalidRequest,
    MountError,
    OperationPending,
    PublishConflict,
    RamDiskMissing,
    TargetCleanupError,
)
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import (
    Decision,
    NodeVolumes,
    check_target,
    decide_publish,
    published_targets,
)
from tests.csi.conftest import RAM_DISK_BYTES, Failing

SIZE = RAM_DISK_BYTES
POD = PodInfo("team-a", "trainer-0", "uid-a0", "default")


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


def test_read_only_publish_is_one_read_only_bind(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    target = pods / "mount"
    volumes.publish(Publish("v1", target, readonly=True, pod=POD))
    assert [op for op, path in mounter.calls if path == str(target)] == ["bind_readonly"]
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


def test_a_failed_read_only_bind_leaves_nothing_behind(
    volumes: NodeVolumes, mounter: MemoryMounter, pods: Path
) -> None:
    mounter.before = Failing("bind_readonly")
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
