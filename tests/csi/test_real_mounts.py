"""The real plugin process with real mounts (root only): a tmpfs RAM disk, bind mounts into
pod directories, read-only publishing, restarts that keep the data, and a clean SIGTERM.

Every mount lands under the ``sandbox`` fixture, which lazily unmounts all of it at teardown.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mtc_replicator.csi.mounter import RAM_DISK_SOURCE, SystemMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at, tmpfs_size
from mtc_replicator.csi.plugin import EXIT_STARTUP_FAILED
from tests.csi.conftest import (
    CsiClient,
    StartPlugin,
    publish_request,
    requires_root,
    unpublish_request,
)

pytestmark = requires_root

TIMEOUT = 10.0


def mounted(path: Path) -> MountInfo | None:
    return mount_at(SystemMounter().mounts(), str(path))


def publish(client: CsiClient, target: Path, *, readonly: bool = False) -> None:
    client.node.NodePublishVolume(publish_request(target, readonly=readonly), timeout=TIMEOUT)


def unpublish(client: CsiClient, target: Path) -> None:
    client.node.NodeUnpublishVolume(unpublish_request(target), timeout=TIMEOUT)


def pod_dir(sandbox: Path, name: str) -> Path:
    """Kubelet's ``.../volumes/kubernetes.io~mtc_replicator/csi/<volume>`` directory; the plugin
    makes ``mount`` inside it."""
    path = sandbox / "pods" / name / "kubernetes.io~csi" / "ckpt"
    path.mkdir(parents=True)
    return path


def test_publish_read_only_and_unpublish(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin("64Mi")
    client = connect(plugin.socket_path)
    ram = mounted(plugin.ram_dir)
    assert ram is not None
    assert (ram.fs_type, ram.source, tmpfs_size(ram)) == ("tmpfs", RAM_DISK_SOURCE, 64 * 2**20)

    writer = pod_dir(sandbox, "writer") / "mount"
    publish(client, writer)
    publish(client, writer)  # idempotent: still one mount
    mounts = [m for m in SystemMounter().mounts() if m.mount_point == str(writer)]
    assert len(mounts) == 1
    assert (mounts[0].device, mounts[0].readonly) == (ram.device, False)
    (writer / "step-100").write_bytes(b"checkpoint")
    assert (plugin.ram_dir / "checkpoint" / "step-100").read_bytes() == b"checkpoint"

    reader = pod_dir(sandbox, "reader") / "mount"
    publish(client, reader, readonly=True)
    assert (reader / "step-100").read_bytes() == b"checkpoint"
    with pytest.raises(OSError, match="Read-only file system") as refused:
        (reader / "step-200").write_bytes(b"x")
    assert refused.value.errno == errno.EROFS
    ro = mounted(reader)
    assert ro is not None
    assert ro.readonly
    with pytest.raises(grpc.RpcError) as conflict:
        publish(client, reader, readonly=False)
    assert conflict.value.code() is grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]

    for target in (writer, reader):
        unpublish(client, target)
        assert mounted(target) is None
        assert not target.exists()
        assert target.parent.is_dir(), "kubelet's directory is kubelet's to remove"
        unpublish(client, target)  # gone already: still OK
    assert (plugin.ram_dir / "checkpoint" / "step-100").read_bytes() == b"checkpoint"
    assert mounted(plugin.ram_dir) is not None


def test_a_restarted_plugin_reuses_the_ram_disk_and_its_data(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    first = start_plugin("64Mi")
    target = pod_dir(sandbox, "trainer") / "mount"
    publish(connect(first.socket_path), target)
    (target / "step-7").write_bytes(b"x" * 4096)
    device = mounted(first.ram_dir).device  # type: ignore[union-attr]

    first.kill()  # a crash: the socket file stays behind
    assert first.socket_path.is_socket()
    second = start_plugin("64Mi")
    log = second.log()
    assert "removed a stale socket" in log
    assert "RAM disk reused" in log
    ram = mounted(second.ram_dir)
    assert ram is not None
    assert ram.device == device
    assert len([m for m in SystemMounter().mounts() if m.mount_point == str(ram.mount_point)]) == 1
    assert (second.ram_dir / "checkpoint" / "step-7").read_bytes() == b"x" * 4096

    # The new process knows the old one's publish from the mount table alone.
    client = connect(second.socket_path)
    publish(client, target)
    unpublish(client, target)
    assert mounted(target) is None
    assert second.stop() == 0

    # An upgrade with a bigger RAM disk grows it in place.
    third = start_plugin("128Mi")
    grown = mounted(third.ram_dir)
    assert grown is not None
    assert (grown.device, tmpfs_size(grown)) == (device, 128 * 2**20)
    assert (third.ram_dir / "checkpoint" / "step-7").read_bytes() == b"x" * 4096


def test_sigterm_stops_cleanly(sandbox: Path, start_plugin: StartPlugin) -> None:
    plugin = start_plugin()
    assert plugin.stop() == 0
    log = plugin.log()
    assert "stopping" in log
    assert "stopped" in log
    assert "Traceback" not in log
    assert not plugin.socket_path.exists()
    assert mounted(plugin.ram_dir) is not None, "the RAM disk outlives the plugin"


def test_a_socket_in_use_is_not_taken_over(sandbox: Path, start_plugin: StartPlugin) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(sandbox / "csi.sock"))
        live.listen()
        plugin = start_plugin(wait=False)
        assert plugin.run_to_exit() == EXIT_STARTUP_FAILED
    assert "another process is serving" in plugin.log()


def test_the_ram_dir_must_not_hold_another_filesystem(
    sandbox: Path, start_plugin: StartPlugin
) -> None:
    ram, data = sandbox / "ram", sandbox / "data"
    ram.mkdir()
    data.mkdir()
    SystemMounter().bind(data, ram)  # unmounted by the sandbox fixture
    plugin = start_plugin(wait=False)
    assert plugin.run_to_exit() == EXIT_STARTUP_FAILED
    assert "not a tmpfs" in plugin.log()


def test_mountinfo_escapes_round_trip_on_a_real_mount(sandbox: Path) -> None:
    path = sandbox / "with space\tand\\backslash"
    path.mkdir()
    SystemMounter().mount_tmpfs(path, 2**20, 0o755)
    found = mounted(path)
    assert found is not None
    assert (found.fs_type, tmpfs_size(found)) == ("tmpfs", 2**20)
    SystemMounter().unmount(path)
    assert mounted(path) is None
