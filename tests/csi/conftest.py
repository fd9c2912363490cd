"""Fixtures for the CSI plugin tests: a gRPC client on a unix socket, a mount sandbox that is
always unmounted at teardown, and real plugin processes that are always stopped.

Tests that mount need root (CAP_SYS_ADMIN); they skip elsewhere with a reason. Everything else
runs as any user against ``MemoryMounter``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi._pb.csi.v1 import csi_pb2_grpc
from mtc_replicator.csi.errors import MountError
from mtc_replicator.csi.mounter import MemoryMounter, SystemMounter
from mtc_replicator.csi.mountinfo import mounts_below
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import EPHEMERAL_KEY
from tests.csi.plugin_process import PluginProcess

requires_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="mounts a tmpfs and bind mounts, which needs root (CAP_SYS_ADMIN); "
    "the MemoryMounter tests cover the same logic without it",
)


class Failing:
    """A ``MemoryMounter.before`` hook that fails the named operations."""

    def __init__(self, *operations: str) -> None:
        self.operations = set(operations)

    def __call__(self, operation: str, target: Path) -> None:
        if operation in self.operations:
            raise MountError(f"{operation} {target}: injected failure")


def stale_socket(path: Path) -> None:
    """A socket file whose listener is gone, as a killed plugin leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


class CsiClient:
    """Identity and Node stubs over one channel to a unix socket."""

    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def connect() -> Iterator[Callable[[Path], CsiClient]]:
    """``connect(socket_path)``: a client, closed at teardown."""
    clients: list[CsiClient] = []

    def make(socket_path: Path) -> CsiClient:
        client = CsiClient(socket_path)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def unmount_all_below(path: Path) -> None:
    """Lazily unmount every mount at or below ``path``, deepest first; never raises."""
    for _ in range(5):  # stacked mounts show up one layer per pass
        try:
            mounts = mounts_below(SystemMounter().mounts(), str(path))
        except OSError:
            return
        if not mounts:
            return
        for mount in mounts:
            subprocess.run(["umount", "-l", mount.mount_point], capture_output=True, check=False)


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[Path]:
    """A directory for real mounts (root only); whatever is mounted below it is lazily
    unmounted at teardown, even when the test failed half-way."""
    if os.geteuid() != 0:
        pytest.skip("real mounts need root (CAP_SYS_ADMIN)")
    path = tmp_path / "s"
    path.mkdir()
    try:
        yield path
    finally:
        unmount_all_below(path)


StartPlugin = Callable[..., PluginProcess]


@pytest.fixture
def start_plugin(sandbox: Path) -> Iterator[StartPlugin]:
    """``start_plugin(ram_size="64Mi", args=[...])``: a real plugin on ``sandbox``/csi.sock
    with its RAM disk at ``sandbox``/ram and more flags from ``args``. Every process is
    stopped (killed if it hangs) before the sandbox is unmounted, and the log is printed so
    a failure shows what it did."""
    started: list[PluginProcess] = []

    def start(
        ram_size: str = "64Mi", *, wait: bool = True, args: Sequence[str] = ()
    ) -> PluginProcess:
        plugin = PluginProcess(
            socket_path=sandbox / "csi.sock",
            ram_dir=sandbox / "ram",
            ram_size=ram_size,
            log_path=sandbox.parent / "plugin.log",
            args=args,
        )
        started.append(plugin)
        return plugin.start() if wait else plugin

    yield start
    for plugin in started:
        if plugin.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                plugin.stop(timeout=10)
    if started:
        log = started[0].log_path.read_text(errors="replace")
        print(f"--- plugin log {started[0].log_path} ---\n{log[-20000:]}")


# --- what kubelet sends, and the RAM disk the plugin keeps ---------------------------------------

RAM_DISK_BYTES = 64 * 2**20
Mode = pb.VolumeCapability.AccessMode


def publish_request(
    target: Path,
    *,
    readonly: bool = False,
    volume_id: str = "csi-0123abcd",
    pod: str = "trainer-0",
    namespace: str | None = "default",
    uid: str = "6f1c2a9e-0b1d-4c8e-9a55-2d3c4b5a6e7f",
    service_account: str = "default",
) -> pb.NodePublishVolumeRequest:
    """What kubelet sends for an inline ephemeral volume with podInfoOnMount;
    ``namespace=None``: what it sends with podInfoOnMount off (no pod keys at all)."""
    context = {EPHEMERAL_KEY: "true"}
    if namespace is not None:
        context |= {
            "csi.storage.k8s.io/pod.name": pod,
            "csi.storage.k8s.io/pod.namespace": namespace,
            "csi.storage.k8s.io/pod.uid": uid,
            "csi.storage.k8s.io/serviceAccount.name": service_account,
        }
    return pb.NodePublishVolumeRequest(
        volume_id=volume_id,
        target_path=str(target),
        volume_capability=pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER),
        ),
        readonly=readonly,
        volume_context=context,
    )


def unpublish_request(target: Path) -> pb.NodeUnpublishVolumeRequest:
    return pb.NodeUnpublishVolumeRequest(volume_id="csi-0123abcd", target_path=str(target))


@pytest.fixture
def mounter() -> MemoryMounter:
    return MemoryMounter()


@pytest.fixture
def ram(tmp_path: Path, mounter: MemoryMounter) -> Path:
    """A RAM disk of ``RAM_DISK_BYTES`` on ``mounter`` (nothing really mounted)."""
    path = tmp_path / "ram"
    ensure_ram_disk(mounter, path, RAM_DISK_BYTES)
    return path
