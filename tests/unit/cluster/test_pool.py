"""Pool copies: the holder's choice, the admission of a pool copy, what a holder keeps
(``core.pool``), the pool's signed entries on a real file store (``cluster.pool``) and the
notes of held copies on a real store (``local.pool_held``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from mtc_replicator.cluster.pool import Pool, PoolView, entry_key
from mtc_replicator.core.admission import Verdict
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.pool import (
    MEMBER_TTL_SECONDS,
    PoolMember,
    admit_pool_copy,
    candidates,
    holder_for,
    newest_complete,
    ranking,
    steps_past_keep,
)
from mtc_replicator.core.signed import OPEN
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pool_held import PoolHeld
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.attesting import manifest_trust
from mtc_replicator.transport.identity import own_node
from mtc_replicator.transport.peer_client import PeerUnavailable
from mtc_replicator.transport.signing import record_trust
from tests.tls import node_tls


def _nodes(n: int) -> list[str]:
    return [f"node-{i}" for i in range(n)]


def test_jobs_spread_evenly_over_the_pool_and_a_new_node_moves_only_what_it_wins() -> None:
    pool = _nodes(8)
    jobs = [f"trial-{i:05d}" for i in range(4000)]
    chosen = {job: holder_for(job, "node-0", pool) for job in jobs}
    counts = Counter(chosen.values())
    assert set(counts) == {f"node-{i}" for i in range(1, 8)}  # never the producer
    assert max(counts.values()) < 1.25 * min(counts.values()), counts
    grown = [*pool, "node-8"]
    moved = [j for j in jobs if holder_for(j, "node-0", grown) != chosen[j]]
    assert all(holder_for(j, "node-0", grown) == "node-8" for j in moved)
    assert 0.08 < len(moved) / len(jobs) < 0.17  # about 1/8


def test_a_restart_asks_the_holder_whichever_node_produced_the_steps() -> None:
    pool = _nodes(6)
    for job in (f"trial-{i}" for i in range(200)):
        for producer in pool:
            holder = holder_for(job, producer, pool)
            assert holder is not None
            for me in pool:
                asked = candidates(job, me, pool)
                assert holder in asked or holder == me
        assert ranking(job, pool) == ranking(job, list(reversed(pool)))
    assert holder_for("trial-1", "node-0", ["node-0"]) is None  # alone in its namespace


def test_the_admission_of_a_pool_copy() -> None:
    item = ItemId("trial", 10, 0, 0)
    assert admit_pool_copy(item, runs_here=False, newest_held=None).accepted
    here = admit_pool_copy(item, runs_here=True, newest_held=None)
    assert here.verdict is Verdict.NOT_SERVED
    assert "runs on this node" in here.reason
    rank = admit_pool_copy(ItemId("trial", 10, 1, 0), runs_here=False, newest_held=None)
    assert rank.verdict is Verdict.NOT_IN_JOB
    far = admit_pool_copy(ItemId("trial", 10**7, 0, 0), runs_here=False, newest_held=5)
    assert far.verdict is Verdict.TOO_FAR_AHEAD
    assert admit_pool_copy(item, runs_here=False, newest_held=5, max_lead=5).accepted


def test_what_a_holder_keeps_and_which_step_is_whole() -> None:
    assert steps_past_keep({9, 3, 7, 5}) == [3, 5]
    assert steps_past_keep({9}) == []
    items = [ItemId("t", 4, 0, 0), ItemId("t", 4, 0, 1), ItemId("t", 6, 0, 0), ItemId("t", 8, 1, 0)]
    assert newest_complete(items, [0, 1]) == 4  # step 6 lacks worker 1; rank 1 is no copy
    assert newest_complete(items, [0]) == 6
    assert newest_complete([], [0]) is None


def test_the_pool_lists_a_namespaces_fresh_nodes_and_believes_self_signed_entries(
    tmp_path: Path,
) -> None:
    ca = certs.new_ca()
    tls = {n: node_tls(tmp_path / n, ca, node=n).material() for n in ("node-a", "node-b")}
    objects = FileObjectStore(tmp_path / "registry")
    now = [time.time()]

    def pool_of(node: str) -> Pool:
        material = tls[node]
        verifier = manifest_trust(material, own_node(material)).verifier
        return Pool(objects, record_trust(material), verifier, clock=lambda: now[0])

    pool_of("node-a").announce("node-a", "10.0.0.1:8470", "team-a")
    pool_of("node-b").announce("node-b", "10.0.0.2:8470", "team-a")
    pool_of("node-b").announce("node-b", "10.0.0.2:8470", "team-b")  # a handoff: both
    # node-b signs an entry naming node-c: it could send node-c's jobs' copies anywhere.
    pool_of("node-b").announce("node-c", "10.0.0.3:8470", "team-a")
    objects.put_bytes(entry_key("team-a", "junk"), b"{not json")
    unsigned = {"node": "node-d", "address": "10.0.0.4:8470", "owner": "team-a"}
    unsigned["announced_at"] = now[0]  # type: ignore[assignment]
    objects.put_bytes(entry_key("team-a", "node-d"), json.dumps(unsigned).encode())
    reader = pool_of("node-a")
    assert sorted(reader.names("team-a")) == ["junk", "node-a", "node-b", "node-c", "node-d"]
    assert reader.names("team-b") == ["node-b"]
    assert reader.names("") == []
    got = {n: reader.member("team-a", n) for n in reader.names("team-a")}
    assert {n for n, m in got.items() if m is not None} == {"node-a", "node-b"}
    member = got["node-b"]
    assert member is not None
    assert (member.address, member.owner) == ("10.0.0.2:8470", "team-a")
    assert reader.member("team-b", "node-a") is None  # no entry there
    now[0] += MEMBER_TTL_SECONDS + 1  # nobody renewed: by the store's time, and the entry's
    assert reader.names("team-a") == []
    assert reader.member("team-a", "node-a") is None
    # Without TLS nothing is signed nor checked, but the entries still say who is where.
    open_pool = Pool(objects, OPEN, None, clock=time.time)
    open_pool.announce("10.0.0.9:8470", "10.0.0.9:8470", "")
    assert open_pool.names("") == ["10.0.0.9:8470"]
    with pytest.raises(ValueError, match="not a node name"):
        open_pool.announce("a/b", "10.0.0.9:8470", "")


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    s = LocalStore(ckpt)
    s.open()
    return s


def _commit(store: LocalStore, item: ItemId, tmp_path: Path) -> None:
    src = tmp_path / f"src-{item.step}-{item.rank}-{item.worker}"
    src.mkdir()
    (src / "state").write_bytes(f"{item}".encode())
    manifest = build_manifest(item, src)
    staged = store.new_staging()
    (staged / "data").mkdir()
    (staged / "data" / "state").write_bytes(f"{item}".encode())
    store.commit_staged(staged, manifest)


def test_held_copies_keep_the_newest_two_steps_and_settle_when_the_job_comes(
    store: LocalStore, tmp_path: Path
) -> None:
    held = PoolHeld(store)
    for step in (1, 2, 3):
        _commit(store, ItemId("trial", step, 0, 0), tmp_path)
        held.committed(ItemId("trial", step, 0, 0))
    assert {i.step for i in store.manifests("trial")} == {2, 3}
    assert held.newest("trial") == 3
    assert held.held("trial")
    assert held.settle("trial", nodes=1) == []  # its own now: kept, the note goes
    assert {i.step for i in store.manifests("trial")} == {2, 3}
    assert not held.held("trial")

    _commit(store, ItemId("reused", 7, 0, 0), tmp_path)
    held.committed(ItemId("reused", 7, 0, 0))
    assert held.settle("reused", nodes=4) == [ItemId("reused", 7, 0, 0)]  # a cluster job's
    assert store.manifests("reused") == {}
    assert held.settle("never-held", nodes=4) == []


def test_a_node_dialled_at_a_stale_address_is_dialled_again_at_its_new_one(
    tmp_path: Path,
) -> None:
    """A daemon restarted on another port: the cached entry's address refuses, the entry
    is read afresh and the call goes to the new address; an address that did not change
    is not tried twice."""
    objects = FileObjectStore(tmp_path / "registry")
    pool = Pool(objects, OPEN, None)
    pool.announce("node-b", "127.0.0.1:1111", "")

    async def run_thread(fn: object, *args: object) -> object:
        return fn(*args)  # type: ignore[operator]

    view = PoolView(pool, run_thread)
    dialled: list[str] = []

    async def call(member: PoolMember) -> str:
        dialled.append(member.address)
        if member.address == "127.0.0.1:1111":
            raise PeerUnavailable(member.address, "connection refused")
        return member.address

    async def scenario() -> None:
        assert await view.member("", "node-b") is not None  # cached at the old address
        pool.announce("node-b", "127.0.0.1:2222", "")
        assert await view.dial("", "node-b", call) == "127.0.0.1:2222"
        assert dialled == ["127.0.0.1:1111", "127.0.0.1:2222"]
        pool.announce("node-b", "127.0.0.1:1111", "")
        await view.member("", "node-b", fresh=True)
        dialled.clear()
        with pytest.raises(PeerUnavailable):
            await view.dial("", "node-b", call)
        assert dialled == ["127.0.0.1:1111"]
        assert await view.dial("", "node-x", call) is None  # no entry: nothing dialled

    asyncio.run(scenario())
