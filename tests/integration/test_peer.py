"""The peer data plane between real daemon processes on loopback.

Daemon A ingests a step the way a workload publishes one; the test process, with
``PeerClient`` (the code daemons use), pushes A's committed item to daemon B (serving the
same job), pushes it again, pulls it back into a third store, lists what each holds and
checks the health service. A last test pushes and pulls a 256 MiB item and checks that the
daemon's peak memory does not grow with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import blake3
import google_crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.manifest import CorruptItem, FileEntry, ItemId, ItemKind, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import MANIFEST_FILE, LocalStore
from mtc_replicator.node.daemon import SERVER_GRACE_SECONDS
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.peer_client import (
    ItemInfo,
    ItemNotFound,
    PeerClient,
    PeerError,
    PeerUnavailable,
)
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    CONFIG,
    RECEIVER,
    config_text,
    item_dir,
    ram_disk,
    read_tree,
    receiver_args,
    running_daemon,
    sha256_tree,
    store_root,
    wait_ingested,
    wait_until,
    write_big_step_tmp,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
T = TypeVar("T")
STEP = 7


def with_client(fn: Callable[[PeerClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with PeerClient(timeout=10.0) as client:
            return await fn(client)

    return asyncio.run(main())


def accept_job(ckpt: Path, daemon: DaemonProcess, job: str, **keys: Any) -> None:
    """Hand the daemon a ``replicator.yaml`` of ``job``: from then on it serves the job.

    A one-node job by default, so the daemon needs no coordinator; with ``RECEIVER`` keys
    it takes pushes of rank 0's items and waits in its restore round meanwhile. The peer
    data plane is what is tested here, with the test process in the role of the pushing
    and pulling daemon.
    """
    write_yaml_atomic(ckpt, config_text(job, **({"nodes": 1} | keys)))
    wait_until(
        lambda: not (ckpt / CONFIG).exists() and f"accepted {CONFIG}: job={job}" in daemon.log(),
        f"{CONFIG} accepted",
        daemon=daemon,
    )


def publish_step(ckpt: Path, step: int) -> None:
    """A workload's step with nested files, an empty file and an empty directory."""
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-{uuid.uuid4().hex[:8]}"
    (tmp / "state" / "d").mkdir(parents=True)
    (tmp / "empty_dir").mkdir()
    (tmp / "_CHECKPOINT_METADATA").write_bytes(b'{"step": %d}' % step)
    (tmp / "state" / "d" / "array.bin").write_bytes(os.urandom(3 << 20 | 12345))
    (tmp / "state" / "empty.bin").write_bytes(b"")
    os.rename(tmp, ckpt / str(step))


def tree_shape(root: Path) -> set[str]:
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*")}


@dataclass
class Pair:
    job: str
    a_ckpt: Path
    b_ckpt: Path
    a: DaemonProcess
    b: DaemonProcess
    manifest: Manifest
    """A's committed item, as A's store wrote it."""
    data: Path

    @property
    def item(self) -> ItemId:
        return self.manifest.item


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    root = tmp_path_factory.mktemp("peer")
    job = f"peer-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        a_ckpt = stack.enter_context(ram_disk(root / "a", "64m"))
        b_ckpt = stack.enter_context(ram_disk(root / "b", "128m"))
        a = stack.enter_context(running_daemon(a_ckpt))
        b = stack.enter_context(running_daemon(b_ckpt, extra=receiver_args(b_ckpt)))
        accept_job(a_ckpt, a, job)
        accept_job(b_ckpt, b, job, **RECEIVER)
        publish_step(a_ckpt, STEP)
        data = wait_ingested(a_ckpt, job, STEP, a)
        manifest = Manifest.from_json((item_dir(a_ckpt, job, STEP) / MANIFEST_FILE).read_bytes())
        yield Pair(job, a_ckpt, b_ckpt, a, b, manifest, data)


@pytest.fixture(scope="module")
def pushed(pair: Pair) -> Pair:
    """A's item pushed to B once (tests that only need B to hold it share this push)."""
    assert with_client(lambda c: c.push_item(pair.b.address, pair.manifest, pair.data)) is False
    return pair


def test_push_copies_the_item_to_the_peer_byte_for_byte(pushed: Pair) -> None:
    p = pushed
    copy = item_dir(p.b_ckpt, p.job, STEP)
    # Committed with the same canonical manifest, so the digest is the same everywhere.
    assert (copy / MANIFEST_FILE).read_bytes() == p.manifest.to_json()
    assert read_tree(copy / "data") == read_tree(p.data)
    assert tree_shape(copy / "data") == tree_shape(p.data)  # empty dir and file included
    assert list((store_root(p.b_ckpt) / "staging").iterdir()) == []
    assert re.search(f"received {p.item} from \\S+ over the data channel", p.b.log())


def test_a_second_push_is_answered_at_once(pushed: Pair) -> None:
    p = pushed
    manifest_mtime = (item_dir(p.b_ckpt, p.job, STEP) / MANIFEST_FILE).stat().st_mtime_ns
    assert with_client(lambda c: c.push_item(p.b.address, p.manifest, p.data)) is True
    assert f"push of {p.item} from" in p.b.log()
    assert "already held" in p.b.log()
    # Nothing was rewritten.
    assert (item_dir(p.b_ckpt, p.job, STEP) / MANIFEST_FILE).stat().st_mtime_ns == manifest_mtime


def test_pull_restores_the_item_into_another_store(pushed: Pair, tmp_path: Path) -> None:
    p = pushed
    store = LocalStore(tmp_path / "c")
    store.open()
    try:
        got = with_client(lambda c: c.pull_item(p.b.address, p.item, store, p.manifest.digest))
        assert got == p.manifest
        assert store.get(p.item) == p.manifest
        assert read_tree(store.data_path(p.item)) == read_tree(p.data)
        assert tree_shape(store.data_path(p.item)) == tree_shape(p.data)
        store.verify(p.item)
        assert list(store.staging_root.iterdir()) == []
    finally:
        store.close()
    assert re.search(f"sent {p.item} to \\S+ over the data channel", p.b.log())


def test_without_a_data_channel_on_either_side_bytes_go_in_chunks(
    pair: Pair, tmp_path: Path
) -> None:
    """A daemon with ``--data-port off`` offers none to a client that asks; a client that
    does not ask gets none from a daemon that has one. Either way the item arrives whole."""
    store = LocalStore(tmp_path / "d")
    store.open()
    try:
        with (
            ram_disk(tmp_path / "c", "64m") as c_ckpt,
            running_daemon(c_ckpt, extra=("--data-port", "off", *receiver_args(c_ckpt))) as c,
        ):
            assert "data-port=off" in c.log()
            accept_job(c_ckpt, c, pair.job, **RECEIVER)
            assert (
                with_client(lambda cl: cl.push_item(c.address, pair.manifest, pair.data)) is False
            )
            assert re.search(f"received {pair.item} from \\S+ in gRPC chunks", c.log())
            copy = item_dir(c_ckpt, pair.job, STEP) / "data"
            assert read_tree(copy) == read_tree(pair.data)

        async def pull_in_chunks() -> Manifest:
            async with PeerClient(timeout=10.0, data_channel=False) as client:
                return await client.pull_item(pair.a.address, pair.item, store)

        assert asyncio.run(pull_in_chunks()) == pair.manifest
        assert read_tree(store.data_path(pair.item)) == read_tree(pair.data)
        assert re.search(f"sent {pair.item} to \\S+ in gRPC chunks", pair.a.log())
    finally:
        store.close()


def test_pull_refuses_another_digest_and_a_missing_item(pushed: Pair, tmp_path: Path) -> None:
    p = pushed
    store = LocalStore(tmp_path / "c")
    store.open()
    try:
        with pytest.raises(PeerError, match="FAILED_PRECONDITION") as wrong:
            with_client(lambda c: c.pull_item(p.b.address, p.item, store, "0" * 64))
        assert not wrong.value.retryable
        missing = ItemId(p.job, STEP + 1, 0, 0)
        with pytest.raises(ItemNotFound):
            with_client(lambda c: c.pull_item(p.b.address, missing, store))
        assert store.manifests() == {}
        assert list(store.staging_root.iterdir()) == []
    finally:
        store.close()


def test_an_unreachable_data_channel_falls_back_to_chunks(
    pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As behind a firewall that lets gRPC through but not the data port: the transfer is
    cancelled and redone in chunks, and the peer gets chunks without a try for a while."""
    tries: list[int] = []

    def firewalled(
        address: str, port: int, token: bytes, timeout: float, tls: object = None
    ) -> socket.socket:
        tries.append(port)
        raise datachannel.ChannelUnreachable(f"cannot open the data connection to port {port}")

    monkeypatch.setattr(datachannel, "connect", firewalled)
    store = LocalStore(tmp_path / "e")
    store.open()
    try:
        with (
            ram_disk(tmp_path / "c", "64m") as c_ckpt,
            running_daemon(c_ckpt, extra=receiver_args(c_ckpt)) as c,
        ):
            accept_job(c_ckpt, c, pair.job, **RECEIVER)

            async def scenario() -> tuple[bool, Manifest, Manifest]:
                async with PeerClient(timeout=10.0) as client:
                    pushed = await client.push_item(c.address, pair.manifest, pair.data)
                    pulled = await client.pull_item(c.address, pair.item, store)
                    store.delete(pair.item)
                    again = await client.pull_item(c.address, pair.item, store)
                    return pushed, pulled, again

            pushed, pulled, again = asyncio.run(scenario())
            assert pushed is False
            assert pulled == again == pair.manifest
            assert len(tries) == 1  # the pulls did not try the port again
            assert re.search(f"received {pair.item} from \\S+ in gRPC chunks", c.log())
            assert len(re.findall(f"sent {pair.item} to \\S+ in gRPC chunks", c.log())) == 2
            wait_until(
                lambda: f"push of {pair.item} from" in c.log() and "cancelled" in c.log(),
                "the abandoned data-channel push cancelled on the daemon",
                daemon=c,
            )
            assert list((store_root(c_ckpt) / "staging").iterdir()) == []
        assert read_tree(store.data_path(pair.item)) == read_tree(pair.data)
    finally:
        store.close()


def test_list_items_reports_what_each_node_holds(pushed: Pair) -> None:
    p = pushed
    expected = ItemInfo(p.item, p.manifest.digest, p.manifest.total_bytes)
    assert with_client(lambda c: c.list_items(p.a.address, p.job)) == [expected]
    assert expected in with_client(lambda c: c.list_items(p.b.address))
    assert with_client(lambda c: c.list_items(p.b.address, "some-other-job")) == []


def test_health_service_reports_serving(pair: Pair) -> None:
    with grpc.insecure_channel(pair.b.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mtc.v1.Peer"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_items_of_another_job_are_refused(pair: Pair) -> None:
    p = pair
    other = Manifest(
        ItemId("another-job", STEP, 0, 0), p.manifest.kind, p.manifest.files, p.manifest.dirs
    )
    with pytest.raises(PeerError, match="another-job") as refused:
        with_client(lambda c: c.push_item(p.b.address, other, p.data))
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert not (store_root(p.b_ckpt) / "items" / "another-job").exists()


def test_an_unreachable_peer_is_a_retryable_error(pair: Pair) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
    with pytest.raises(PeerUnavailable) as unavailable:
        with_client(lambda c: c.push_item(closed, pair.manifest, pair.data))
    assert unavailable.value.retryable


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_daemon_memory_stays_flat_in_the_item_size(tmp_path: Path) -> None:
    job = f"mem-{uuid.uuid4().hex[:6]}"
    size_mib = 256
    with contextlib.ExitStack() as stack:
        src_ckpt = stack.enter_context(ram_disk(tmp_path / "src", "320m"))
        ckpt = stack.enter_context(ram_disk(tmp_path / "ckpt", "384m"))
        back = stack.enter_context(ram_disk(tmp_path / "back", "384m"))
        daemon = stack.enter_context(running_daemon(ckpt, extra=receiver_args(ckpt)))
        accept_job(ckpt, daemon, job, **RECEIVER)
        src, digests = write_big_step_tmp(src_ckpt, 1, files=4, mib_each=size_mib // 4)
        manifest = build_manifest(ItemId(job, 1, 0, 0), src)
        assert manifest.total_bytes >= size_mib << 20
        assert daemon.proc is not None
        pid = daemon.proc.pid
        baseline = vm_hwm_mib(pid)

        assert with_client(lambda c: c.push_item(daemon.address, manifest, src)) is False
        after_push = vm_hwm_mib(pid)
        assert sha256_tree(item_dir(ckpt, job, 1) / "data") == digests

        store = LocalStore(back)
        store.open()
        with_client(lambda c: c.pull_item(daemon.address, manifest.item, store, manifest.digest))
        store.close()
        after_pull = vm_hwm_mib(pid)
        assert sha256_tree(store_root(back) / "items" / job / "1" / "0-0" / "data") == digests
    print(
        f"daemon VmHWM: {baseline:.0f} MiB at start, {after_push:.0f} after the push, "
        f"{after_pull:.0f} after the pull"
    )
    # A few chunks and gRPC's buffers, not the item: flat in the item size.
    assert after_push - baseline < 150, (baseline, after_push)
    assert after_pull - baseline < 150, (baseline, after_pull)


def test_sigterm_ends_a_stalled_push_within_the_grace_period(tmp_path: Path) -> None:
    """A peer that stops sending mid-item must not keep the daemon from stopping: the server
    gives calls a bounded grace, then cancels them, and the cancelled push cleans up."""
    job = f"stop-{uuid.uuid4().hex[:6]}"
    payload = os.urandom(1 << 20)
    manifest = Manifest(
        ItemId(job, 1, 0, 0),
        ItemKind.FILE,
        (
            FileEntry(
                "",
                2 * len(payload),
                google_crc32c.value(payload + payload),
                blake3.blake3(payload + payload).hexdigest(),
            ),
        ),
    )
    raw = manifest.to_json()
    gate = threading.Event()

    def requests() -> Iterator[pb.PushItemRequest]:
        yield pb.PushItemRequest(
            header=pb.PushHeader(
                item=pb.ItemRef(job=job, step=1, rank=0, worker=0),
                manifest=raw,
                manifest_digest=hashlib.sha256(raw).hexdigest(),
            )
        )
        yield pb.PushItemRequest(
            chunk=pb.Chunk(
                file_index=0, offset=0, data=payload, crc32c=google_crc32c.value(payload)
            )
        )
        gate.wait(30)  # the peer stalls with half the item sent

    with (
        ram_disk(tmp_path / "ckpt", "64m") as ckpt,
        running_daemon(ckpt, extra=receiver_args(ckpt)) as daemon,
    ):
        accept_job(ckpt, daemon, job, **RECEIVER)
        channel = grpc.insecure_channel(daemon.address)
        call = peer_pb2_grpc.PeerStub(channel).PushItem.future(requests(), timeout=60)
        staging = store_root(ckpt) / "staging"
        wait_until(lambda: list(staging.glob("*/data")), "the push staged", daemon=daemon)
        t0 = time.monotonic()
        assert daemon.stop(timeout=20) == 0
        stopped_in = time.monotonic() - t0
        gate.set()
        with pytest.raises(grpc.RpcError) as cut:
            call.result()
        channel.close()
        assert cut.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert stopped_in < SERVER_GRACE_SECONDS + 5
        assert list(staging.iterdir()) == []
        assert not (store_root(ckpt) / "items" / job).exists()
        assert "cancelled" in daemon.log()


def test_a_port_in_use_stops_the_daemon_with_a_clear_error(pair: Pair, tmp_path: Path) -> None:
    """SO_REUSEPORT is off: a second daemon on a taken port must not silently share it."""
    ckpt = tmp_path / "other"
    ckpt.mkdir()
    second = DaemonProcess(ckpt, extra_args=("--listen", pair.a.address))
    try:
        with pytest.raises(RuntimeError, match="exited with 3"):
            second.start(timeout=20)
    finally:
        if second.running:  # it bound the port after all: do not leave it behind
            second.kill()
    assert f"cannot listen on {pair.a.address}" in second.log()


def test_a_corrupt_local_copy_is_refused_with_corrupt_item(pair: Pair, tmp_path: Path) -> None:
    """A sender whose bytes no longer match its manifest learns it (``CorruptItem``, from the
    peer's DATA_LOSS mid-stream), and the peer commits nothing."""
    p = pair
    copy = tmp_path / "copy"
    shutil.copytree(p.data, copy)
    # One bit in the first file: the peer finds out when the next file starts, with
    # megabytes of the item still on their way.
    first = copy / "_CHECKPOINT_METADATA"
    raw = bytearray(first.read_bytes())
    raw[0] ^= 0x01
    first.write_bytes(bytes(raw))
    corrupt = Manifest(
        ItemId(p.job, STEP + 40, 0, 0), p.manifest.kind, p.manifest.files, p.manifest.dirs
    )
    with pytest.raises(CorruptItem, match="_CHECKPOINT_METADATA"):
        with_client(lambda c: c.push_item(p.b.address, corrupt, copy))
    assert not item_dir(p.b_ckpt, p.job, STEP + 40).exists()
    wait_until(
        lambda: list((store_root(p.b_ckpt) / "staging").iterdir()) == [],
        "staging emptied",
        daemon=p.b,
    )
