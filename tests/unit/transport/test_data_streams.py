"""One item over several data connections at once (``datachannel.send_staged`` and
``receive_staged`` with ``core.stripes``): real socket pairs, real files, a real store.

Between daemon processes, over the listener and mutual TLS:
``tests/integration/test_data_streams.py``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core import stripes
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport.datachannel import receive_staged, send_item, send_staged
from mtc_replicator.transport.datapool import TransferPool
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
