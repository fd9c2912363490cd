"""One rule for room, whichever side started the transfer (``transport.receiving``).

A node takes an incoming item only when its bytes fit beside what every transfer in flight
into its store will still write, pushes and pulls alike. Real gRPC servers on loopback, the
receiving node's store on a RAM disk of its own (nothing else writes there, so its free
space holds still while the test measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import grpc
import grpc.aio
import pytest

from mtc_replicator.core.admission import Served, inode_room
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport.peer_client import PeerClient, PeerError, PeerUnavailable
from mtc_replicator.transport.peer_servicer import DEFAULT_RULES, PeerServicer, ServiceRules
from mtc_replicator.transport.peerwire import SERVER_OPTIONS
from mtc_replicator.transport.receiving import Receiving, TooLarge
from tests.integration.helpers import ram_disk, write_big_step_tmp

JOB = "room-rule"
ITEM = ItemId(JOB, 1, 0, 0)
"""Rank 0's item: rank 0 pushes to rank 1 in a job of two nodes."""
RANK1 = Served(
    JobConfig(JOB, Framework.ORBAX, node_rank=1, nodes=2, peers_per_node=1), newest_step=None
)


@dataclass
class Node:
    store: LocalStore
    receiving: Receiving
    address: str


@contextlib.asynccontextmanager
async def serving(
    store: LocalStore, executor: ThreadPoolExecutor, rules: ServiceRules = DEFAULT_RULES
) -> AsyncIterator[Node]:
    """A node over ``store``: its ``Receiving`` and ``PeerServicer`` on a loopback port; it
    serves rank 1 of ``JOB``."""
    receiving = Receiving(store, executor, reserve_bytes=1 << 20)
    servicer = PeerServicer(receiving, lambda job: RANK1 if job == JOB else None, rules=rules)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Node(store, receiving, f"127.0.0.1:{port}")
    finally:
        await server.stop(0)


def opened(ckpt: Path) -> LocalStore:
    store = LocalStore(ckpt)
    store.open()
    return store


def holding(ckpt: Path, mib: int) -> tuple[LocalStore, Manifest]:
    """A store holding ``ITEM``, ``mib`` MiB."""
    store = opened(ckpt)
    src, _ = write_big_step_tmp(ckpt, ITEM.step, files=1, mib_each=mib)
    store.take(src, ITEM)
    return store, store.commit_ingested(ITEM)


@contextlib.asynccontextmanager
async def in_flight(receiving: Receiving, leave: int) -> AsyncIterator[None]:
    """A transfer in flight into ``receiving``'s store that leaves ``leave`` bytes of room."""
    other = SimpleNamespace(
        item=ItemId("other-job", 9, 0, 0), total_bytes=receiving.room() - leave, entries=1
    )
    async with receiving.reserved(other):  # type: ignore[arg-type]
        assert 0 < receiving.room() <= leave
        yield


@pytest.mark.parametrize("data_channel", [False, True], ids=["chunks", "data-channel"])
def test_a_pull_is_refused_where_a_push_would_be(tmp_path: Path, data_channel: bool) -> None:
    """While a transfer in flight into node B will take all but half of ``ITEM``'s size, a
    push of ``ITEM`` to B is refused for room (RESOURCE_EXHAUSTED) and so is B's own pull of
    it (``TooLarge``), before a byte is staged; once that transfer ended, both fit. A pull
    that counted only the filesystem's free space would have taken it."""

    async def scenario(a_ckpt: Path, b_ckpt: Path) -> None:
        a_store, manifest = holding(a_ckpt, 8)
        with ThreadPoolExecutor(max_workers=2) as executor:
            async with (
                serving(opened(b_ckpt), executor) as b,
                PeerClient(timeout=10.0, data_channel=data_channel) as a_client,
                PeerClient(
                    timeout=10.0, data_channel=data_channel, receiving=b.receiving
                ) as b_client,
                serving(a_store, executor) as a,
            ):
                data = a_store.data_path(ITEM)
                async with in_flight(b.receiving, manifest.total_bytes // 2):
                    with pytest.raises(PeerUnavailable) as pushed:
                        await a_client.push_item(b.address, manifest, data, a_store.root)
                    assert pushed.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                    with pytest.raises(TooLarge, match="do not fit"):
                        await b_client.pull_item(a.address, ITEM, b.store)
                    assert b.store.get(ITEM) is None
                    assert not any(b.store.staging_root.iterdir())
                got = await b_client.pull_item(a.address, ITEM, b.store)
                assert got.digest == manifest.digest
                b.store.delete(ITEM)
                assert not await a_client.push_item(b.address, manifest, data, a_store.root)
                held = b.store.get(ITEM)
                assert held is not None
                assert held.digest == manifest.digest

    with ram_disk(tmp_path / "a", "64m") as a_ckpt, ram_disk(tmp_path / "b", "32m") as b_ckpt:
        asyncio.run(scenario(a_ckpt, b_ckpt))


def test_inodes_in_flight_count_against_a_pull(tmp_path: Path) -> None:
    """The inode half of the rule: with the files of transfers in flight taking all but
    one of the store's free inodes, an item of more entries is refused before staging."""

    async def scenario(ckpt: Path) -> None:
        store = opened(ckpt)
        with ThreadPoolExecutor(max_workers=1) as executor:
            receiving = Receiving(store, executor)
            st = os.statvfs(store.root)
            room = inode_room(st.f_favail, st.f_files, 0)
            assert room is not None, "a tmpfs has a fixed number of inodes"
            big = SimpleNamespace(
                item=ItemId("other-job", 9, 0, 0), total_bytes=0, entries=room - 1
            )
            small = SimpleNamespace(item=ITEM, total_bytes=0, entries=2)
            async with receiving.reserved(small):  # type: ignore[arg-type]
                pass  # fits alone
            async with receiving.reserved(big):  # type: ignore[arg-type]
                with pytest.raises(TooLarge, match="inodes"):
                    async with receiving.reserved(small):  # type: ignore[arg-type]
                        pass

    with ram_disk(tmp_path / "n", "8m") as ckpt:
        asyncio.run(scenario(ckpt))


def test_the_file_bound_holds_pushes_not_this_nodes_own_pulls(tmp_path: Path) -> None:
    """``--max-item-files`` bounds what a peer may push here, not what this node pulls back
    of its own (docs/daemon.md: this node's own steps are never refused): with a bound of 2,
    a push of a 3-entry item is refused INVALID_ARGUMENT before staging, and the node's own
    pull of the same item from its peer is taken whole."""

    async def scenario(a_ckpt: Path, b_ckpt: Path) -> None:
        a_store, manifest = holding(a_ckpt, 1)
        assert manifest.entries > 2
        with ThreadPoolExecutor(max_workers=2) as executor:
            rules = ServiceRules(max_item_files=2)
            async with (
                serving(opened(b_ckpt), executor, rules) as b,
                serving(a_store, executor) as a,
                PeerClient(timeout=10.0) as a_client,
                PeerClient(timeout=10.0, receiving=b.receiving) as b_client,
            ):
                data = a_store.data_path(ITEM)
                with pytest.raises(PeerError) as pushed:
                    await a_client.push_item(b.address, manifest, data, a_store.root)
                assert pushed.value.code is grpc.StatusCode.INVALID_ARGUMENT
                assert b.store.get(ITEM) is None
                got = await b_client.pull_item(a.address, ITEM, b.store)
                assert got.digest == manifest.digest

    with ram_disk(tmp_path / "a", "16m") as a_ckpt, ram_disk(tmp_path / "b", "16m") as b_ckpt:
        asyncio.run(scenario(a_ckpt, b_ckpt))
