"""A read-only publish must be read-only where the pod gets it: in kubelet's (the host's)
mount namespace, not only in the plugin's.

The DaemonSet mounts kubelet's directory into the plugin with ``mountPropagation:
Bidirectional``: the plugin's copy is a shared peer of the host's, and a bind made at a
target propagates to the host as a *copy* of the new mount, with the flags it had when it
was attached. A later ``mount -o remount,bind,ro`` changes one mount's flags and is not
propagated: the host's copy, which the container runtime binds into the pod, stays writable.

Here the "host" directory is made shared and the plugin's directory is a peer of it, as in
a pod with Bidirectional propagation (root only; everything is unmounted at teardown).
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest

from mtc_replicator.csi.mounter import SystemMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import NodeVolumes
from tests.csi.conftest import requires_root

pytestmark = requires_root

POD = PodInfo("team-a", "reader-0", "uid-r0", "default")


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def peers(sandbox: Path) -> tuple[Path, Path]:
    """(host, plugin): two views of one shared kubelet directory."""
    host, plugin = sandbox / "host-kubelet", sandbox / "plugin-kubelet"
    host.mkdir()
    plugin.mkdir()
    _mount("--bind", str(host), str(host))
    _mount("--make-shared", str(host))
    _mount("--bind", str(host), str(plugin))  # a peer of host's, like Bidirectional
    return host, plugin


def test_a_read_only_publish_is_read_only_in_kubelets_namespace(
    sandbox: Path, peers: tuple[Path, Path]
) -> None:
    host, plugin = peers
    mounter = SystemMounter()
    ram = sandbox / "ram"
    ensure_ram_disk(mounter, ram, 16 * 2**20)
    volumes = NodeVolumes(mounter, ram)
    (plugin / "pods" / "uid-r0").mkdir(parents=True)
    target = plugin / "pods" / "uid-r0" / "mount"

    assert volumes.publish(Publish("v1", target, readonly=True, pod=POD)) is True
    ours = mount_at(mounter.mounts(), str(target))
    assert ours is not None
    assert ours.readonly

    seen_by_pod = host / "pods" / "uid-r0" / "mount"
    theirs = mount_at(mounter.mounts(), str(seen_by_pod))
    assert theirs is not None, "the bind propagates to kubelet's namespace"
    with pytest.raises(OSError, match="Read-only file system") as refused:
        (seen_by_pod / "written-by-a-read-only-pod").write_bytes(b"x")
    assert refused.value.errno == errno.EROFS
    assert not (ram / "checkpoint" / "written-by-a-read-only-pod").exists()

    # Unpublish takes both copies away (the unmount propagates).
    assert volumes.unpublish(Unpublish("v1", target)) is True
    assert mount_at(mounter.mounts(), str(seen_by_pod)) is None
