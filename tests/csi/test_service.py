"""The Identity and Node services over a real unix socket, served in-process over
``MemoryMounter`` (no root): status codes, idempotency, contention, logging, lifecycle."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

import mtc_replicator
from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.csi_servicer import DEFAULT_DRIVER_NAME, IdentityServicer, NodeServicer
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.plugin import (
    DEFAULT_FS_GROUP,
    EXIT_STARTUP_FAILED,
    PluginOptions,
    deprecated_variables,
    parse_args,
    run,
)
from mtc_replicator.csi.plugin_server import (
    CsiServer,
    EndpointError,
    parse_endpoint,
    remove_stale_socket,
)
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import EPHEMERAL_KEY
from mtc_replicator.csi.volumes import NodeVolumes
from tests.csi.conftest import CsiClient

Mode = pb.VolumeCapability.AccessMode
TIMEOUT = 10.0


@dataclass
class Served:
    client: CsiClient
    mounter: MemoryMounter
    ram: Path
    pods: Path
    socket_path: Path


@pytest.fixture
def served(tmp_path: Path, connect: Callable[[Path], CsiClient]) -> Iterator[Served]:
    mounter = MemoryMounter()
    ram = tmp_path / "ram"
    ensure_ram_disk(mounter, ram, 2**20)
    pods = tmp_path / "pods"
    pods.mkdir()
    volumes = NodeVolumes(mounter, ram)
    server = CsiServer(tmp_path / "csi.sock")
    server.add(IdentityServicer(DEFAULT_DRIVER_NAME, mtc_replicator.__version__, volumes).register)
    server.add(NodeServicer(volumes, "node-a").register)
    server.start()
    try:
        yield Served(connect(server.socket_path), mounter, ram, pods, server.socket_path)
    finally:
        server.stop(grace=1)


def publish_request(target: Path, *, readonly: bool = False) -> pb.NodePublishVolumeRequest:
    """What kubelet sends for an inline ephemeral volume with podInfoOnMount."""
    return pb.NodePublishVolumeRequest(
        volume_id="csi-0123abcd",
        target_path=str(target),
        volume_capability=pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER),
        ),
        readonly=readonly,
        volume_context={
            EPHEMERAL_KEY: "true",
            "csi.storage.k8s.io/pod.name": "trainer-0",
            "csi.storage.k8s.io/pod.namespace": "default",
            "csi.storage.k8s.io/pod.uid": "6f1c2a9e-0b1d-4c8e-9a55-2d3c4b5a6e7f",
            "csi.storage.k8s.io/serviceAccount.name": "default",
        },
    )


def unpublish_request(target: Path) -> pb.NodeUnpublishVolumeRequest:
    return pb.NodeUnpublishVolumeRequest(volume_id="csi-0123abcd", target_path=str(target))


def status_of(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    return error.code(), error.details()  # type: ignore[attr-defined]


# --- Identity ------------------------------------------------------------------------------


def test_identity(served: Served) -> None:
    info = served.client.identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=TIMEOUT)
    assert info.name == DEFAULT_DRIVER_NAME
    assert info.name != "multitier-checkpoint.csi.storage.gke.io"
    assert info.vendor_version == mtc_replicator.__version__
    capabilities = served.client.identity.GetPluginCapabilities(
        pb.GetPluginCapabilitiesRequest(), timeout=TIMEOUT
    )
    assert list(capabilities.capabilities) == []
    probe = served.client.identity.Probe(pb.ProbeRequest(), timeout=TIMEOUT)
    assert probe.HasField("ready")
    assert probe.ready.value is True


def test_probe_fails_when_the_ram_disk_is_gone(served: Served) -> None:
    served.mounter.unmount(served.ram)
    code, details = status_of(lambda: served.client.identity.Probe(pb.ProbeRequest()))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert "not mounted" in details


# --- Node: what is and is not served -------------------------------------------------------


def test_node_info_and_no_capabilities(served: Served) -> None:
    info = served.client.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=TIMEOUT)
    assert info.node_id == "node-a"
    capabilities = served.client.node.NodeGetCapabilities(
        pb.NodeGetCapabilitiesRequest(), timeout=TIMEOUT
    )
    assert list(capabilities.capabilities) == []


@pytest.mark.parametrize(
    ("method", "request_type"),
    [
        ("NodeStageVolume", pb.NodeStageVolumeRequest),
        ("NodeUnstageVolume", pb.NodeUnstageVolumeRequest),
        ("NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest),
        ("NodeExpandVolume", pb.NodeExpandVolumeRequest),
    ],
)
def test_other_node_rpcs_are_unimplemented(
    served: Served, method: str, request_type: type[object]
) -> None:
    stub_method = getattr(served.client.node, method)
    code, details = status_of(lambda: stub_method(request_type(), timeout=TIMEOUT))
    assert code is grpc.StatusCode.UNIMPLEMENTED
    assert method in details


def test_there_is_no_controller_service(served: Served) -> None:
    create_volume = served.client.channel.unary_unary("/csi.v1.Controller/CreateVolume")
    code, _ = status_of(lambda: create_volume(b"", timeout=TIMEOUT))
    assert code is grpc.StatusCode.UNIMPLEMENTED


# --- Node: publish and unpublish -----------------------------------------------------------


def test_publish_is_idempotent_and_unpublish_too(served: Served) -> None:
    node, target = served.client.node, served.pods / "mount"
    node.NodePublishVolume(publish_request(target), timeout=TIMEOUT)
    node.NodePublishVolume(publish_request(target), timeout=TIMEOUT)
    bind = mount_at(served.mounter.mounts(), str(target))
    assert bind is not None
    assert not bind.readonly
    code, details = status_of(
        lambda: node.NodePublishVolume(publish_request(target, readonly=True), timeout=TIMEOUT)
    )
    assert code is grpc.StatusCode.ALREADY_EXISTS
    assert "read-write" in details
    node.NodeUnpublishVolume(unpublish_request(target), timeout=TIMEOUT)
    node.NodeUnpublishVolume(unpublish_request(target), timeout=TIMEOUT)
    assert mount_at(served.mounter.mounts(), str(target)) is None
    assert not target.exists()


def test_invalid_requests_are_invalid_argument(served: Served) -> None:
    node, target = served.client.node, served.pods / "mount"
    no_capability = publish_request(target)
    no_capability.ClearField("volume_capability")
    block = publish_request(target)
    block.volume_capability.block.SetInParent()
    persistent = publish_request(target)
    del persistent.volume_context[EPHEMERAL_KEY]
    cases = [
        (pb.NodePublishVolumeRequest(), "volume_id is required"),
        (no_capability, "volume_capability is required"),
        (block, "block access"),
        (persistent, "inline ephemeral"),
    ]
    for request, message in cases:
        code, details = status_of(lambda r=request: node.NodePublishVolume(r, timeout=TIMEOUT))
        assert (code, message in details) == (grpc.StatusCode.INVALID_ARGUMENT, True), details
    code, _ = status_of(
        lambda: node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="v"))
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert not target.exists()


def test_fields_we_do_not_declare_are_ignored(served: Served) -> None:
    """Kubelet also sends secrets (7) and publish_context (2): they parse as unknown fields."""
    target = served.pods / "mount"

    def entry(field: int, key: bytes, value: bytes) -> bytes:
        body = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(value)]) + value
        return bytes([field << 3 | 2, len(body)]) + body

    wire = (
        publish_request(target).SerializeToString()
        + entry(2, b"device", b"/dev/x")
        + entry(7, b"token", b"s3cret")
    )
    publish = served.client.channel.unary_unary(
        "/csi.v1.Node/NodePublishVolume",
        response_deserializer=pb.NodePublishVolumeResponse.FromString,
    )
    publish(wire, timeout=TIMEOUT)
    assert mount_at(served.mounter.mounts(), str(target)) is not None


def test_a_call_for_a_busy_target_is_aborted(served: Served) -> None:
    node, target = served.client.node, served.pods / "mount"
    entered, release = threading.Event(), threading.Event()

    def hold_bind(operation: str, path: Path) -> None:
        if operation == "bind":
            entered.set()
            assert release.wait(TIMEOUT)

    served.mounter.before = hold_bind
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(node.NodePublishVolume, publish_request(target), timeout=TIMEOUT)
        try:
            assert entered.wait(TIMEOUT)
            for call in (
                lambda: node.NodePublishVolume(publish_request(target), timeout=TIMEOUT),
                lambda: node.NodeUnpublishVolume(unpublish_request(target), timeout=TIMEOUT),
            ):
                code, details = status_of(call)
                assert code is grpc.StatusCode.ABORTED
                assert "in progress" in details
        finally:
            release.set()
        first.result(TIMEOUT)
    served.mounter.before = None
    node.NodePublishVolume(publish_request(target), timeout=TIMEOUT)


def test_one_log_line_per_call(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="mtc_replicator.csi.plugin_server")
    target = served.pods / "mount"
    served.client.node.NodePublishVolume(publish_request(target), timeout=TIMEOUT)
    status_of(lambda: served.client.node.NodePublishVolume(pb.NodePublishVolumeRequest()))
    served.client.identity.Probe(pb.ProbeRequest(), timeout=TIMEOUT)
    lines = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "mtc_replicator.csi.plugin_server"
    ]
    assert len(lines) == 3, lines
    (ok_level, ok), (bad_level, bad), (probe_level, probe) = lines
    assert ok_level == logging.INFO
    assert ok.startswith("rpc /csi.v1.Node/NodePublishVolume OK ")
    assert ok.endswith("ms")
    assert bad_level == logging.WARNING
    assert "NodePublishVolume INVALID_ARGUMENT" in bad
    assert bad.endswith("volume_id is required")
    assert probe_level == logging.DEBUG  # polled all day long
    assert probe.startswith("rpc /csi.v1.Identity/Probe OK ")


# --- the socket ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "path"),
    [
        ("unix:///csi/csi.sock", "/csi/csi.sock"),
        ("unix:/csi/csi.sock", "/csi/csi.sock"),
        ("/csi/csi.sock", "/csi/csi.sock"),
    ],
)
def test_parse_endpoint(endpoint: str, path: str) -> None:
    assert parse_endpoint(endpoint) == Path(path)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:10000", "unix://csi.sock", "csi.sock"])
def test_parse_endpoint_refuses(endpoint: str) -> None:
    with pytest.raises(EndpointError):
        parse_endpoint(endpoint)


def stale_socket(path: Path) -> None:
    """A socket file whose listener is gone, as a killed plugin leaves it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def test_a_stale_socket_is_removed_a_live_one_or_a_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "csi.sock"
    assert remove_stale_socket(path) is False
    stale_socket(path)
    assert remove_stale_socket(path) is True
    assert not path.exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(EndpointError, match="another process"):
            remove_stale_socket(path)
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(EndpointError, match="not a socket"):
        remove_stale_socket(path)
    assert path.read_text() == "not a socket"


# --- the process's options and lifecycle ---------------------------------------------------

ENV = {
    "MTC_CSI_ENDPOINT": "unix:///csi/csi.sock",
    "MTC_CSI_NODE_ID": "node-a",
    "MTC_RAM_DIR": "/var/lib/mtc/ram/",
    "MTC_RAM_SIZE": "64Gi",
}


def test_options_from_the_environment() -> None:
    opts = parse_args([], ENV)
    assert opts == PluginOptions(
        socket_path=Path("/csi/csi.sock"),
        node_id="node-a",
        ram_dir=Path("/var/lib/mtc/ram"),
        ram_size=64 * 2**30,
        driver_name=DEFAULT_DRIVER_NAME,
        fs_group=DEFAULT_FS_GROUP,
    )
    named = parse_args([], {**ENV, "MTC_CSI_DRIVER_NAME": "ckpt.example.com"})
    assert named.driver_name == "ckpt.example.com"


def test_the_0_1_names_are_still_read_and_named_as_deprecated() -> None:
    old = {"CSI_ENDPOINT": "unix:///old/csi.sock", "NODE_NAME": "node-old"}
    rest = {k: v for k, v in ENV.items() if not k.startswith("MTC_CSI_")}
    opts = parse_args([], {**rest, **old})
    assert (opts.socket_path, opts.node_id) == (Path("/old/csi.sock"), "node-old")
    assert deprecated_variables({**rest, **old}) == [
        ("CSI_ENDPOINT", "MTC_CSI_ENDPOINT"),
        ("NODE_NAME", "MTC_CSI_NODE_ID"),
    ]
    both = {**ENV, **old}
    assert parse_args([], both).node_id == "node-a", "the new name wins"
    assert deprecated_variables(both) == []


def test_flags_win_over_the_environment() -> None:
    opts = parse_args(
        ["--node-id", "node-b", "--ram-size", "512Mi", "--driver-name", "x.example.com"], ENV
    )
    assert (opts.node_id, opts.ram_size, opts.driver_name) == (
        "node-b",
        512 * 2**20,
        "x.example.com",
    )


@pytest.mark.parametrize(
    ("drop", "extra", "message"),
    [
        ("MTC_CSI_NODE_ID", [], "--node-id (or MTC_CSI_NODE_ID) is required"),
        ("MTC_RAM_SIZE", [], "--ram-size (or MTC_RAM_SIZE) is required"),
        (None, ["--ram-size", "256m"], "unknown suffix"),
        (None, ["--ram-dir", "ram"], "absolute"),
        (None, ["--endpoint", "tcp://0:1"], "only unix sockets"),
    ],
)
def test_bad_options_exit_2(
    drop: str | None, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {k: v for k, v in ENV.items() if k != drop}
    with pytest.raises(SystemExit) as info:
        parse_args(extra, env)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_run_serves_until_stopped_then_removes_its_socket(
    tmp_path: Path, connect: Callable[[Path], CsiClient]
) -> None:
    socket_path = tmp_path / "plugin" / "csi.sock"
    socket_path.parent.mkdir()
    stale_socket(socket_path)
    opts = PluginOptions(socket_path, "node-a", tmp_path / "ram", 2**20)
    mounter, stop = MemoryMounter(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, opts, mounter, stop)
        try:
            client = connect(socket_path)
            grpc.channel_ready_future(client.channel).result(TIMEOUT)
            info = client.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=TIMEOUT)
            assert info.node_id == "node-a"
        finally:
            stop.set()
        assert running.result(TIMEOUT) == 0
    assert not socket_path.exists()
    assert mount_at(mounter.mounts(), str(tmp_path / "ram")) is not None, "RAM disk kept"


def test_run_fails_when_the_ram_dir_holds_another_filesystem(tmp_path: Path) -> None:
    mounter = MemoryMounter()
    (tmp_path / "ram").mkdir()
    mounter.bind(tmp_path, tmp_path / "ram")
    opts = PluginOptions(tmp_path / "csi.sock", "node-a", tmp_path / "ram", 2**20)
    assert run(opts, mounter, threading.Event()) == EXIT_STARTUP_FAILED
    assert not (tmp_path / "csi.sock").exists()
