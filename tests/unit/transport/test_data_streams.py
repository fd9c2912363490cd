"""One item over several data connections at once (``datachannel.send_staged`` and
``receive_staged`` with ``core.stripes``): real socket pairs, real files, a real store.

Between daemon processes, over the listener and mutual TLS:
``tests/integration/test_data_streams.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core import stripes
from mtc_replicator.core.manifest import (
    Cancelled,
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
)
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.datachannel import receive_staged, send_item, send_staged
from mtc_replicator.transport.datapool import Abort, TransferPool
from mtc_replicator.transport.streams import ChannelBroken

ITEM = ItemId("job", 5, 0, 0)


@pytest.fixture
def item(tmp_path: Path) -> tuple[Manifest, Path]:
    """Seven files of several sizes (one empty) in nested directories, and an empty one."""
    data = tmp_path / "src"
    (data / "a" / "b").mkdir(parents=True)
    (data / "empty_dir").mkdir()
    for n, size in enumerate([3 << 20, 1 << 20, 777, 0, 2 << 20, 5, 1 << 19]):
        where = data / ("a/b" if n % 2 else "a")
        (where / f"shard{n}.bin").write_bytes(os.urandom(size))
    return build_manifest(ITEM, data), data


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    s = LocalStore(tmp_path / "ckpt", tmp_path / "store")
    s.open()
    return s


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made = [socket.socketpair() for _ in range(3)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def staging_left(store: LocalStore) -> list[str]:
    return os.listdir(store.staging_root) if store.staging_root.exists() else []


def test_an_item_crosses_three_connections_at_once_verified(
    item: tuple[Manifest, Path], store: LocalStore, pairs: list[tuple[socket.socket, ...]]
) -> None:
    manifest, data = item
    pool = TransferPool()

    async def main() -> tuple[int, int]:
        return await asyncio.gather(
            send_staged(manifest, data, [a for a, _ in pairs], idle_timeout=5, pool=pool),
            receive_staged(store, manifest, [b for _, b in pairs], idle_timeout=5, pool=pool),
        )

    try:
        sent, received = asyncio.run(main())
    finally:
        pool.shutdown()
    assert sent == received == manifest.total_bytes
    assert store.get(ITEM) == manifest
    verify_item(manifest, store.data_path(ITEM))
    assert (store.data_path(ITEM) / "empty_dir").is_dir()


def test_files_sent_on_the_wrong_connections_are_refused_and_nothing_is_kept(
    item: tuple[Manifest, Path], store: LocalStore, pairs: list[tuple[socket.socket, ...]]
) -> None:
    """A sender that splits the files otherwise than the manifest says (here: the parts
    of connections 1 and 2 swapped) gets each connection's bytes checked against the
    files the receiver expects there: refused, nothing committed or left staged."""
    manifest, data = item
    pool = TransferPool()
    split = stripes.parts(manifest, 3)
    assert split[1].total_bytes != split[2].total_bytes  # the swap must show

    async def main() -> None:
        loop = asyncio.get_running_loop()
        senders = [
            loop.run_in_executor(
                None, functools.partial(send_item, pairs[n][0], part, data, idle_timeout=5)
            )
            for n, part in zip((0, 2, 1), split, strict=True)
        ]
        try:
            await receive_staged(store, manifest, [b for _, b in pairs], idle_timeout=5, pool=pool)
        finally:
            for a, _ in pairs:
                a.close()
            await asyncio.gather(*senders, return_exceptions=True)

    try:
        with pytest.raises((CorruptItem, ChannelBroken)) as caught:
            asyncio.run(main())
    finally:
        pool.shutdown()
    assert isinstance(caught.value, CorruptItem) or "closed after" in str(caught.value)
    assert store.get(ITEM) is None
    assert staging_left(store) == []


def test_one_connection_cut_fails_the_whole_and_stops_the_others(
    item: tuple[Manifest, Path], store: LocalStore, pairs: list[tuple[socket.socket, ...]]
) -> None:
    """Connection 0 ends early while 1 and 2 stall: the receive fails at once with the
    cut (not after the others' idle timeout), every thread let go, nothing kept."""
    manifest, _ = item
    pool = TransferPool()
    pairs[0][0].shutdown(socket.SHUT_WR)  # nothing sent: the first file is short

    async def main() -> None:
        await receive_staged(store, manifest, [b for _, b in pairs], idle_timeout=30, pool=pool)

    loop_time = asyncio.new_event_loop()
    try:
        start = loop_time.time()
        with pytest.raises(ChannelBroken, match="closed after 0 of"):
            loop_time.run_until_complete(main())
        assert loop_time.time() - start < 10
    finally:
        loop_time.close()
        pool.shutdown()
    assert store.get(ITEM) is None
    assert staging_left(store) == []


def test_a_cancellation_that_came_first_is_not_replaced_by_the_aborts_echo() -> None:
    # One connection's sender stops with ``Cancelled`` (its pacer halted: the daemon
    # stops) while another is blocked sending: the abort breaks the other, and what is
    # reported is the cancellation. A ``ChannelBroken`` would send a push client to try
    # again in gRPC chunks (``peer_client._fallback``) instead of stopping.
    a, b = socket.socketpair()
    pool = TransferPool()
    started = threading.Event()

    def halted() -> int:
        started.wait(5)
        raise Cancelled("replication transfer")  # what Meter.take raises once halted

    def sending() -> int:
        started.set()
        try:
            a.recv(1)  # blocked, as in sendfile, until the abort shuts the socket down
        except OSError as exc:
            raise ChannelBroken(f"data connection failed: {exc}") from None
        raise ChannelBroken("data connection failed: [Errno 32] Broken pipe")

    async def main() -> None:
        await pool.run_all([halted, sending], Abort([a]))

    try:
        with pytest.raises(Cancelled):
            asyncio.run(main())
    finally:
        pool.shutdown()
        a.close()
        b.close()


def test_the_split_of_a_large_item_runs_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The split is O(files x connections): 0.6 s for 100,000 files on 8 here. The sending
    # side (a push, a pull served) does it on a pool thread, as the receiving side does,
    # so the daemon's other RPCs are answered meanwhile.
    manifest = Manifest(
        ITEM,
        ItemKind.DIR,
        tuple(FileEntry(f"f{i:06d}", 1 + i % 7, 0, "0" * 64) for i in range(100_000)),
    )
    split_on: list[threading.Thread] = []
    real_parts = stripes.parts

    def parts(m: Manifest, count: int) -> list[Manifest]:
        split_on.append(threading.current_thread())
        return real_parts(m, count)

    monkeypatch.setattr(datachannel.stripes, "parts", parts)
    pairs = [socket.socketpair() for _ in range(8)]
    pool = TransferPool()
    gaps: list[float] = []

    async def main() -> threading.Thread:
        loop = asyncio.get_running_loop()
        done = False

        async def beat() -> None:
            last = loop.time()
            while not done:
                await asyncio.sleep(0.01)
                gaps.append(loop.time() - last)
                last = loop.time()

        beating = asyncio.create_task(beat())
        await asyncio.sleep(0.05)
        # No files there: each connection's thread fails at once; the split comes first.
        with contextlib.suppress(FileNotFoundError):
            await send_staged(
                manifest, tmp_path / "absent", [a for a, _ in pairs], idle_timeout=5, pool=pool
            )
        done = True
        await beating
        return threading.current_thread()

    try:
        loop_thread = asyncio.run(main())
    finally:
        pool.shutdown()
        for a, b in pairs:
            a.close()
            b.close()
    assert split_on
    assert all(t is not loop_thread for t in split_on), "split on the event loop"
    assert max(gaps) < 0.3, f"the event loop stood still for {max(gaps):.2f}s"
