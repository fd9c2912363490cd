"""The peer plane obeys the node's pacer, between real daemons on loopback.

The test process pushes with ``PeerClient`` (the code daemons use) and a ``Pacer`` of its
own, the way a daemon with ``--max-transfer-rate`` does, to real daemon processes: a 192 MiB
item over the plaintext data channel, over the TLS data channel and in gRPC chunks takes
what the limit allows, within 10%. A daemon with a small limit serves pulls (restores) at
full speed. In-process, a node serving a pull holds its own push to the trickle until the
pull ends, and a push held by a save stops at once when cancelled.

Rates are far below what each path does unthrottled here (about 1 GB/s; a loaded CI box
pushed 512 MiB in gRPC chunks at 80 MiB/s, so the limit is 36 MiB/s), so two noisy cores
cannot push a transfer past its bound; each paced transfer takes about 5 seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import grpc.aio
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.pacing import HELD_RATE, HELD_SLICE, MAX_SLICE, PaceRules, Traffic
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import MANIFEST_FILE, LocalStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.peer_servicer import PeerServicer
from mtc_replicator.transport.peerwire import SERVER_OPTIONS, item_ref
from mtc_replicator.transport.receiving import Receiving
from mtc_replicator.transport.tls import TlsMaterial
from tests.daemon_process import DaemonProcess
from tests.integration.grants import grant_receiver
from tests.integration.helpers import (
    RECEIVER,
    item_dir,
    ram_disk,
    receiver_args,
    running_daemon,
    store_root,
    wait_until,
    write_big_step_tmp,
)
from tests.integration.test_peer import accept_job
from tests.tls import TEST_NODE, NodeTls, node_tls

pytestmark = pytest.mark.integration

MiB = 1 << 20
SIZE = 192 * MiB
RATE = 36 * MiB
"""The limit of the timed pushes: 192 MiB in about 4.3 s (the first second's worth is the
bucket's burst)."""
SMALL = 64 * MiB
SERVER_LIMIT = 1 * MiB  # --max-transfer-rate 1MiB
"""The plaintext daemon's own limit: a pull of ``SMALL`` bytes at that rate takes a minute."""


@dataclass(frozen=True)
class Nodes:
    job: str
    manifest: Manifest
    """The 192 MiB item the test process sends (step 1), at ``data``."""
    data: Path
    small: Manifest
    """A 64 MiB item (step 2), at ``small_data``."""
    small_data: Path
    plain_ckpt: Path
    plain: DaemonProcess
    """Plaintext, with a data port and ``--max-transfer-rate SERVER_LIMIT``."""
    tls_ckpt: Path
    secure: DaemonProcess
    """Mutual TLS on both ports."""
    me: NodeTls
    """The test process's node certificate, from the daemons' CA."""
    root: Path

    def as_step(self, step: int, manifest: Manifest | None = None) -> Manifest:
        """The same bytes as another item, so each test sends something not held yet."""
        return replace(manifest or self.manifest, item=ItemId(self.job, step, 0, 0))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    root = tmp_path_factory.mktemp("pacing")
    job = f"pace-{uuid.uuid4().hex[:6]}"
    ca = certs.new_ca()
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(ram_disk(root / "src", "700m"))
        data, _ = write_big_step_tmp(src, 1, files=4, mib_each=SIZE // MiB // 4)
        manifest = build_manifest(ItemId(job, 1, 0, 0), data)
        small_data, _ = write_big_step_tmp(src, 2, files=1, mib_each=SMALL // MiB)
        small = build_manifest(ItemId(job, 2, 0, 0), small_data)
        plain_ckpt = stack.enter_context(ram_disk(root / "plain", "1700m"))
        plain = stack.enter_context(
            running_daemon(
                plain_ckpt,
                extra=(*receiver_args(plain_ckpt), "--max-transfer-rate", "1MiB"),
            )
        )
        tls_ckpt = stack.enter_context(ram_disk(root / "tls", "700m"))
        tls = node_tls(root / "tls-daemon", ca, node="node-b")
        secure = stack.enter_context(
            running_daemon(tls_ckpt, extra=(*tls.args(), *receiver_args(tls_ckpt)))
        )
        accept_job(plain_ckpt, plain, job, **RECEIVER)
        grant_receiver(secure, ca, root, job, holders=(TEST_NODE, "node-b"))  # pushes from me
        accept_job(tls_ckpt, secure, job, **RECEIVER)
        me = node_tls(root / "tls-me", ca)
        yield Nodes(
            job, manifest, data, small, small_data, plain_ckpt, plain, tls_ckpt, secure, me, root
        )


def timed_push(
    address: str,
    manifest: Manifest,
    data: Path,
    pacer: Pacer,
    *,
    tls: TlsMaterial | None = None,
    data_channel: bool = True,
) -> float:
    """Seconds ``PeerClient`` with ``pacer`` takes to push the item (not held there yet)."""

    async def main() -> float:
        async with PeerClient(
            timeout=10.0, pacer=pacer, tls=tls, data_channel=data_channel
        ) as client:
            t0 = time.monotonic()
            assert await client.push_item(address, manifest, data) is False
            return time.monotonic() - t0

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "step", "via"),
    [
        ("plaintext data channel", 11, "over the data channel"),
        ("TLS data channel", 12, "over the data channel"),
        ("gRPC chunks", 13, "in gRPC chunks"),
    ],
)
def test_a_push_takes_what_the_rate_limit_allows(
    nodes: Nodes, path: str, step: int, via: str
) -> None:
    manifest = nodes.as_step(step)
    pacer = Pacer(PaceRules(rate=RATE))
    if path == "TLS data channel":
        daemon, ckpt = nodes.secure, nodes.tls_ckpt
        manifest = nodes.me.attest(manifest)  # the TLS daemon takes attested pushes only
        elapsed = timed_push(daemon.address, manifest, nodes.data, pacer, tls=nodes.me.material())
    else:
        daemon, ckpt = nodes.plain, nodes.plain_ckpt
        chunks = path == "gRPC chunks"
        elapsed = timed_push(daemon.address, manifest, nodes.data, pacer, data_channel=not chunks)
    burst = RATE * pacer.rules.burst_seconds
    low, high = 0.9 * (SIZE - burst) / RATE, 1.1 * SIZE / RATE
    print(f"{path}: {SIZE / MiB:.0f} MiB in {elapsed:.2f}s at {RATE / MiB:.0f} MiB/s")
    assert low <= elapsed <= high, (path, elapsed, low, high)
    # Every byte was booked as replication, and the copy arrived whole.
    total = manifest.total_bytes
    assert total <= pacer.sent[Traffic.REPLICATION] < total + MAX_SLICE
    copy = item_dir(ckpt, nodes.job, step)
    assert (copy / MANIFEST_FILE).read_bytes() == manifest.to_json()
    assert f"received {manifest.item} from" in daemon.log()
    assert any(via in line for line in daemon.log().splitlines() if str(manifest.item) in line)


def test_a_restore_served_under_a_small_limit_is_not_throttled(nodes: Nodes) -> None:
    """The plaintext daemon's limit would take a minute for this item; its pulls (a
    restoring peer's) go at full speed, over the data channel and in chunks alike."""
    manifest = nodes.as_step(20, nodes.small)
    timed_push(nodes.plain.address, manifest, nodes.small_data, Pacer())  # incoming: not paced
    allowed = manifest.total_bytes / SERVER_LIMIT
    with ram_disk(nodes.root / "restore", "100m") as ckpt:
        store = LocalStore(ckpt)
        store.open()
        try:
            for data_channel in (True, False):

                async def pull(data_channel: bool = data_channel) -> float:
                    async with PeerClient(timeout=10.0, data_channel=data_channel) as client:
                        t0 = time.monotonic()
                        await client.pull_item(
                            nodes.plain.address, manifest.item, store, manifest.digest
                        )
                        return time.monotonic() - t0

                elapsed = asyncio.run(pull())
                print(f"pull (data channel {data_channel}): {elapsed:.2f}s")
                assert store.get(manifest.item) == manifest
                store.delete(manifest.item)
                # Far faster than the limit allows: the limit would need `allowed` seconds.
                assert elapsed < allowed / 8, (data_channel, elapsed, allowed)
        finally:
            store.close()
    log = nodes.plain.log()
    assert f"sent {manifest.item} to" in log
    assert "in gRPC chunks" in log


# --- in-process: one node's pacer shared by the pull it serves and its own push -----------


async def until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition`` (the pacer's counters have nothing to wait on)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g}s")
        await asyncio.sleep(0.01)


def staged_bytes(ckpt: Path) -> int:
    """Bytes of pushes still arriving at the daemon on ``ckpt`` (its staging directory)."""
    total = 0
    for dirpath, _dirs, files in os.walk(store_root(ckpt) / "staging"):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += (Path(dirpath) / name).stat().st_size
    return total


@contextlib.asynccontextmanager
async def serving_node(store: LocalStore, pacer: Pacer) -> AsyncIterator[str]:
    """``PeerServicer`` over ``store`` with ``pacer`` on a real loopback gRPC port."""
    with ThreadPoolExecutor(max_workers=2) as executor:
        servicer = PeerServicer(Receiving(store, executor), lambda job: None, pacer=pacer)
        server = grpc.aio.server(options=SERVER_OPTIONS)
        servicer.register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await server.stop(0)


def node_store(ckpt: Path, job: str, mib: int) -> tuple[LocalStore, Manifest]:
    """An opened store holding one committed item of ``mib`` MiB (step 1)."""
    store = LocalStore(ckpt)
    store.open()
    src, _ = write_big_step_tmp(ckpt, 1, files=1, mib_each=mib)
    item = ItemId(job, 1, 0, 0)
    store.take(src, item)
    return store, store.commit_ingested(item)


def test_a_push_trickles_while_the_node_serves_a_pull(nodes: Nodes) -> None:
    """A node's push waits for the restore it serves: while the pull runs, the push's bytes
    reach the peer at no more than the held trickle, and the push completes after it."""
    pacer = Pacer()  # no limit: the push is slow only because the pull holds it
    with ram_disk(nodes.root / "node", "200m") as ckpt:
        store, held = node_store(ckpt, nodes.job, 32)
        pushed = replace(held, item=ItemId(nodes.job, 30, 0, 0))

        async def scenario() -> tuple[float, int, int, bool, float]:
            async with (
                serving_node(store, pacer) as address,
                PeerClient(timeout=10.0, pacer=pacer) as client,
                grpc.aio.insecure_channel(address) as channel,
            ):
                stub = peer_pb2_grpc.PeerStub(channel)

                async def slow_pull() -> int:
                    """A restoring peer that reads its chunks slowly: the pull lasts seconds."""
                    got = 0
                    async for message in stub.PullItem(
                        pb.PullItemRequest(item=item_ref(held.item))
                    ):
                        got += len(message.chunk.data)
                        await asyncio.sleep(0.1)
                    return got

                pull = asyncio.create_task(slow_pull())
                await until(lambda: pacer.active(Traffic.RESTORE) > 0, "the pull served")
                t0 = time.monotonic()
                push = asyncio.create_task(
                    client.push_item(
                        nodes.plain.address, pushed, store.data_path(held.item), store.root
                    )
                )
                staged = 0
                while pacer.active(Traffic.RESTORE):
                    staged = staged_bytes(nodes.plain_ckpt)
                    await asyncio.sleep(0.02)
                held_for = time.monotonic() - t0
                done_during_pull = push.done()
                assert await push is False
                pushed_in = time.monotonic() - t0
                assert await pull == held.total_bytes
                return (
                    held_for,
                    staged,
                    pacer.sent[Traffic.REPLICATION],
                    done_during_pull,
                    pushed_in,
                )

        try:
            held_for, staged, booked, done_during_pull, pushed_in = asyncio.run(scenario())
        finally:
            store.close()
    print(f"pull held the push for {held_for:.2f}s: {staged} bytes arrived meanwhile")
    assert held_for > 1.0  # the pull really overlapped the push
    assert not done_during_pull
    # The trickle, plus the slice booked at once and one in flight.
    assert staged <= HELD_RATE * held_for + 2 * HELD_SLICE, (staged, held_for)
    assert booked >= pushed.total_bytes  # then it went on where it was, to the end
    assert pushed_in > held_for
    assert (item_dir(nodes.plain_ckpt, nodes.job, 30) / MANIFEST_FILE).read_bytes() == (
        pushed.to_json()
    )


def test_a_push_held_by_a_save_stops_at_once_when_cancelled(nodes: Nodes) -> None:
    """A push waiting in a data-channel thread for a save to end (up to 15 s) is cancelled
    within a second: its thread leaves the pacer's wait, the peer keeps nothing."""
    pacer = Pacer(PaceRules(yield_to_saves=15.0))
    pacer.saving(True)
    manifest = nodes.as_step(40, nodes.small)

    async def scenario() -> float:
        async with PeerClient(timeout=10.0, pacer=pacer) as client:
            push = asyncio.create_task(
                client.push_item(nodes.plain.address, manifest, nodes.small_data)
            )
            await until(lambda: pacer.waited[Traffic.REPLICATION] > 0, "the push held")
            await asyncio.sleep(0.3)
            assert not push.done()
            t0 = time.monotonic()
            push.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await push
            return time.monotonic() - t0

    stopped_in = asyncio.run(scenario())
    assert stopped_in < 1.0, stopped_in
    staging = store_root(nodes.plain_ckpt) / "staging"
    wait_until(
        lambda: str(manifest.item) in nodes.plain.log() and list(staging.iterdir()) == [],
        "the cancelled push cleaned up on the daemon",
        daemon=nodes.plain,
    )
    assert not item_dir(nodes.plain_ckpt, nodes.job, 40).exists()
