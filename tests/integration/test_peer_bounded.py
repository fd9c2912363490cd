"""Bounded resources against a real daemon: stalls, floods of connections, huge manifests and
items of many files must cost the daemon a bounded amount, for a bounded time, and never
keep real transfers from completing (issue 16, item 6).

One daemon, with a short idle timeout and a low descriptor limit, takes every test in
turn, as a node would. Pushes and pulls come from a raw gRPC stub (hostile) or from the
product's ``PeerClient`` (a real peer), over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport import datapool
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.transfer import room_on
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    CONFIG,
    FAST_ARGS,
    RECEIVER,
    config_text,
    item_dir,
    ram_disk,
    receiver_args,
    store_root,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
Code = grpc.StatusCode
IDLE = 2.0
"""The daemon's idle timeout here (``MTC_IDLE_TIMEOUT_SECONDS``): short, so stalls end fast."""
NOFILE = 256
"""The daemon's descriptor limit: far below the files of the many-files item."""


@dataclass
class Node:
    job: str
    ckpt: Path
    daemon: DaemonProcess
    stub: peer_pb2_grpc.PeerStub
    data_port: int


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("bounded")
    job = f"bounded-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(ram_disk(root / "ckpt", "512m"))
        daemon = DaemonProcess(
            ckpt,
            extra_args=(*FAST_ARGS, *receiver_args(ckpt)),
            # Over the 140,000 files of the huge manifest below: it is refused for its size
            # after a full check, not for its count (test_peer_limits.py covers that).
            env={"MTC_IDLE_TIMEOUT_SECONDS": str(IDLE), "MTC_MAX_ITEM_FILES": "200000"},
            max_open_files=NOFILE,
        )
        daemon.start()
        stack.callback(lambda: print(f"--- daemon log ---\n{daemon.log()[-20000:]}"))
        stack.callback(lambda: daemon.stop(timeout=15) if daemon.running else None)
        # Rank 1 of a 2-node job: the rank that rank 0's items (the tests' pushes) go to. It
        # waits in its restore round for the whole module, taking pushes meanwhile.
        write_yaml_atomic(ckpt, config_text(job, **RECEIVER))
        wait_until(lambda: not (ckpt / CONFIG).exists(), "the handshake accepted", daemon=daemon)
        channel = stack.enter_context(grpc.insecure_channel(daemon.address))
        port = int(daemon.log().rsplit("data-port=", 1)[1].split()[0])
        yield Node(job, ckpt, daemon, peer_pb2_grpc.PeerStub(channel), port)


# --- requests ----------------------------------------------------------------------------------


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def push_header(job: str, step: int, body: dict[str, Any], *, data_channel: bool = False) -> Any:
    raw = json.dumps(
        {"version": 1, "job": job, "step": step, "rank": 0, "worker": 0, **body},
        separators=(",", ":"),
        sort_keys=True,
    ).encode()
    return pb.PushItemRequest(
        header=pb.PushHeader(
            item=pb.ItemRef(job=job, step=step, rank=0, worker=0),
            manifest=raw,
            manifest_digest=hashlib.sha256(raw).hexdigest(),
            data_channel=data_channel,
        )
    )


def one_file(size: int, checksum: int = 0) -> dict[str, Any]:
    return {"kind": "dir", "dirs": [], "files": [["f", size, f"{checksum:08x}"]]}


def small_push(n: Node, step: int, data: bytes) -> pb.PushItemResponse:
    mib = 1 << 20
    requests = [
        push_header(n.job, step, one_file(len(data), crc(data))),
        *(
            pb.PushItemRequest(
                chunk=pb.Chunk(
                    file_index=0,
                    offset=at,
                    data=data[at : at + mib],
                    crc32c=crc(data[at : at + mib]),
                )
            )
            for at in range(0, len(data), mib)
        ),
    ]
    reply: pb.PushItemResponse = n.stub.PushItem(iter(requests), timeout=20)
    return reply


def staging(n: Node) -> list[Path]:
    return list((store_root(n.ckpt) / "staging").iterdir())


def healthy(n: Node, timeout: float = 5) -> bool:
    with grpc.insecure_channel(n.daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="mtc.v1.Peer"), timeout=timeout
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def make_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def push(
    n: Node, manifest: Manifest, data: Path, *, data_channel: bool = True, timeout: float = 5
) -> bool:
    async def go() -> bool:
        async with PeerClient(timeout=timeout, data_channel=data_channel) as client:
            return await client.push_item(n.daemon.address, manifest, data)

    return asyncio.run(go())


# --- stalls --------------------------------------------------------------------------------------

STALLS = ["after-the-header", "mid-file", "data-channel-never-connects", "data-channel-goes-quiet"]


@pytest.mark.parametrize("how", STALLS)
def test_a_stalled_push_gives_back_its_reservation_after_the_idle_timeout(
    node: Node, how: str
) -> None:
    """A push declares (nearly) all the free space, then stalls: while it holds the space
    others are refused, and after the idle timeout it is dropped, its staging removed and
    its space free again, whatever the sender does."""
    step = 100 + STALLS.index(how)
    declared = room_on(store_root(node.ckpt)) - (4 << 20)
    gate = threading.Event()
    channel = how.startswith("data-channel")

    def requests() -> Iterator[pb.PushItemRequest]:
        yield push_header(node.job, step, one_file(declared), data_channel=channel)
        if how == "mid-file":
            data = b"x" * 1000
            yield pb.PushItemRequest(
                chunk=pb.Chunk(file_index=0, offset=0, data=data, crc32c=crc(data))
            )
        gate.wait(60)

    conn: socket.socket | None = None
    call = node.stub.PushItem.future(requests(), timeout=60)
    try:
        if how == "data-channel-goes-quiet":
            port, token = dict(call.initial_metadata())["mtc-data-channel"].split()
            conn = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
            conn.sendall(bytes.fromhex(token) + b"x" * 1000)
        else:
            call.initial_metadata()  # the header is accepted: the space is reserved
        with pytest.raises(grpc.RpcError) as full:
            small_push(node, step + 50, os.urandom(8 << 20))
        assert full.value.code() == Code.RESOURCE_EXHAUSTED, full.value.details()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as dropped:
            call.result(timeout=IDLE + 20)
        assert dropped.value.code() == Code.UNAVAILABLE, dropped.value.details()
        assert time.monotonic() - t0 < IDLE + 15
    finally:
        gate.set()
        if conn is not None:
            conn.close()
    wait_until(lambda: staging(node) == [], "staging emptied", daemon=node.daemon)
    data = os.urandom(8 << 20)
    assert small_push(node, step + 50, data).bytes_received == len(data)
    assert (item_dir(node.ckpt, node.job, step + 50) / "data" / "f").read_bytes() == data
    assert not item_dir(node.ckpt, node.job, step).exists()
    assert healthy(node)


# --- floods of connections ---------------------------------------------------------------------


@contextlib.contextmanager
def idle_connections(port: int, source: str, count: int = 100) -> Iterator[None]:
    """``count`` connections from ``source`` to the data port that never send a byte; any
    the daemon closes is opened again at once, so its slots stay taken."""
    stop = threading.Event()
    socks: list[socket.socket] = []

    def alive(s: socket.socket) -> bool:
        if not select.select([s], [], [], 0)[0]:
            return True
        try:
            return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def keep() -> None:
        while not stop.is_set():
            for s in [s for s in socks if not alive(s)]:
                socks.remove(s)
                s.close()
            while len(socks) < count and not stop.is_set():
                try:
                    socks.append(
                        socket.create_connection(
                            ("127.0.0.1", port), timeout=2, source_address=(source, 0)
                        )
                    )
                except OSError:
                    break
            stop.wait(0.02)

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    try:
        time.sleep(1.0)  # all of them connected and presenting nothing
        yield
    finally:
        stop.set()
        thread.join(10)
        for s in socks:
            s.close()


@pytest.mark.parametrize(
    ("source", "via"),
    [("127.0.0.2", "over the data channel"), ("127.0.0.1", "in gRPC chunks")],
    ids=["from-another-host", "from-the-pushers-own-host"],
)
def test_a_real_push_completes_through_a_flood_of_idle_connections(
    node: Node, tmp_path: Path, source: str, via: str
) -> None:
    """100 idle connections to the data port: from another host they take only that host's
    handshake slots, and the push goes over the data channel; from the pusher's own host
    its connection is refused, and the push goes again in gRPC chunks. Either way it
    completes, verified."""
    step = 200 if source == "127.0.0.2" else 201
    files = {"a": os.urandom(3 << 20), "d/b": os.urandom(1000)}
    data = make_tree(tmp_path / "item", files)
    manifest = build_manifest(ItemId(node.job, step, 0, 0), data)
    with idle_connections(node.data_port, source):
        assert push(node, manifest, data) is False
    stored = item_dir(node.ckpt, node.job, step) / "data"
    assert (stored / "a").read_bytes() == files["a"]
    assert (stored / "d" / "b").read_bytes() == files["d/b"]
    received = [line for line in node.daemon.log().splitlines() if f"/s{step}/" in line]
    assert any("received" in line and via in line for line in received), received
    wait_until(lambda: staging(node) == [], "staging emptied", daemon=node.daemon)


def task_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_many_stalled_pulls_hold_a_bounded_number_of_threads(node: Node, tmp_path: Path) -> None:
    """60 pulls that ask for the data channel, connect, and never read: at most a few
    transfer threads (the channel's slots for one host), the rest offered gRPC chunks or
    refused past the per-host limit; once the idle timeout passed, pulls work again."""
    step = 300
    data = make_tree(tmp_path / "item", {"big": os.urandom(24 << 20)})
    manifest = build_manifest(ItemId(node.job, step, 0, 0), data)
    assert push(node, manifest, data, data_channel=False) is False
    before = task_count(node.daemon.pid)
    request = pb.PullItemRequest(
        item=pb.ItemRef(job=node.job, step=step, rank=0, worker=0), data_channel=True
    )
    streams: list[Any] = []
    conns: list[socket.socket] = []
    refused: list[grpc.StatusCode] = []
    try:
        for _ in range(60):
            stream = node.stub.PullItem(request, timeout=60)
            streams.append(stream)
            try:
                header = next(stream).header
            except grpc.RpcError as exc:
                refused.append(exc.code())
                continue
            if header.data_port:
                s = socket.create_connection(("127.0.0.1", header.data_port), timeout=10)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(header.data_token)
                conns.append(s)
        time.sleep(1.0)  # the senders fill the socket buffers and block
        grown = task_count(node.daemon.pid) - before
        assert grown <= datapool.MAX_TRANSFERS, f"{grown} more threads"
        assert 0 < len(conns) <= datapool.MAX_TRANSFERS_PER_PEER
        assert set(refused) <= {Code.RESOURCE_EXHAUSTED}
    finally:
        for s in conns:
            s.close()
        for stream in streams:
            stream.cancel()

    async def pull() -> Manifest:
        store = LocalStore(tmp_path / "puller")
        store.open()
        async with PeerClient(timeout=10) as client:
            return await client.pull_item(node.daemon.address, manifest.item, store)

    assert asyncio.run(pull()) == manifest
    assert healthy(node)


# --- huge manifests and many files ---------------------------------------------------------------


def test_health_answers_while_a_huge_manifest_is_checked(node: Node) -> None:
    """A 13 MiB header of 140,000 files 20 levels deep: checked off the event loop, so the
    daemon keeps answering health checks; refused (too large) with nothing written."""
    step = 400
    dirs = ["/".join(f"d{i}" for i in range(depth)) for depth in range(1, 21)]
    files = [[f"{dirs[-1]}/f{i:06d}", 0, "00000000"] for i in range(140_000)]
    files[0] = [files[0][0], 1 << 40, "00000000"]
    request = push_header(node.job, step, {"kind": "dir", "dirs": dirs, "files": files})
    assert request.ByteSize() > 12 << 20
    outcome: list[grpc.RpcError] = []

    def attack() -> None:
        try:
            node.stub.PushItem(iter([request]), timeout=120)
        except grpc.RpcError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=attack)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        t0 = time.monotonic()
        assert healthy(node, timeout=10)
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    thread.join()
    assert len(outcome) == 1
    assert outcome[0].code() == Code.RESOURCE_EXHAUSTED, outcome[0].details()
    assert slowest < 2.0, f"a health check took {slowest:.1f}s"
    assert staging(node) == []
    assert not item_dir(node.ckpt, node.job, step).exists()


def test_an_item_of_30000_files_crosses_under_a_low_descriptor_limit(
    node: Node, tmp_path: Path
) -> None:
    """30,000 files, half of them empty, against a daemon limited to 256 descriptors:
    pushed over the data channel and in chunks, and pulled back both ways, byte for byte."""
    files = {f"d{i % 30}/f{i:05d}": (b"" if i % 2 else bytes([i % 251])) for i in range(30_000)}
    data = make_tree(tmp_path / "item", files)
    for step, channel in ((500, True), (501, False)):
        manifest = build_manifest(ItemId(node.job, step, 0, 0), data)
        assert push(node, manifest, data, data_channel=channel, timeout=30) is False
        stored = item_dir(node.ckpt, node.job, step) / "data"
        assert len(list(stored.rglob("f*"))) == 30_000

        async def pull(m: Manifest = manifest, c: bool = channel) -> Manifest:
            store = LocalStore(tmp_path / f"puller-{m.item.step}")
            store.open()
            async with PeerClient(timeout=30, data_channel=c) as client:
                got = await client.pull_item(node.daemon.address, m.item, store)
            store.verify(m.item)
            return got

        assert asyncio.run(pull()) == manifest
    assert healthy(node)
