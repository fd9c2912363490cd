"""A target_path whose parent directories include a symlink (a kubelet root-dir or pods
directory moved to a bigger disk and linked back): the kernel lists the mount under the
resolved path, so a plugin that looks the target up by the path as sent never finds its own
bind. Publish is then not idempotent (every retry stacks one more bind), and unpublish
never unmounts (it fails forever on rmdir: EBUSY), leaking the mount and, with it, a
published target that keeps other namespaces out of the checkpoint directory.

Real mounts (root only); the sandbox fixture unmounts everything at teardown.
"""

from __future__ import annotations

from pathlib import Path

from mtc_replicator.csi.mounter import SystemMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import NodeVolumes
from tests.csi.conftest import requires_root

pytestmark = requires_root

POD = PodInfo("team-a", "trainer-0", "uid-t0", "default")


def test_publish_and_unpublish_through_a_symlinked_parent(sandbox: Path) -> None:
    mounter = SystemMounter()
    ram = sandbox / "ram"
    ensure_ram_disk(mounter, ram, 16 * 2**20)
    volumes = NodeVolumes(mounter, ram)
    real = sandbox / "data" / "kubelet"
    (real / "pods" / "uid-t0").mkdir(parents=True)
    (sandbox / "kubelet").symlink_to(real)
    target = sandbox / "kubelet" / "pods" / "uid-t0" / "mount"
    resolved = real / "pods" / "uid-t0" / "mount"

    def binds() -> int:
        return sum(m.mount_point == str(resolved) for m in mounter.mounts())

    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is True
    assert volumes.publish(Publish("v1", target, readonly=False, pod=POD)) is False
    assert binds() == 1, "a repeated publish must not stack another bind"

    volumes.unpublish(Unpublish("v1", target))
    assert binds() == 0
    assert mount_at(mounter.mounts(), str(resolved)) is None
    assert not resolved.exists()
    assert volumes.unpublish(Unpublish("v1", target)) is False


def test_a_symlinked_parent_cannot_smuggle_a_target_into_the_ram_disk(tmp_path: Path) -> None:
    import pytest

    from mtc_replicator.csi.errors import InvalidRequest
    from mtc_replicator.csi.mounter import MemoryMounter

    mounter = MemoryMounter()
    ram = tmp_path / "ram"
    ensure_ram_disk(mounter, ram, 16 * 2**20)
    volumes = NodeVolumes(mounter, ram)
    (tmp_path / "pods").symlink_to(ram)  # "pods/mount" is really "ram/mount"
    with pytest.raises(InvalidRequest, match="overlaps the RAM disk"):
        volumes.publish(Publish("v1", tmp_path / "pods" / "mount", readonly=False, pod=POD))
    assert not (ram / "mount").exists()
