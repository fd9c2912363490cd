"""Bounds a hostile peer meets on a real daemon (issue 23, items 5 and 7): a whole-transfer
deadline from the item's size and ``--min-transfer-rate``, a total deadline on every TLS
handshake, and a file-count and inode budget per push.

Each attack here held its resource without end before: a push or a pull that moves one
slice a second (under the idle timeout) kept its reservation, a ClientHello dripped a byte
every 3 s kept its connection, and a push of many empty files passed every byte check. One
plaintext daemon (a small idle timeout, an 8 MiB/s floor, a tmpfs of 20,000 inodes) takes
the transfer attacks in turn; a TLS daemon takes the dripped handshakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.pacing import PaceRules
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.tools import certs
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.peer_client import PeerClient
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import (
    CONFIG,
    FAST_ARGS,
    RECEIVER,
    config_text,
    item_dir,
    make_step,
    ram_disk,
    receiver_args,
    running_daemon,
    store_root,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_peer_bounded import crc, one_file, push_header
from tests.tls import node_tls

pytestmark = pytest.mark.integration
Code = grpc.StatusCode
MiB = 1 << 20
IDLE = 5.0
"""The daemon's idle timeout here: 16 times a slow reader's pause between reads (a CI run
once saw one gRPC write wait 3 s on a loaded box, and the pull went for idleness, not for
the floor under test)."""
FLOOR = 8 * MiB
SIZE = 64 * MiB
DEADLINE = IDLE + (SIZE + 4096) / FLOOR
"""About 13 s: what a push or pull of ``SIZE`` bytes in one file may take here in all."""
SLACK = 8.0
"""A loaded box's delay in noticing and answering."""
MAX_ITEM_FILES = 50_000
INODES = 20_000


@dataclass
class Node:
    job: str
    ckpt: Path
    daemon: DaemonProcess
    stub: peer_pb2_grpc.PeerStub


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("limits")
    job = f"limits-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(ram_disk(root / "ckpt", f"512m,nr_inodes={INODES}"))
        daemon = DaemonProcess(
            ckpt,
            extra_args=(
                *FAST_ARGS,
                *receiver_args(ckpt),
                "--min-transfer-rate",
                "8MiB",
                "--max-item-files",
                str(MAX_ITEM_FILES),
            ),
            env={"MTC_IDLE_TIMEOUT_SECONDS": str(IDLE)},
        )
        daemon.start()
        stack.callback(lambda: print(f"--- daemon log ---\n{daemon.log()[-20000:]}"))
        stack.callback(lambda: daemon.stop(timeout=15) if daemon.running else None)
        write_yaml_atomic(ckpt, config_text(job, **RECEIVER))
        wait_until(lambda: not (ckpt / CONFIG).exists(), "the handshake accepted", daemon=daemon)
        channel = stack.enter_context(grpc.insecure_channel(daemon.address))
        yield Node(job, ckpt, daemon, peer_pb2_grpc.PeerStub(channel))


def empty_files(count: int) -> dict[str, Any]:
    return {"kind": "dir", "dirs": [], "files": [[f"{i:06d}", 0, "00000000"] for i in range(count)]}


def staging(n: Node) -> list[Path]:
    return list((store_root(n.ckpt) / "staging").iterdir())


def real_push(n: Node, tmp: Path, step: int, *, pacer: Pacer | None = None) -> float:
    """Push a ``SIZE`` item the way a peer daemon does; the seconds it took."""
    tmp.mkdir(exist_ok=True)
    (tmp / "f").write_bytes(os.urandom(SIZE))
    manifest = build_manifest(ItemId(n.job, step, 0, 0), tmp)

    async def go() -> float:
        async with PeerClient(timeout=10.0, pacer=pacer) as client:
            t0 = time.monotonic()
            await client.push_item(n.daemon.address, manifest, tmp)
            return time.monotonic() - t0

    return asyncio.run(go())


def assert_dropped_in_time(error: grpc.RpcError, t0: float) -> None:
    assert error.code() == Code.UNAVAILABLE, (error.code(), error.details())
    assert "under the minimum rate" in str(error.details()), error.details()
    assert time.monotonic() - t0 < DEADLINE + SLACK


# --- a whole-transfer deadline -----------------------------------------------------------------

DRIPS = ["grpc-chunks", "data-channel"]


@pytest.mark.parametrize("how", DRIPS)
def test_a_push_dripping_under_the_floor_is_dropped_at_its_deadline(node: Node, how: str) -> None:
    """A push of ``SIZE`` declared bytes that sends 1,000 bytes a second (never idle for the
    5 s idle timeout) is dropped after ``DEADLINE``: its reservation and staging go."""
    step = 10 + DRIPS.index(how)
    stop = threading.Event()
    channel = how == "data-channel"
    slice_ = b"x" * 1000

    def requests() -> Iterator[pb.PushItemRequest]:
        yield push_header(node.job, step, one_file(SIZE), data_channel=channel)
        offset = 0
        while not channel and not stop.wait(1.0):
            chunk = pb.Chunk(file_index=0, offset=offset, data=slice_, crc32c=crc(slice_))
            yield pb.PushItemRequest(chunk=chunk)
            offset += len(slice_)
        stop.wait(60)

    t0 = time.monotonic()
    call = node.stub.PushItem.future(requests(), timeout=60)
    conn: socket.socket | None = None
    try:
        if channel:
            port, token = dict(call.initial_metadata())["mtc-data-channel"].split()
            conn = socket.create_connection(("127.0.0.1", int(port)), timeout=10)
            conn.sendall(bytes.fromhex(token))
            with contextlib.suppress(OSError):
                while not call.done() and time.monotonic() - t0 < DEADLINE + 2 * SLACK:
                    conn.sendall(slice_)
                    time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as dropped:
            call.result(timeout=DEADLINE + 2 * SLACK)
        assert_dropped_in_time(dropped.value, t0)
    finally:
        stop.set()
        if conn is not None:
            conn.close()
    wait_until(lambda: staging(node) == [], "staging emptied", daemon=node.daemon)
    assert not item_dir(node.ckpt, node.job, step).exists()
    assert "under the minimum rate" in node.daemon.log()


def test_a_paced_push_over_the_floor_completes(node: Node, tmp_path: Path) -> None:
    """A push paced at 10 MiB/s (over the 8 MiB/s floor) takes most of its deadline and
    completes: the floor drops only a sender slower than every paced one."""
    elapsed = real_push(node, tmp_path / "item", 20, pacer=Pacer(PaceRules(rate=10 * MiB)))
    assert elapsed > SIZE / (10 * MiB) * 0.8, elapsed
    assert (item_dir(node.ckpt, node.job, 20) / "data" / "f").stat().st_size == SIZE


READ_PAUSE = 0.3
"""Between two reads of a slow puller: a 1 MiB chunk (3.3 MiB/s, under the floor) or 64 KiB,
often enough that the server's writes never wait the idle timeout."""


@contextlib.contextmanager
def channel_read_slowly(header: pb.PullHeader, read: list[int]) -> Iterator[None]:
    """Present a pull's data token and read its bytes 64 KiB at a time, in a thread, until
    the connection ends or the block exits; ``read`` gets the bytes read."""
    stop = threading.Event()

    def reader() -> None:
        with socket.create_connection(("127.0.0.1", header.data_port), timeout=10) as conn:
            conn.sendall(header.data_token)
            while not stop.is_set():
                try:
                    got = conn.recv(64 << 10)
                except OSError:
                    return
                if not got:
                    return
                read.append(len(got))
                stop.wait(READ_PAUSE)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(15)


@pytest.mark.parametrize("data_channel", [False, True], ids=["grpc-chunks", "data-channel"])
def test_a_pull_read_under_the_floor_is_dropped_at_its_deadline(
    node: Node, tmp_path: Path, data_channel: bool
) -> None:
    """A restoring peer that reads a pulled item slowly (a chunk or 64 KiB a second) no
    longer holds the transfer, its thread and its slot for as long as it likes."""
    step = 30 + data_channel
    real_push(node, tmp_path / "item", step)
    request = pb.PullItemRequest(
        item=pb.ItemRef(job=node.job, step=step, rank=0, worker=0), data_channel=data_channel
    )
    t0 = time.monotonic()
    received = 0

    def read_slowly() -> None:
        nonlocal received
        # A stream window of several chunks: each read frees room for the server's next
        # write at once (with the default 64 KiB window its writes waited for the reads).
        options = [("grpc.http2.lookahead_bytes", 4 * MiB)]
        with grpc.insecure_channel(node.daemon.address, options=options) as channel:
            stub = peer_pb2_grpc.PeerStub(channel)
            read_stream(stub.PullItem(request, timeout=60))

    def read_stream(stream: Iterator[pb.PullItemResponse]) -> None:
        nonlocal received
        for response in stream:
            if response.WhichOneof("body") == "header" and response.header.data_token:
                read: list[int] = []
                with channel_read_slowly(response.header, read):
                    # The verdict comes over gRPC: it waits here while the bytes trickle.
                    for _ in stream:
                        pass
                received += sum(read)
            else:
                received += len(response.chunk.data)
                time.sleep(READ_PAUSE)
            assert time.monotonic() - t0 < DEADLINE + 2 * SLACK, "still served"

    with pytest.raises(grpc.RpcError) as dropped:
        read_slowly()
    assert received < SIZE
    assert_dropped_in_time(dropped.value, t0)


# --- file count and inodes -----------------------------------------------------------------------


def test_a_push_of_more_files_than_an_item_may_have_is_refused_before_staging(node: Node) -> None:
    """50,001 empty files: refused by the manifest check, no file created."""
    with pytest.raises(grpc.RpcError) as refused:
        node.stub.PushItem(
            iter([push_header(node.job, 40, empty_files(MAX_ITEM_FILES + 1))]), timeout=60
        )
    assert refused.value.code() == Code.INVALID_ARGUMENT, refused.value.details()
    assert f"more than {MAX_ITEM_FILES} (the most one item may have here: --max-item-files)" in str(
        refused.value.details()
    )
    assert staging(node) == []
    assert not item_dir(node.ckpt, node.job, 40).exists()


def test_a_push_of_more_files_than_the_node_has_inodes_for_is_refused(node: Node) -> None:
    """25,000 empty files pass the item's limit and every byte check, but not the tmpfs's
    20,000 inodes: refused RESOURCE_EXHAUSTED naming inodes, before staging; a push that
    fits is taken afterwards."""
    with pytest.raises(grpc.RpcError) as refused:
        node.stub.PushItem(iter([push_header(node.job, 41, empty_files(25_000))]), timeout=60)
    assert refused.value.code() == Code.RESOURCE_EXHAUSTED, refused.value.details()
    assert "inodes" in str(refused.value.details()), refused.value.details()
    assert staging(node) == []
    reply = node.stub.PushItem(iter([push_header(node.job, 42, empty_files(1000))]), timeout=60)
    assert len(os.listdir(item_dir(node.ckpt, node.job, 42) / "data")) == 1000
    assert reply.bytes_received == 0


@pytest.mark.parametrize("cluster_extra", [("--max-item-files", "20")])
def test_a_real_step_over_the_file_limit_is_kept_and_its_refused_push_reported(
    cluster: Cluster,
) -> None:
    """A job whose step has more files than its peers take (``--max-item-files 20``, 31
    files): the step is still ingested and committed at home, never refused there; its
    push is refused by the peer, and the job sees why in ``replicator.errors``."""
    cluster.fresh_start()
    files = {f"state/shard_{i:03d}.bin": bytes([i]) * 100 for i in range(30)}
    files["_CHECKPOINT_METADATA"] = b'{"step": 5}'
    make_step(cluster.dirs[1], 5, files)
    wait_until(
        lambda: (5, "1-0") in cluster.held(1), "rank 1 committed step 5", daemon=cluster.daemon(1)
    )
    wait_until(
        lambda: "--max-item-files" in cluster.errors(1),
        "the refused push in rank 1's replicator.errors",
        daemon=cluster.daemon(1),
    )
    assert "replication to rank" in cluster.errors(1)
    assert all((5, "1-0") not in cluster.held(r) for r in range(NODES) if r != 1)


# --- handshakes ----------------------------------------------------------------------------------


def _drip(port: int, until: float, closed: dict[int, float], t0: float) -> None:
    """A ClientHello's first bytes, then one byte every 3 s: each read of the server sees
    progress within its per-read timeout. Records when the server closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.settimeout(0.5)
        hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(32)
        for byte in hello:
            if time.monotonic() >= until:
                return
            try:
                conn.sendall(bytes([byte]))
                if conn.recv(1) == b"":
                    closed[port] = time.monotonic() - t0
                    return
            except TimeoutError:
                pass
            except OSError:
                closed[port] = time.monotonic() - t0
                return
            time.sleep(2.5)


def test_a_dripped_tls_handshake_is_closed_within_its_deadline(tmp_path: Path) -> None:
    """A ClientHello dripped a byte every 3 s to the data port and to the gRPC port of a
    TLS daemon: each connection is closed within 10 s of opening, plus slack."""
    tls = node_tls(tmp_path / "tls", certs.new_ca())
    with ram_disk(tmp_path / "ram", "64m") as ckpt, running_daemon(ckpt, extra=tls.args()) as d:
        data_port = int(d.log().rsplit("data-port=", 1)[1].split()[0])
        grpc_port = int(d.address.rpartition(":")[2])
        closed: dict[int, float] = {}
        t0 = time.monotonic()
        until = t0 + datachannel.HANDSHAKE_SECONDS + 2 * SLACK
        threads = [
            threading.Thread(target=_drip, args=(port, until, closed, t0))
            for port in (data_port, grpc_port)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert set(closed) == {data_port, grpc_port}, closed
        assert max(closed.values()) < datachannel.HANDSHAKE_SECONDS + SLACK, closed
