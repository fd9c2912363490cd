"""``cluster.replication``: which of this rank's steps are pushed to which ranks, what a failed
push reports, how a failed step is retried (not in a loop), and how retention (an item gone
before its push) and the drain (``settle``) meet a push. A real ``LocalStore`` on tmp_path,
a fake peer client and a clock of our own; no sockets, no sleeping."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.cluster import replication as replication_module
from mtc_replicator.cluster.replication import RETRY_FIRST, RETRY_MAX, Replication
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport.peer_client import PeerError, PeerUnavailable

# Rank 0 of four with two peers each: it pushes to ranks 1 and 2 (``core.layout``).
CONFIG = JobConfig(
    job_name="job", framework=Framework.ORBAX, node_rank=0, nodes=4, peers_per_node=2
)
ADDRESSES = {1: "10.0.0.1:7000", 2: "10.0.0.2:7000", 3: "10.0.0.3:7000"}


class Clock:
    """``time`` as the module sees it: ``monotonic`` only moves when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakePeers:
    """``PeerClient.push_item``: records (address, item); ``fail`` maps an address to the
    exception its pushes raise; ``gate``, when set, holds every push until it is set."""

    def __init__(self) -> None:
        self.pushed: list[tuple[str, ItemId]] = []
        self.fail: dict[str, Exception] = {}
        self.gate: asyncio.Event | None = None
        self.started = 0
        self.each_started = asyncio.Event()

    async def push_item(
        self, address: str, manifest: Manifest, data_path: Path, root: Path | None = None
    ) -> bool:
        self.started += 1
        self.each_started.set()
        assert root is not None
        assert data_path.is_relative_to(root)  # the store's own copy, read under its root
        if self.gate is not None:
            await self.gate.wait()
        if address in self.fail:
            raise self.fail[address]
        self.pushed.append((address, manifest.item))
        return False

    def steps_to(self, address: str) -> list[int]:
        return [item.step for a, item in self.pushed if a == address]


class World:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "store").mkdir()
        self.store = LocalStore(tmp_path / "store")
        self.store.open()
        self.tmp_path = tmp_path
        self.peers = FakePeers()
        self.errors: list[tuple[str, int | None]] = []
        self.clock = Clock()
        monkeypatch.setattr(replication_module, "time", self.clock)

    def commit(self, step: int, config: JobConfig = CONFIG, worker: int = 0) -> ItemId:
        item = ItemId(config.job_name, step, config.node_rank, worker)
        data = self.tmp_path / f"src-{step}-{worker}"
        data.mkdir()
        (data / "shard").write_bytes(os.urandom(100))
        manifest = build_manifest(item, data)
        staged = self.store.new_staging()
        os.rename(data, staged / "data")
        self.store.commit_staged(staged, manifest)
        return item

    def replication(
        self,
        config: JobConfig = CONFIG,
        *,
        peers: bool = True,
        news: Callable[[], None] = lambda: None,
    ) -> Replication:
        r = Replication(
            config,
            self.store,
            self.peers if peers else None,  # type: ignore[arg-type]
            lambda message, step: self.errors.append((message, step)),
            on_news=news,
        )
        r.set_addresses(ADDRESSES)
        return r


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    return World(tmp_path, monkeypatch)


def run(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(body())  # type: ignore[arg-type]


async def finish(r: Replication) -> None:
    """Let the push task in flight, if any, end."""
    task = r._task
    if task is not None and not task.done():
        await asyncio.wait([task])


# --- which steps go where -----------------------------------------------------------------


def test_a_step_replicated_wakes_the_incarnation_and_a_failed_push_does_not(
    world: World,
) -> None:
    """The coordinator orders a step's backup (and makes it restorable) when a report says
    it is replicated: left to the next rescan, every step would wait up to that long."""
    woken: list[int | None] = []
    world.commit(10)
    world.commit(20)
    r = world.replication(news=lambda: woken.append(r.newest_replicated))

    async def body() -> None:
        r.committed(10)
        await finish(r)
        assert woken == [10]
        world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "connection refused")
        r.committed(20)
        await finish(r)

    run(body)
    assert woken == [10]
    assert r.newest_replicated == 10


def test_the_targets_are_the_layouts() -> None:
    assert replication_targets(CONFIG) == (1, 2)


def test_a_committed_step_is_pushed_to_every_target_and_to_no_one_else(world: World) -> None:
    world.commit(10)
    r = world.replication()

    async def body() -> None:
        r.committed(10)
        await finish(r)

    run(body)
    assert sorted(world.peers.pushed) == [
        (ADDRESSES[1], ItemId("job", 10, 0, 0)),
        (ADDRESSES[2], ItemId("job", 10, 0, 0)),
    ]
    assert r.newest_replicated == 10
    assert r.pushing is None
    assert world.errors == []


def test_every_own_item_of_the_step_is_pushed(world: World) -> None:
    config = JobConfig(
        job_name="job",
        framework=Framework.PYTORCH,
        node_rank=0,
        nodes=2,
        peers_per_node=1,
        workers_per_node=2,
    )
    world.commit(5, config, 0)
    world.commit(5, config, 1)
    r = world.replication(config)
    assert run(lambda: r.replicate(5)) is True
    assert sorted(world.peers.pushed) == [
        (ADDRESSES[1], ItemId("job", 5, 0, 0)),
        (ADDRESSES[1], ItemId("job", 5, 0, 1)),
    ]


def test_equivalent_ranks_receive_no_push(world: World) -> None:
    # Data parallelism 2 over 4 nodes: rank 2 holds an equivalent checkpoint of its own.
    config = JobConfig(
        job_name="job",
        framework=Framework.ORBAX,
        node_rank=0,
        nodes=4,
        peers_per_node=3,
        data_parallelism=2,
    )
    world.commit(10, config)
    r = world.replication(config)
    assert run(lambda: r.replicate(10)) is True
    assert world.peers.steps_to(ADDRESSES[2]) == []
    assert world.peers.steps_to(ADDRESSES[1]) == [10]
    assert world.peers.steps_to(ADDRESSES[3]) == [10]


def test_one_node_has_nothing_to_push_and_its_newest_step_counts_as_replicated(
    world: World,
) -> None:
    config = JobConfig(job_name="job", framework=Framework.ORBAX, node_rank=0, nodes=1)
    r = world.replication(config, peers=False)

    async def body() -> None:
        r.committed(10)
        r.committed(5)  # an older step never lowers it
        assert r._task is None  # no push task at all

    run(body)
    assert r.newest_replicated == 10
    assert world.errors == []
    assert run(lambda: r.settle(20)) is True
    assert r.newest_replicated == 20


def test_a_step_that_arrives_during_a_push_is_pushed_next_and_the_older_one_not_again(
    world: World,
) -> None:
    world.commit(10)
    world.commit(20)
    world.commit(30)
    r = world.replication()

    async def body() -> None:
        world.peers.gate = asyncio.Event()
        r.committed(10)
        while world.peers.started < 2:
            world.peers.each_started.clear()
            await world.peers.each_started.wait()
        assert r.pushing == 10
        r.committed(20)
        r.committed(30)  # 20 is superseded before its turn
        world.peers.gate.set()
        await finish(r)

    run(body)
    assert world.peers.steps_to(ADDRESSES[1]) == [10, 30]
    assert world.peers.steps_to(ADDRESSES[2]) == [10, 30]
    assert r.newest_replicated == 30


def test_an_older_step_offered_later_does_not_replace_the_wish(world: World) -> None:
    world.commit(10)
    world.commit(20)
    r = world.replication()

    async def body() -> None:
        r.committed(20)
        r.committed(10)
        await finish(r)

    run(body)
    assert world.peers.steps_to(ADDRESSES[1]) == [20]
    assert r.newest_replicated == 20


def test_the_newest_replicated_step_never_goes_back(world: World) -> None:
    world.commit(10)
    world.commit(20)
    r = world.replication()
    assert run(lambda: r.replicate(20)) is True
    assert run(lambda: r.replicate(10)) is True
    assert r.newest_replicated == 20


# --- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        PeerUnavailable(ADDRESSES[2], "connection refused"),
        PeerError(ADDRESSES[2], "the peer does not take this job now"),
        CorruptItem("the peer found different bytes"),
        OSError("read failed"),
    ],
    ids=["unavailable", "refused", "corrupt", "oserror"],
)
def test_a_failed_push_is_reported_with_step_rank_and_address(world: World, exc: Exception) -> None:
    world.commit(10)
    world.peers.fail[ADDRESSES[2]] = exc
    r = world.replication()
    assert run(lambda: r.replicate(10)) is False
    assert r.newest_replicated is None
    # The other target got it all the same.
    assert world.peers.steps_to(ADDRESSES[1]) == [10]
    [(message, step)] = world.errors
    assert step == 10
    assert "step 10" in message
    assert "rank 2" in message
    assert ADDRESSES[2] in message
    assert str(exc) in message


def test_an_unexpected_exception_is_not_taken_for_a_failed_push(world: World) -> None:
    world.commit(10)
    world.peers.fail[ADDRESSES[1]] = KeyError("a bug")
    r = world.replication()
    with pytest.raises(KeyError):
        run(lambda: r.replicate(10))


def test_a_target_without_an_address_is_reported(world: World) -> None:
    world.commit(10)
    r = world.replication()
    r.set_addresses({1: ADDRESSES[1]})
    assert run(lambda: r.replicate(10)) is False
    assert world.errors == [("step 10: no address known for peer rank 2", 10)]
    assert world.peers.steps_to(ADDRESSES[1]) == [10]


def test_without_a_peer_plane_every_target_is_reported(world: World) -> None:
    world.commit(10)
    r = world.replication(peers=False)
    assert run(lambda: r.replicate(10)) is False
    assert sorted(m for m, _ in world.errors) == [
        "step 10: no address known for peer rank 1",
        "step 10: no address known for peer rank 2",
    ]


def test_a_step_retention_deleted_is_not_pushed_and_not_an_error(world: World) -> None:
    world.commit(10)
    r = world.replication()
    assert run(lambda: r.replicate(20)) is False
    assert world.peers.pushed == []
    assert world.errors == []
    assert r.newest_replicated is None


# --- retry backoff ------------------------------------------------------------------------


def test_a_failed_step_is_not_retried_before_its_backoff(world: World) -> None:
    world.commit(10)
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down")
    r = world.replication()

    async def offer() -> None:
        r.committed(10)
        await finish(r)

    run(offer)
    assert world.peers.started == 2
    # Offered again at once (the agent's next rescan): no new attempt.
    run(offer)
    assert world.peers.started == 2
    # After the first wait at most (RETRY_FIRST, jittered down to half): tried again.
    world.clock.now += RETRY_FIRST
    run(offer)
    assert world.peers.started == 4


def test_the_waits_between_attempts_grow_to_the_cap(world: World) -> None:
    world.commit(10)
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down")
    r = world.replication()
    waits: list[float] = []

    async def attempt() -> None:
        r.committed(10)
        await finish(r)

    for _ in range(12):
        before = world.clock.now
        run(attempt)
        waits.append(r._retry_at - before)
        world.clock.now = r._retry_at
    assert RETRY_FIRST / 2 <= waits[0] <= RETRY_FIRST
    assert all(RETRY_MAX / 2 <= w <= RETRY_MAX for w in waits[-3:])
    assert max(waits) <= RETRY_MAX
    assert world.peers.started == 24  # each offer after its wait made one attempt


def test_a_new_step_is_tried_at_once_despite_the_backoff(world: World) -> None:
    world.commit(10)
    world.commit(20)
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down")
    r = world.replication()

    async def offer(step: int) -> None:
        r.committed(step)
        await finish(r)

    run(lambda: offer(10))
    del world.peers.fail[ADDRESSES[2]]
    run(lambda: offer(20))
    assert world.peers.steps_to(ADDRESSES[2]) == [20]
    assert r.newest_replicated == 20


def test_a_peer_that_moved_is_tried_at_once_and_at_its_new_address(world: World) -> None:
    world.commit(10)
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down")
    r = world.replication()

    async def offer() -> None:
        r.committed(10)
        await finish(r)

    run(offer)
    r.update_addresses(dict(ADDRESSES))  # the same addresses: the backoff holds
    run(offer)
    assert world.peers.started == 2
    moved = "10.0.0.2:7100"
    r.update_addresses({2: moved})
    assert r.addresses == {**ADDRESSES, 2: moved}
    run(offer)
    assert world.peers.steps_to(moved) == [10]
    assert r.newest_replicated == 10


def test_a_success_resets_the_backoff(world: World) -> None:
    world.commit(10)
    world.commit(20)
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down")
    r = world.replication()

    async def offer(step: int) -> None:
        r.committed(step)
        await finish(r)

    for _ in range(6):  # the waits grow well past the first
        run(lambda: offer(10))
        world.clock.now = r._retry_at
    del world.peers.fail[ADDRESSES[2]]
    run(lambda: offer(10))
    assert r.newest_replicated == 10
    world.peers.fail[ADDRESSES[2]] = PeerUnavailable(ADDRESSES[2], "down again")
    before = world.clock.now
    run(lambda: offer(20))
    assert r._retry_at - before <= RETRY_FIRST


# --- drain and stop -----------------------------------------------------------------------


def test_settle_waits_for_the_push_in_flight_and_pushes_nothing_more(world: World) -> None:
    world.commit(10)
    r = world.replication()

    async def body() -> bool:
        world.peers.gate = asyncio.Event()
        r.committed(10)
        await asyncio.sleep(0)
        settling = asyncio.create_task(r.settle(10))
        await asyncio.sleep(0)
        assert not settling.done()  # held by the push in flight
        world.peers.gate.set()
        return await settling

    assert run(body) is True
    assert world.peers.steps_to(ADDRESSES[1]) == [10]  # once, not twice


def test_settle_pushes_a_step_a_target_lacks_and_says_whether_all_hold_it(world: World) -> None:
    world.commit(10)
    r = world.replication()
    seen: list[int | None] = []
    push = world.peers.push_item

    async def watching(*args: Any, **kw: Any) -> bool:
        seen.append(r.pushing)  # the coordinator asks every rank to keep it meanwhile
        return await push(*args, **kw)

    world.peers.push_item = watching  # type: ignore[method-assign]
    world.peers.fail[ADDRESSES[1]] = PeerUnavailable(ADDRESSES[1], "down")
    assert run(lambda: r.settle(10)) is False
    assert seen == [10, 10]
    assert r.pushing is None
    del world.peers.fail[ADDRESSES[1]]
    assert run(lambda: r.settle(10)) is True
    assert r.newest_replicated == 10


def test_settle_of_a_step_already_replicated_pushes_nothing(world: World) -> None:
    world.commit(10)
    r = world.replication()
    r.newest_replicated = 20
    assert run(lambda: r.settle(10)) is True
    assert world.peers.pushed == []


def test_stop_cancels_the_push_in_flight(world: World) -> None:
    world.commit(10)
    r = world.replication()

    async def body() -> None:
        world.peers.gate = asyncio.Event()  # never set
        r.committed(10)
        await asyncio.sleep(0)
        await r.stop()
        assert r._task is not None
        assert r._task.cancelled()

    run(body)
    assert world.peers.pushed == []
    assert r.newest_replicated is None
    assert r.pushing is None
