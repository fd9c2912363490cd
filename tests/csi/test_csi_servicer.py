"""``csi.csi_servicer``: the Identity and Node services over a real unix socket, served
in-process over ``MemoryMounter`` (no root): status codes, idempotency, contention, logging."""

from __future__ import annotations

import logging
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
from mtc_replicator.csi.plugin_server import (
    CsiServer,
)
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import EPHEMERAL_KEY
from mtc_replicator.csi.volumes import NodeVolumes
from tests.csi.conftest import CsiClient, publish_request, unpublish_request

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
