"""Node identities against a real daemon: a certificate the CA signed is a node only when it
names one (``core.identity``, ``transport.identity``).

Before per-node certificates any certificate of the CA was admitted on every RPC: a
client-only certificate, or one the CA issued for another service, listed every job and
pulled any item. Each attack here is such a holder: refused with PERMISSION_DENIED before
any handler runs, on the Peer, Coordinator and Node services, and on the data channel even
with a live token, while a node's certificate is served as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from mtc_replicator._pb.mtc.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
    peer_pb2_grpc,
)
from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.core.manifest import Manifest
from mtc_replicator.local.store import MANIFEST_FILE
from mtc_replicator.tools import certs
from mtc_replicator.transport.datachannel import connect
from mtc_replicator.transport.tls import TlsMaterial
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import item_dir, ram_disk, running_daemon, sha256_tree
from tests.integration.test_peer import publish_step
from tests.integration.test_startup_checks import _one_line_exit_2, _start
from tests.integration.test_tls import JOB, STEP, accept_job, wait_ingested
from tests.tls import hand_made_node, node_tls

pytestmark = pytest.mark.integration


@dataclass
class Setup:
    ca: certs.Pair
    root: Path
    ckpt: Path
    daemon: DaemonProcess
    manifest: Manifest


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("identity")
    ca = certs.new_ca()
    tls = node_tls(root / "tls-a", ca, node="node-a")
    with ram_disk(root / "a", "64m") as ckpt, running_daemon(ckpt, extra=tls.args()) as daemon:
        accept_job(ckpt, daemon)
        publish_step(ckpt, STEP)
        wait_ingested(ckpt, JOB, STEP, daemon)
        manifest = Manifest.from_json((item_dir(ckpt, JOB, STEP) / MANIFEST_FILE).read_bytes())
        yield Setup(ca, root, ckpt, daemon, manifest)


def _pair(setup: Setup, kind: str) -> certs.Pair:
    if kind == "client-only":
        # What an operator's or another service's client certificate from the same CA is.
        return hand_made_node(setup.ca, node=None, usages=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    if kind == "no node name":
        return certs.issue(setup.ca)  # the shared DNS name, but no node
    if kind == "not a node name":
        return certs.issue(setup.ca, node="Evil_Node!")  # outside --tls-node-name-pattern
    if kind == "node URI without the shared name":
        # One the CA issued for another service, a node's URI put in (issue 39, finding 6).
        return hand_made_node(setup.ca, dns_names=("other-service.example",), node="node-b")
    if kind == "node":
        return certs.issue(setup.ca, node="node-b")
    raise AssertionError(kind)


NOT_NODES = ("client-only", "no node name", "not a node name", "node URI without the shared name")


def _material(setup: Setup, kind: str) -> TlsMaterial:
    root = setup.root / f"as-{kind.replace(' ', '-')}"
    certs.write_node_files(root, setup.ca, _pair(setup, kind))
    return TlsMaterial(certs.node_files(root))


def _channel(setup: Setup, kind: str) -> grpc.Channel:
    pair = _pair(setup, kind)
    creds = grpc.ssl_channel_credentials(setup.ca.cert, pair.key, pair.cert)
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    return grpc.secure_channel(setup.daemon.address, creds, options=options)


def _ref(setup: Setup) -> pb.ItemRef:
    item = setup.manifest.item
    return pb.ItemRef(job=JOB, step=item.step, rank=item.rank, worker=item.worker)


def _calls(setup: Setup, channel: grpc.Channel) -> dict[str, Callable[[], Any]]:
    peer = peer_pb2_grpc.PeerStub(channel)
    coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
    node = node_pb2_grpc.NodeStub(channel)
    join = coordinator_pb2.JoinRequest(
        job=JOB, rank=0, incarnation_id="evil", cluster_view="{}", address="10.0.0.66:1"
    )
    return {
        "Peer.ListItems": lambda: peer.ListItems(pb.ListItemsRequest(), timeout=5),
        "Peer.PullItem": lambda: list(
            peer.PullItem(pb.PullItemRequest(item=_ref(setup)), timeout=5)
        ),
        "Coordinator.Join": lambda: coordinator.Join(join, timeout=5),
        "Coordinator.RoundStatus": lambda: coordinator.RoundStatus(
            coordinator_pb2.RoundStatusRequest(job=JOB, rank=0, incarnation_id="evil"),
            timeout=5,
        ),
        "Node.Status": lambda: node.Status(node_pb2.NodeStatusRequest(), timeout=5),
        "Node.Drop": lambda: node.Drop(
            node_pb2.DropRequest(job=JOB, even_if_only_copy=True), timeout=5
        ),
        "Node.Upload": lambda: node.Upload(node_pb2.UploadRequest(job=JOB), timeout=5),
    }


@pytest.mark.parametrize("kind", NOT_NODES)
def test_a_certificate_of_the_ca_that_names_no_node_is_refused_on_every_service(
    setup: Setup, kind: str
) -> None:
    before = sha256_tree(setup.ckpt)
    with _channel(setup, kind) as channel:
        for name, call in _calls(setup, channel).items():
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, (
                name,
                refused.value.details(),
            )
            assert "not a node's" in (refused.value.details() or ""), name
    assert sha256_tree(setup.ckpt) == before
    assert "join: incarnation evil" not in setup.daemon.log()
    assert "refused /mtc.v1.Peer/ListItems" in setup.daemon.log()


def test_a_node_certificate_is_served(setup: Setup) -> None:
    with _channel(setup, "node") as channel:
        listed = peer_pb2_grpc.PeerStub(channel).ListItems(pb.ListItemsRequest(), timeout=5)
        assert [i.item.step for i in listed.items] == [STEP]
        node_pb2_grpc.NodeStub(channel).Status(node_pb2.NodeStatusRequest(), timeout=5)


@pytest.mark.parametrize("kind", NOT_NODES)
def test_the_data_channel_refuses_a_non_node_even_with_a_live_token(
    setup: Setup, kind: str
) -> None:
    """A node asks for a pull over the data channel; a holder of a non-node certificate
    presents the token (stolen, or handed over by that node): no byte reaches it."""
    with _channel(setup, "node") as channel:
        pulls = peer_pb2_grpc.PeerStub(channel).PullItem(
            pb.PullItemRequest(item=_ref(setup), data_channel=True), timeout=30
        )
        header = next(iter(pulls)).header
        assert header.data_port
        assert header.data_token
        try:
            conn = connect(
                setup.daemon.address,
                header.data_port,
                header.data_token,
                10.0,
                tls=_material(setup, kind),
            )
            with contextlib.closing(conn):
                buf = memoryview(bytearray(1 << 16))
                got = 0
                with contextlib.suppress(OSError):
                    got = conn.recv_into(buf)
            assert got == 0, f"{got} bytes of the item reached a {kind} certificate"
        finally:
            pulls.cancel()
    assert "its certificate is not a node's" in setup.daemon.log()


def test_the_node_name_pattern_narrows_who_is_a_node(tmp_path: Path) -> None:
    """``--tls-node-name-pattern``: a node certificate of the CA outside it is refused."""
    ca = certs.new_ca()
    own = node_tls(tmp_path / "tls", ca, node="gpu-1")
    pattern = ("--tls-node-name-pattern", "gpu-[0-9]+")
    with (
        ram_disk(tmp_path / "ckpt", "32m") as ckpt,
        running_daemon(ckpt, extra=(*own.args(), *pattern)) as daemon,
    ):
        for node, allowed in (("gpu-2", True), ("cpu-7", False)):
            pair = certs.issue(ca, node=node)
            creds = grpc.ssl_channel_credentials(ca.cert, pair.key, pair.cert)
            options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
            with grpc.secure_channel(daemon.address, creds, options=options) as channel:
                stub = peer_pb2_grpc.PeerStub(channel)
                if allowed:
                    stub.ListItems(pb.ListItemsRequest(), timeout=5)
                    continue
                with pytest.raises(grpc.RpcError) as refused:
                    stub.ListItems(pb.ListItemsRequest(), timeout=5)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "does not match --tls-node-name-pattern" in (refused.value.details() or "")


def test_a_daemon_whose_certificate_names_no_node_does_not_start(tmp_path: Path) -> None:
    """Exit 2 and one line, unless --tls-shared-certificate keeps a shared one running."""
    ca = certs.new_ca()
    shared = node_tls(tmp_path / "tls", ca, node=None)
    line = _one_line_exit_2(_start(tmp_path, *shared.args()))
    assert "names no node" in line
    assert "mtc certs node" in line
    assert "--tls-shared-certificate" in line
    with DaemonProcess(
        tmp_path / "ckpt2", extra_args=(*shared.args(), "--tls-shared-certificate")
    ) as daemon:
        assert "node=(shared certificate)" in daemon.log()
