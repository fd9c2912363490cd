"""Mutual TLS against real daemons: who is refused, at which step, and that nothing moved.

Two daemons run with certificates from one throwaway CA (``tests/tls.py``); daemon A holds
a committed item of job ``secretjob``. Attackers are this test process with no
certificate, another CA's, an expired one, or plaintext. Each attack is refused at the
handshake, and the victims' stores are byte for byte what they were. The 4-node cluster
tests run with TLS on as well (``tests/integration/cluster.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator._pb.mtc.v1 import coordinator_pb2, coordinator_pb2_grpc, peer_pb2_grpc
from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.cluster.registry import Registry, RegistryEntry
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import MANIFEST_FILE, LocalStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.grpc_server import RpcServer
from mtc_replicator.transport.peer_client import PeerClient, PeerError
from tests.daemon_process import DaemonProcess
from tests.integration.grants import grant_receiver
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    RECEIVER,
    config_text,
    item_dir,
    ram_disk,
    read_text,
    receiver_args,
    running_daemon,
    sha256_tree,
    wait_ingested,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_coordinator_service import run
from tests.integration.test_peer import publish_step
from tests.tls import TEST_NODE, NodeTls, node_tls

pytestmark = pytest.mark.integration
T = TypeVar("T")
JOB = "secretjob"
STEP = 2


def accept_job(ckpt: Path, daemon: DaemonProcess, job: str = JOB, **keys: Any) -> None:
    write_yaml_atomic(ckpt, config_text(job, **({"nodes": 1} | keys)))
    wait_until(
        lambda: not (ckpt / CONFIG).exists() and f"accepted {CONFIG}: job={job}" in daemon.log(),
        f"{CONFIG} accepted",
        daemon=daemon,
    )


@dataclass
class Secure:
    ca: certs.Pair
    root: Path
    a_ckpt: Path
    b_ckpt: Path
    a: DaemonProcess
    b: DaemonProcess
    b_tls: NodeTls
    node: NodeTls
    """A legitimate node's certificate, for the test process in a daemon's role."""
    manifest: Manifest
    data: Path

    def snapshot(self) -> tuple[dict[str, str], dict[str, str]]:
        return sha256_tree(self.a_ckpt), sha256_tree(self.b_ckpt)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    root = tmp_path_factory.mktemp("tls")
    ca = certs.new_ca()
    a_tls = node_tls(root / "tls-a", ca)
    b_tls = node_tls(root / "tls-b", ca, node="node-b")
    with contextlib.ExitStack() as stack:
        a_ckpt = stack.enter_context(ram_disk(root / "a", "64m"))
        b_ckpt = stack.enter_context(ram_disk(root / "b", "1400m"))
        a = stack.enter_context(running_daemon(a_ckpt, extra=a_tls.args()))
        b = stack.enter_context(
            running_daemon(b_ckpt, extra=(*b_tls.args(), *receiver_args(b_ckpt)))
        )
        accept_job(a_ckpt, a)
        # B takes pushes of rank 0's items, from the node the grant names (no rank 0 runs).
        grant_receiver(b, ca, root, JOB, holders=(TEST_NODE, "node-b"))
        accept_job(b_ckpt, b, **RECEIVER)
        publish_step(a_ckpt, STEP)
        data = wait_ingested(a_ckpt, JOB, STEP, a)
        manifest = Manifest.from_json((item_dir(a_ckpt, JOB, STEP) / MANIFEST_FILE).read_bytes())
        yield Secure(
            ca, root, a_ckpt, b_ckpt, a, b, b_tls, node_tls(root / "tls-me", ca), manifest, data
        )


def test_the_ready_line_says_tls_is_on_and_no_warning(secure: Secure) -> None:
    assert "tls=on" in secure.a.log()
    assert "TLS is off" not in secure.a.log()


def test_a_node_of_the_ca_lists_pulls_and_pushes(secure: Secure, tmp_path: Path) -> None:
    """The positive control: the same calls with a certificate from the CA work."""

    async def scenario() -> None:
        async with PeerClient(timeout=10.0, tls=secure.node.material()) as client:
            listed = await client.list_items(secure.a.address, JOB)
            assert [i.item for i in listed] == [secure.manifest.item]
            store = LocalStore(tmp_path / "store")
            store.open()
            try:
                pulled = await client.pull_item(secure.a.address, secure.manifest.item, store)
            finally:
                store.close()
            assert pulled.digest == secure.manifest.digest
            await client.push_item(secure.b.address, secure.manifest, secure.data)

    run(scenario())
    held = item_dir(secure.b_ckpt, JOB, STEP, rank=secure.manifest.item.rank)
    assert (held / MANIFEST_FILE).exists()


# --- attackers ---------------------------------------------------------------------------------


def attacker_channel(kind: str, secure: Secure, address: str) -> grpc.Channel:
    if kind == "plaintext":
        return grpc.insecure_channel(address)
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    if kind == "no certificate":
        creds = grpc.ssl_channel_credentials(root_certificates=secure.ca.cert)
    elif kind == "another CA":
        other = certs.new_ca()
        own = certs.issue(other)
        creds = grpc.ssl_channel_credentials(secure.ca.cert, own.key, own.cert)
    elif kind == "expired":
        own_dir = node_tls(secure.root / f"expired-{uuid.uuid4().hex[:6]}", secure.ca, expired=True)
        creds = grpc.ssl_channel_credentials(
            secure.ca.cert, own_dir.files.key.read_bytes(), own_dir.files.cert.read_bytes()
        )
    else:
        raise AssertionError(kind)
    return grpc.secure_channel(address, creds, options=options)


ATTACKERS = ["plaintext", "no certificate", "another CA", "expired"]


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE, info.value  # type: ignore[attr-defined]
    return info.value


@pytest.mark.parametrize("kind", ATTACKERS)
def test_list_and_pull_are_refused_at_the_handshake(secure: Secure, kind: str) -> None:
    before = secure.snapshot()
    with attacker_channel(kind, secure, secure.a.address) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        refused(lambda: stub.ListItems(pb.ListItemsRequest(job=JOB), timeout=5))
        item = secure.manifest.item
        ref = pb.ItemRef(job=JOB, step=item.step, rank=item.rank, worker=item.worker)
        refused(lambda: list(stub.PullItem(pb.PullItemRequest(item=ref), timeout=5)))
    assert secure.snapshot() == before


@pytest.mark.parametrize("kind", ATTACKERS)
def test_a_forged_push_and_join_are_refused(secure: Secure, kind: str) -> None:
    before = secure.snapshot()
    item = secure.manifest.item
    forged = Manifest(
        ItemId(JOB, 999, item.rank, item.worker), secure.manifest.kind, secure.manifest.files
    )
    ref = pb.ItemRef(job=JOB, step=999, rank=item.rank, worker=item.worker)
    header = pb.PushHeader(item=ref, manifest=forged.to_json(), manifest_digest=forged.digest)
    with attacker_channel(kind, secure, secure.b.address) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        refused(lambda: stub.PushItem(iter([pb.PushItemRequest(header=header)]), timeout=5))
        coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)
        join = coordinator_pb2.JoinRequest(
            job=JOB, rank=0, incarnation_id="evil", cluster_view="{}", address="10.0.0.66:1"
        )
        refused(lambda: coordinator.Join(join, timeout=5))
    assert secure.snapshot() == before
    assert "join: incarnation evil" not in secure.b.log()


def test_a_tls_client_is_refused_by_a_plaintext_daemon(secure: Secure, tmp_path: Path) -> None:
    """The reverse: a node with TLS never talks to a daemon without it."""
    with ram_disk(tmp_path / "plain", "32m") as ckpt, running_daemon(ckpt) as plain:
        assert "TLS is off" in plain.log()  # said at warning level at start

        async def scenario() -> None:
            async with PeerClient(timeout=5.0, tls=secure.node.material()) as client:
                with pytest.raises(PeerError):
                    await client.list_items(plain.address, JOB)

        run(scenario())


def test_the_data_port_refuses_a_connection_that_skips_tls(secure: Secure) -> None:
    before = secure.snapshot()
    port = int(secure.a.log().rsplit("data-port=", 1)[1].split()[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(os.urandom(16))  # a token's worth, in plaintext
        raw.settimeout(15)
        with contextlib.suppress(ConnectionResetError):
            assert raw.recv(1) == b""  # closed, nothing served
    wait_until(lambda: "sent no token" in secure.a.log(), "the refusal logged", daemon=secure.a)
    assert secure.snapshot() == before


# --- the registry is not an identity --------------------------------------------------------


def test_an_impostor_in_the_registry_is_refused_and_reported(tmp_path: Path) -> None:
    """A registry entry (anyone who can write the bucket) names an impostor coordinator with
    a self-signed certificate: the rank refuses it at the handshake, says so in
    ``replicator.errors``, and never joins."""
    ca = certs.new_ca()
    job = f"victim-{uuid.uuid4().hex[:6]}"
    registry_dir = tmp_path / "registry"
    registry_dir.mkdir()
    impostor_tls = node_tls(tmp_path / "impostor", certs.new_ca())
    config = JobConfig(job, Framework.ORBAX, node_rank=0, nodes=2, peers_per_node=1)
    host = CoordinatorHost()
    host.host(config, cluster_view_json(config))
    started = threading.Event()
    stop: list[Callable[[], None]] = []
    address: list[str] = []

    def impostor() -> None:
        async def serve() -> None:
            rpc = RpcServer()
            rpc.add_service(
                "mtc.v1.Coordinator", CoordinatorServicer(Coordinators(host, lambda j: {})).register
            )
            address.append(rpc.bind("127.0.0.1:0", impostor_tls.material().server_credentials()))
            await rpc.start()
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            stop.append(lambda: loop.call_soon_threadsafe(done.set))
            started.set()
            await done.wait()
            await rpc.stop(0.1)

        asyncio.run(serve())

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        Registry(FileObjectStore(registry_dir)).register(
            RegistryEntry(job, address[0], "impostor01", time.time())
        )
        with (
            ram_disk(tmp_path / "rank1", "32m") as ckpt,
            running_daemon(
                ckpt,
                extra=(
                    "--registry",
                    registry_dir.as_uri(),
                    *node_tls(tmp_path / "rank1-tls", ca).args(),
                    # The entry is unsigned: let it through to the handshake this tests
                    # (test_signed_records refuses it before any dial).
                    "--accept-unsigned-records",
                ),
            ) as rank1,
        ):
            write_yaml_atomic(ckpt, config_text(job, rank=1, nodes=2, peers_per_node=1))
            wait_until(
                lambda: "refused the coordinator" in read_text(ckpt / ERRORS),
                "the impostor reported",
                daemon=rank1,
            )
            assert address[0] in read_text(ckpt / ERRORS)
            time.sleep(1.0)  # retries go on with backoff; none may get through
            coordinator = host.get(job)
            assert coordinator is not None
            assert coordinator.coordinator.members == {}, "the impostor was joined"
            assert not list(ckpt.glob("*.restore"))
    finally:
        stop[0]()
        thread.join(10)


# --- rotation ---------------------------------------------------------------------------------


def _presented_serial(address: str, me: NodeTls) -> int:
    host, port = address.rsplit(":", 1)
    context = me.material().client_context()
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=certs.DEFAULT_SERVER_NAME) as s,
    ):
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_rotation_during_a_1_gib_push_keeps_the_push_and_takes_the_new_certificate(
    secure: Secure, tmp_path: Path
) -> None:
    """cert-manager renews the Secret in place: the daemon serves the new certificate to new
    connections without a restart, and a push of 1 GiB in flight completes."""
    big = tmp_path / "big"
    (big / "state").mkdir(parents=True)
    block = os.urandom(1 << 20)
    with open(big / "state" / "shard.bin", "wb") as f:
        for _ in range(1024):
            f.write(block)
    manifest = secure.node.attest(build_manifest(ItemId(JOB, 77, 0, 0), big))
    data_port = secure.b.log().rsplit("data-port=", 1)[1].split()[0]
    grpc_host, grpc_port = secure.b.address.rsplit(":", 1)
    old_serial = _presented_serial(f"{grpc_host}:{data_port}", secure.node)
    b_pid = secure.b.pid

    async def scenario() -> None:
        async with PeerClient(timeout=30.0, tls=secure.node.material()) as client:
            push = asyncio.create_task(client.push_item(secure.b.address, manifest, big))
            # Rotate once the bytes are flowing: a renewed leaf from the same CA.
            await asyncio.sleep(0.3)
            renewed = certs.issue(secure.ca, node="node-b")
            certs.write_pair(secure.b_tls.root, renewed, certs.NODE_CERT, certs.NODE_KEY)
            assert await push is False  # done, not "already held"

    run(scenario(), timeout=120)
    held = item_dir(secure.b_ckpt, JOB, 77, rank=0)
    assert Manifest.from_json((held / MANIFEST_FILE).read_bytes()).digest == manifest.digest
    assert secure.b.pid == b_pid  # no restart
    assert secure.b.running
    new_serial = _presented_serial(f"{grpc_host}:{data_port}", secure.node)
    assert new_serial != old_serial
    wait_until(
        lambda: "TLS certificate reloaded" in secure.b.log(), "the reload logged", daemon=secure.b
    )
    assert grpc_port  # the gRPC port serves the new certificate too:

    async def listed() -> int:
        async with PeerClient(timeout=10.0, tls=secure.node.material()) as client:
            return len(await client.list_items(secure.b.address, JOB))

    assert run(listed()) >= 1


# --- flags ----------------------------------------------------------------------------------


def test_half_the_tls_flags_is_a_usage_error(tmp_path: Path) -> None:
    me = node_tls(tmp_path / "tls", certs.new_ca())
    base = [
        sys.executable,
        "-m",
        "mtc_replicator.node.daemon",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--listen",
        "127.0.0.1:0",
    ]
    half = subprocess.run(
        [*base, "--tls-cert", str(me.files.cert)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert half.returncode == 2
    assert "go together" in half.stderr
    missing = subprocess.run(
        [*base, *me.args()[:-1], str(tmp_path / "nope.pem")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2
    assert "cannot read the TLS CA" in missing.stdout + missing.stderr


def test_the_plaintext_health_port_serves_health_and_nothing_else(tmp_path: Path) -> None:
    """``--health-listen`` is for kubelet probes, which have no certificate: it answers the
    health service in plaintext and refuses every other call."""
    me = node_tls(tmp_path / "tls", certs.new_ca())
    with (
        ram_disk(tmp_path / "ckpt", "32m") as ckpt,
        running_daemon(ckpt, extra=(*me.args(), "--health-listen", "127.0.0.1:0")) as daemon,
    ):
        health = daemon.log().rsplit("health=", 1)[1].split()[0]
        with grpc.insecure_channel(health) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                peer_pb2_grpc.PeerStub(channel).ListItems(pb.ListItemsRequest(), timeout=5)
            assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
