"""``cluster.membership``: a rank's steady state with its coordinator, driven through a fake
``CoordinatorLink`` and a clock of our own. What the reports promise (and what retention
keeps because of a promise), their cadence and backoff, nothing reported before the round
releases the rank, and backups ordered one at a time with a growing wait after a failure.
A real ``LocalStore`` on tmp_path and an in-memory bucket; no sockets, no sleeping."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.cluster import membership as membership_module
from mtc_replicator.cluster.backup_orders import UPLOAD_RETRY_MAX
from mtc_replicator.cluster.link import CoordinatorError, NoCoordinator
from mtc_replicator.cluster.membership import (
    UNCONFIRMED_KEPT,
    ClusterMember,
    MemberContext,
)
from mtc_replicator.cluster.rounds import JobRank, RoundOutcome
from mtc_replicator.cluster.sources import ItemSources
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.coordination import MAX_REPORT_EVERY, ProgressAnswer
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import LastBackup
from mtc_replicator.core.progress import Progress
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.metrics import ErrorKind, Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore, ObjectStoreError

ONE = JobConfig(job_name="job", framework=Framework.ORBAX, node_rank=0, nodes=1)
FOUR = JobConfig(job_name="job", framework=Framework.ORBAX, node_rank=1, nodes=4, peers_per_node=1)
ADVERTISE = "10.0.0.9:7000"
INCARNATION = "inc-1"


class Clock:
    """``time`` as the module sees it: ``monotonic`` moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


Answer = ProgressAnswer | Exception


class FakeLink:
    """A ``CoordinatorLink``'s ``report_progress`` and ``close``: records each report's
    arguments and answers with ``answer`` (raised when an exception); ``gate``, when set,
    holds the answer until it is set."""

    def __init__(self, address: str, answer: Answer) -> None:
        self.address = address
        self.answer = answer
        self.reports: list[dict[str, Any]] = []
        self.closed = False
        self.gate: asyncio.Event | None = None

    async def report_progress(
        self, rank: int, incarnation_id: str, progress: Progress
    ) -> ProgressAnswer:
        self.reports.append(
            {"rank": rank, "incarnation_id": incarnation_id, **dataclasses.asdict(progress)}
        )
        if self.gate is not None:
            await self.gate.wait()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def close(self) -> None:
        self.closed = True


class FakeFinder:
    """A ``CoordinatorFinder``: every link it hands out answers ``answer``; ``present``
    False makes ``find`` raise ``NoCoordinator``."""

    def __init__(self) -> None:
        self.answer: Answer = ProgressAnswer(None, None)
        self.present = True
        self.links: list[FakeLink] = []
        self.opened: list[str] = []
        self.finds = 0

    def _link(self, address: str) -> FakeLink:
        link = FakeLink(address, self.answer)
        self.links.append(link)
        return link

    async def find(self, job: str, *, timeout: float) -> FakeLink:
        assert job == "job"
        self.finds += 1
        if not self.present:
            raise NoCoordinator("no coordinator of job job")
        return self._link(f"found-{self.finds}")

    def open(self, job: str, address: str) -> FakeLink:
        assert job == "job"
        self.opened.append(address)
        return self._link(address)

    @property
    def reports(self) -> list[dict[str, Any]]:
        return [r for link in self.links for r in link.reports]

    def answer_with(self, answer: Answer) -> None:
        """What every link, the current one included, answers from now on."""
        self.answer = answer
        for link in self.links:
            link.answer = answer


class Recorded(Metrics):
    def __init__(self) -> None:
        self.replicated_steps: list[int | None] = []
        self.restorable_steps: list[int | None] = []
        self.backups: list[tuple[int, float | None]] = []

    def replicated(self, job: str, step: int | None) -> None:
        self.replicated_steps.append(step)

    def cluster_restorable(self, job: str, step: int | None) -> None:
        self.restorable_steps.append(step)

    def backed_up(self, job: str, step: int, created: float | None) -> None:
        self.backups.append((step, created))


class FlakyBucket(MemoryObjectStore):
    """An in-memory bucket whose writes fail while ``down``; ``puts``: the files written."""

    down = False

    def __init__(self) -> None:
        super().__init__()
        self.puts: list[str] = []

    def put_file(self, key: str, src: Path, **kw: Any) -> None:
        if self.down:
            raise ObjectStoreError("the bucket is down")
        self.puts.append(key)
        super().put_file(key, src, **kw)


class World:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "store").mkdir()
        self.store = LocalStore(tmp_path / "store")
        self.store.open()
        self.tmp_path = tmp_path
        self.finder = FakeFinder()
        self.clock = Clock()
        monkeypatch.setattr(membership_module, "time", self.clock)
        self.bucket = FlakyBucket()
        self.backups = BackupStore(self.bucket)
        self.errors: list[tuple[str, int | None, ErrorKind]] = []
        self.metrics = Recorded()
        self.gate: asyncio.Event | None = None
        """When set, every blocking call (the upload's) waits for it."""
        self.threads = 0

    async def run_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.threads += 1
        if self.gate is not None:
            await self.gate.wait()
        return fn(*args)

    def error(self, message: str, step: int | None, kind: ErrorKind = ErrorKind.OTHER) -> None:
        self.errors.append((message, step, kind))

    def commit(self, step: int, config: JobConfig = ONE) -> ItemId:
        item = ItemId(config.job_name, step, config.node_rank, 0)
        data = self.tmp_path / f"src-{step}"
        data.mkdir()
        (data / "shard").write_bytes(os.urandom(100))
        manifest = build_manifest(item, data)
        staged = self.store.new_staging()
        os.rename(data, staged / "data")
        self.store.commit_staged(staged, manifest)
        return item

    def member(
        self,
        config: JobConfig = ONE,
        *,
        backups: bool = True,
        news: Callable[[], None] = lambda: None,
    ) -> ClusterMember:
        rank = JobRank(config, INCARNATION, self.store, self.finder, ADVERTISE)  # type: ignore[arg-type]
        return ClusterMember(
            MemberContext(
                rank,
                ItemSources(self.store, config.node_rank),
                backups=self.backups if backups else None,
                peers=None,
                run_thread=self.run_thread,
                error=self.error,
                metrics=self.metrics,
                news=news,
            )
        )


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    return World(tmp_path, monkeypatch)


def released(
    m: ClusterMember, step: int | None = None, addresses: dict[int, str] | None = None
) -> None:
    m.adopt(RoundOutcome(step, "local", {}, addresses or {}, "coord:1"))


def ordered(world: World) -> ClusterMember:
    """A member whose rank committed step 10, released at it, and whose coordinator's next
    answer orders the backup of step 10."""
    world.commit(10)
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10))
    return m


def answer(
    restorable: int | None = None,
    backup: int | None = None,
    *,
    every: int = 5,
    keep: frozenset[int] = frozenset(),
    addresses: dict[int, str] | None = None,
    last: LastBackup | None = None,
) -> ProgressAnswer:
    return ProgressAnswer(restorable, backup, addresses or {}, keep, every, last)


# --- before the release -------------------------------------------------------------------


def test_a_restoring_rank_replicates_but_reports_nothing(world: World) -> None:
    m = world.member()

    async def body() -> None:
        await m.tick(10, force=True)

    asyncio.run(body())
    assert not m.running
    assert world.finder.finds == 0
    assert world.finder.reports == []
    assert m._replication.newest_replicated == 10  # one node: committed is replicated
    assert world.metrics.replicated_steps == []  # ... but no replication is claimed


def test_the_release_opens_the_coordinator_that_released_it_and_takes_its_step(
    world: World,
) -> None:
    m = world.member(FOUR)
    assert m.coordinator is None
    released(m, 20, {2: "10.0.0.2:7000"})
    assert m.running
    assert world.finder.opened == ["coord:1"]
    assert m.coordinator == "coord:1"
    assert m.restorable == 20
    assert m.protected == {20}
    assert m._replication.newest_replicated == 20
    assert m._replication.addresses == {2: "10.0.0.2:7000"}


def test_the_member_answers_for_its_replication(world: World) -> None:
    """What the node reads of a rank's replication (``mtc status``, the peer probe), asked
    of the member itself: the targets' addresses, and a step shown replicated only where
    there are targets to hold it."""
    one = world.member()
    released(one, 10)
    assert one.addresses == {}
    assert one.last_replicated is None  # one node: nothing is claimed replicated
    four = world.member(FOUR)
    released(four, 20, {2: "10.0.0.2:7000"})
    assert four.addresses == {2: "10.0.0.2:7000"}
    assert four.last_replicated == 20


def test_a_fresh_start_leaves_nothing_restorable(world: World) -> None:
    m = world.member()
    released(m, None)
    assert m.running
    assert m.restorable is None
    assert m.protected == set()


# --- what a report says -------------------------------------------------------------------


def test_a_report_says_who_what_and_where(world: World) -> None:
    m = world.member(FOUR)
    released(m, 10)
    m.retained([8, 9, 10])

    asyncio.run(m.tick(None, force=True))
    assert world.finder.reports == [
        {
            "rank": 1,
            "incarnation_id": INCARNATION,
            "replicated_step": 10,
            "uploaded_step": None,
            "address": ADVERTISE,
            "held": frozenset({9, 10}),
            "replicating_step": None,
            "address_ranks": frozenset(replication_targets(FOUR)),
        }
    ]


def test_before_any_retention_pass_a_report_promises_nothing_in_particular(world: World) -> None:
    m = world.member()
    released(m)
    asyncio.run(m.tick(None, force=True))
    assert world.finder.reports[0]["held"] is None  # None: every step may be named


def test_the_answer_is_taken_in(world: World) -> None:
    m = world.member(FOUR)
    released(m, 10)
    (target,) = m._targets
    pusher = next(r for r in range(4) if r not in (target, m.config.node_rank))
    world.finder.answer_with(
        answer(
            20,
            keep=frozenset({30}),
            addresses={target: "a:1", pusher: "b:2"},
            last=LastBackup(20, 123.0),
        )
    )
    asyncio.run(m.tick(None, force=True))
    assert m.restorable == 20
    assert m.keep_steps == frozenset({30})
    assert m._replication.addresses == {target: "a:1"}  # a pusher's address is no peer's
    assert world.metrics.restorable_steps == [20]
    assert world.metrics.backups == [(20, 123.0)]


def test_an_answer_without_a_restorable_step_keeps_the_one_known(world: World) -> None:
    m = world.member()
    released(m, 10)
    asyncio.run(m.tick(None, force=True))
    assert m.restorable == 10


# --- cadence and backoff ------------------------------------------------------------------


def test_reports_go_when_forced_when_there_is_news_or_when_the_interval_passed(
    world: World,
) -> None:
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(every=5))

    async def body() -> list[int]:
        counts = []
        await m.tick(10, force=True)  # a new step: at once
        counts.append(len(world.finder.reports))
        await m.tick(10)  # nothing new, interval not over
        counts.append(len(world.finder.reports))
        world.clock.now += 4.9
        await m.tick(10)
        counts.append(len(world.finder.reports))
        world.clock.now += 0.1  # the interval the coordinator asked for
        await m.tick(10)
        counts.append(len(world.finder.reports))
        await m.tick(10, force=True)  # forced: before the interval
        counts.append(len(world.finder.reports))
        await m.tick(11)  # news: step 11 replicated
        counts.append(len(world.finder.reports))
        await m.tick(11)
        counts.append(len(world.finder.reports))
        return counts

    assert asyncio.run(body()) == [1, 1, 1, 2, 3, 4, 4]
    assert world.finder.reports[-1]["replicated_step"] == 11


def test_a_failed_report_drops_the_link_and_is_retried_after_a_backoff(world: World) -> None:
    m = world.member()
    released(m, 10)
    world.finder.answer_with(CoordinatorError("the coordinator restarted"))

    async def body() -> None:
        await m.tick(10, force=True)
        first = world.finder.links[0]
        assert first.closed
        assert m.coordinator is None
        # Neither news nor a new step calls it again before the backoff.
        await m.tick(11, force=True)
        assert world.finder.finds == 0
        assert len(world.finder.reports) == 1
        world.finder.answer_with(answer(every=5))
        world.clock.now += 1.0  # the first wait is at most 1 s
        await m.tick(11)
        # Looked up again, and heard.
        assert world.finder.finds == 1
        assert m.coordinator == "found-1"
        assert world.finder.reports[-1]["replicated_step"] == 11

    asyncio.run(body())


def test_the_report_backoff_grows_to_the_most_a_coordinator_waits(world: World) -> None:
    m = world.member()
    released(m, 10)
    world.finder.present = False  # no coordinator in the registry either

    async def body() -> None:
        await m.tick(10, force=True)  # the link from the release fails
        for _ in range(10):
            world.clock.now += MAX_REPORT_EVERY
            await m.tick(10, force=True)
        finds = world.finder.finds
        assert finds == 10  # one look-up per wait, none more
        world.clock.now += MAX_REPORT_EVERY / 2 - 0.01  # the capped wait is at least half
        await m.tick(10, force=True)
        assert world.finder.finds == finds
        world.clock.now += MAX_REPORT_EVERY / 2 + 0.01
        await m.tick(10, force=True)
        assert world.finder.finds == finds + 1

    world.finder.answer_with(CoordinatorError("gone"))
    asyncio.run(body())


def test_a_success_resets_the_report_backoff(world: World) -> None:
    m = world.member()
    released(m, 10)
    world.finder.answer_with(CoordinatorError("gone"))

    async def body() -> None:
        for _ in range(6):
            await m.tick(10, force=True)
            world.clock.now += MAX_REPORT_EVERY
        world.finder.answer_with(answer(every=5))
        await m.tick(10, force=True)
        assert m.coordinator is not None
        world.finder.answer_with(CoordinatorError("gone again"))
        await m.tick(10, force=True)
        before = world.finder.finds
        world.clock.now += 1.0  # back to the first wait
        await m.tick(10)
        assert world.finder.finds == before + 1

    asyncio.run(body())


# --- promises and retention ---------------------------------------------------------------


def test_without_a_promise_every_step_above_the_restorable_one_is_kept(world: World) -> None:
    m = world.member(FOUR)
    assert m.retained([1, 2, 3, 4, 5, 6]) == {1, 2, 3, 4, 5, 6}
    released(m, 3)
    assert m.retained([1, 2, 3, 4, 5, 6]) == {3, 4, 5, 6}


def test_the_restorable_step_the_upload_asked_steps_and_the_newest_are_promised(
    world: World,
) -> None:
    m = world.member(FOUR)
    released(m, 3)
    world.finder.answer_with(answer(3, keep=frozenset({5})))
    m.retained(list(range(1, 11)))
    asyncio.run(m.tick(None, force=True))  # answered: the coordinator asks for 5 too
    newest = set(range(11 - UNCONFIRMED_KEPT, 11))
    assert m.retained(list(range(1, 11))) == {3, 5} | newest
    asyncio.run(m.tick(None, force=True))
    assert world.finder.reports[-1]["held"] == frozenset({3, 5} | newest)


def test_a_step_stays_while_an_answered_promise_covers_it(world: World) -> None:
    m = world.member(FOUR)
    released(m, 3)
    world.finder.answer_with(answer(3))
    m.retained([3, 4, 5])
    asyncio.run(m.tick(None, force=True))  # promised {3, 4, 5}
    # Two newer steps: 4 is no longer wanted, but the coordinator may name it from the
    # promise it answered; it goes once a newer promise is answered.
    assert m.retained([3, 4, 5, 6, 7]) == {3, 4, 5, 6, 7}
    asyncio.run(m.tick(None, force=True))  # promised {3, 6, 7}
    assert m.retained([3, 4, 5, 6, 7]) == {3, 6, 7}


def test_the_promise_in_flight_is_kept_until_answered(world: World) -> None:
    m = world.member(FOUR)
    released(m, 3)
    world.finder.answer_with(answer(3))
    m.retained([3, 4, 5])
    asyncio.run(m.tick(None, force=True))  # promised {3, 4, 5}
    m.retained([3, 4, 5, 6])  # offers {3, 5, 6}

    async def body() -> None:
        link = world.finder.links[0]
        link.gate = asyncio.Event()
        report = asyncio.create_task(m.tick(None, force=True))
        await asyncio.sleep(0)
        assert link.reports[-1]["held"] == frozenset({3, 5, 6})
        # Meanwhile two newer steps: 5 and 6 are no longer among the newest, but the
        # promise in flight names them (and the answered one 4).
        assert m.retained([3, 4, 5, 6, 7, 8]) == {3, 4, 5, 6, 7, 8}
        link.gate.set()
        await report

    asyncio.run(body())
    # Answered: the promise that was in flight replaced the older one, so 4 goes.
    assert m.retained([3, 4, 5, 6, 7, 8]) == {3, 5, 6, 7, 8}


def test_a_failed_report_keeps_both_promises(world: World) -> None:
    m = world.member(FOUR)
    released(m, 3)
    world.finder.answer_with(answer(3))
    m.retained([3, 4, 5])
    asyncio.run(m.tick(None, force=True))  # promised {3, 4, 5}
    m.retained([3, 4, 5, 6, 7])  # offers {3, 6, 7}
    world.finder.answer_with(CoordinatorError("restarted"))
    asyncio.run(m.tick(None, force=True))
    # The coordinator may have taken the new promise or not: 4, 5, 6 and 7 all stay.
    assert m.retained([3, 4, 5, 6, 7, 8]) == {3, 4, 5, 6, 7, 8}


def test_one_node_keeps_only_its_newest_step_unconfirmed(world: World) -> None:
    m = world.member(ONE)
    released(m, 3)
    asyncio.run(m.tick(None, force=True))
    m.retained([3, 4, 5])
    asyncio.run(m.tick(None, force=True))
    # The promise was {3, 5}: the newest only, where four nodes keep two.
    assert m.retained([3, 4, 5, 6]) == {3, 5, 6}
    asyncio.run(m.tick(None, force=True))
    assert m.retained([3, 4, 5, 6]) == {3, 6}


# --- backups ------------------------------------------------------------------------------


def test_an_ordered_backup_is_uploaded_and_reported(world: World) -> None:
    m = ordered(world)

    async def body() -> None:
        await m.tick(10, force=True)
        assert m.uploading == 10
        assert 10 in m.protected
        world.finder.answer_with(answer(10))
        assert await m._orders.settle(10)
        assert m.uploading is None
        assert m.uploaded == 10
        await m.tick(10)  # news: the upload is done
        assert world.finder.reports[-1]["uploaded_step"] == 10

    asyncio.run(body())
    assert world.backups.try_commit("job", 10, ["0-0"]) is not None  # every item is there
    assert world.errors == []


def test_the_end_of_an_upload_wakes_the_incarnation_to_report_it_at_once(world: World) -> None:
    """The coordinator writes the COMMIT when a report says the upload is done: left to
    the next rescan (2 s by default), every backup would commit up to that much later."""
    woken: list[int | None] = []
    world.commit(10)
    world.commit(20)
    m = world.member(news=lambda: woken.append(m.uploaded))
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10, every=1))

    async def body() -> None:
        await m.tick(10, force=True)
        assert m.uploading == 10
        assert woken == []
        assert await m._orders.settle(10)
        assert woken == [10]  # once it is done, with the step done
        # A failed upload is no news: the report would say what the last one said.
        world.bucket.down = True
        world.finder.answer_with(answer(10, backup=20, every=1))
        world.clock.now += 1
        await m.tick(20, force=True)
        assert m.uploading == 20
        assert not await m._orders.settle(20)

    asyncio.run(body())
    assert woken == [10]
    assert len(world.errors) == 1


def test_one_upload_at_a_time_while_the_order_repeats(world: World) -> None:
    world.commit(10)
    world.commit(20)
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10, every=1))

    async def body() -> None:
        world.gate = asyncio.Event()
        await m.tick(10, force=True)
        await asyncio.sleep(0)
        threads = world.threads
        world.finder.answer_with(answer(10, backup=20, every=1))
        world.clock.now += 1
        await m.tick(20, force=True)  # a newer order while 10 uploads: not taken now
        assert m.uploading == 10
        world.gate.set()
        assert await m._orders.settle(10)
        assert world.threads > threads
        await m.tick(20, force=True)  # repeated: taken now
        assert m.uploading == 20
        assert await m._orders.settle(20)

    asyncio.run(body())
    assert m.uploaded == 20


def test_without_a_backup_an_order_is_ignored(world: World) -> None:
    world.commit(10)
    m = world.member(backups=False)
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10))
    asyncio.run(m.tick(10, force=True))
    assert m.uploading is None
    assert m.uploaded is None
    assert world.threads == 0


def test_a_failed_upload_is_reported_and_retried_after_a_growing_wait(world: World) -> None:
    world.commit(10)
    world.bucket.down = True
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10, every=1))
    waits: list[float] = []

    async def order() -> None:
        await m.tick(10, force=True)
        await m._orders.settle(10)

    async def body() -> None:
        await order()
        assert len(world.errors) == 1
        message, step, kind = world.errors[0]
        assert (step, kind) == (10, ErrorKind.BACKUP)
        assert "backup of step 10" in message
        assert "the bucket is down" in message
        assert m.uploaded is None
        assert m.uploading is None
        # The coordinator repeats its order at every report: not taken before the wait.
        await order()
        assert len(world.errors) == 1
        for _ in range(12):
            world.clock.now += UPLOAD_RETRY_MAX
            await order()
            waits.append(float(world.errors[-1][0].split("will retry in ")[1].split("s")[0]))
        assert len(world.errors) == 13  # one try per wait
        world.bucket.down = False
        world.clock.now += UPLOAD_RETRY_MAX
        await order()
        assert m.uploaded == 10

    asyncio.run(body())
    assert waits[0] < waits[-1]
    assert UPLOAD_RETRY_MAX / 2 - 1 <= waits[-1] <= UPLOAD_RETRY_MAX


def test_the_first_upload_retry_comes_within_seconds(world: World) -> None:
    world.commit(10)
    world.bucket.down = True
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10, every=1))

    async def order() -> None:
        await m.tick(10, force=True)
        await m._orders.settle(10)

    async def body() -> None:
        await order()
        world.bucket.down = False
        world.clock.now += 2.0  # the first wait is at most 2 s
        await order()

    asyncio.run(body())
    assert m.uploaded == 10


def test_a_successful_upload_resets_the_retry_wait(world: World) -> None:
    world.commit(10)
    world.commit(20)
    world.bucket.down = True
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10, every=1))

    async def order() -> None:
        await m.tick(10, force=True)
        task = m._orders._task
        if task is not None:
            await asyncio.wait([task])

    async def body() -> None:
        for _ in range(6):  # the wait grows well past its first 2 s
            world.clock.now += UPLOAD_RETRY_MAX
            await order()
        world.bucket.down = False
        world.clock.now += UPLOAD_RETRY_MAX
        await order()
        assert m.uploaded == 10
        world.bucket.down = True
        world.finder.answer_with(answer(10, backup=20, every=1))
        await order()
        assert m.uploaded == 10
        world.bucket.down = False
        world.clock.now += 2.0  # back to the first wait
        await order()
        assert m.uploaded == 20

    asyncio.run(body())


def test_an_order_for_a_step_retention_dropped_counts_as_done(world: World) -> None:
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10))

    async def body() -> None:
        await m.tick(10, force=True)
        await m._orders.settle(10)

    asyncio.run(body())
    assert m.uploaded == 10  # so the next order names a step this rank holds
    assert world.errors == []


def test_an_order_for_a_step_committed_already_counts_as_done(world: World) -> None:
    item = world.commit(10)
    manifest = world.store.get(item)
    assert manifest is not None
    world.backups.upload_item(manifest, world.store.data_path(item))  # another replica's
    assert world.backups.try_commit("job", 10, ["0-0"]) is not None
    m = world.member()
    released(m, 10)
    world.finder.answer_with(answer(10, backup=10))

    async def body() -> None:
        await m.tick(10, force=True)
        await m._orders.settle(10)

    asyncio.run(body())
    assert m.uploaded == 10
    assert world.errors == []


# --- drain and stop -----------------------------------------------------------------------


def test_settling_the_upload_cancels_an_upload_of_another_step(world: World) -> None:
    m = ordered(world)

    async def body() -> None:
        world.gate = asyncio.Event()  # never set: the upload hangs
        await m.tick(10, force=True)
        await asyncio.sleep(0)  # the upload begins
        assert m.uploading == 10
        assert not await m._orders.settle(20)
        assert m.uploading is None

    asyncio.run(body())
    assert m.uploaded is None
    assert world.errors == []


def test_an_upload_cancelled_before_it_began_frees_the_next_order(world: World) -> None:
    """Cancelled before its first step (a drain's settle for another step right after the
    order), the upload's own ``finally`` never runs: the order must still end, or no backup
    is ever ordered on this rank again."""
    m = ordered(world)

    async def body() -> None:
        world.gate = asyncio.Event()
        await m.tick(10, force=True)
        assert m.uploading == 10  # ordered, not begun: no await since
        assert not await m._orders.settle(20)
        assert m.uploading is None

    asyncio.run(body())
    assert world.threads == 0  # it never began


def test_settling_the_upload_without_an_upload_says_whether_the_step_is_up(world: World) -> None:
    m = world.member()
    assert not asyncio.run(m._orders.settle(10))
    m._orders.uploaded = 10
    assert asyncio.run(m._orders.settle(10))
    assert asyncio.run(m._orders.settle(5))
    assert not asyncio.run(m._orders.settle(20))


def test_stop_cancels_the_upload_and_closes_the_link(world: World) -> None:
    m = ordered(world)

    async def body() -> None:
        world.gate = asyncio.Event()
        await m.tick(10, force=True)
        await asyncio.sleep(0)  # the upload begins
        await m.stop()
        assert m.uploading is None

    asyncio.run(body())
    assert world.finder.links[0].closed
    assert m.uploaded is None


def test_an_order_answered_to_a_report_sent_before_the_upload_ended_is_not_taken_again(
    world: World,
) -> None:
    """The coordinator's answer to a report sent while step 10 uploaded still orders 10;
    taken once the upload is done, it uploaded the step again, racing retention (a loaded
    box's cluster test saw objects of one item written twice)."""
    m = ordered(world)

    async def body() -> None:
        world.gate = asyncio.Event()
        await m.tick(10, force=True)
        assert m.uploading == 10  # held at the gate
        link = world.finder.links[-1]
        link.gate = asyncio.Event()
        late = asyncio.create_task(m.tick(10, force=True))  # reports uploaded_step None
        await asyncio.sleep(0)
        world.gate.set()
        assert await m._orders.settle(10)
        threads = world.threads
        link.gate.set()
        await late
        assert link.reports[-1]["uploaded_step"] is None
        assert m.uploading is None, "the stale order started an upload again"
        assert world.threads == threads
        await m.tick(10, force=True)  # the next report says it is done
        assert link.reports[-1]["uploaded_step"] == 10

    asyncio.run(body())


# --- the drain ----------------------------------------------------------------------------

TWO = JobConfig(job_name="job", framework=Framework.ORBAX, node_rank=1, nodes=2)
"""Two ranks that both upload and push to no one: the COMMIT needs the other's items too."""


def never() -> bool:
    return False


def test_a_drain_uploads_the_newest_step_and_commits_it(world: World) -> None:
    world.commit(10)
    m = world.member()
    released(m, 10)
    drained = asyncio.run(m.drain(10, never))
    assert (drained.plan.step, drained.plan.push, drained.plan.upload) == (10, False, True)
    assert (drained.committed, drained.upload_failed) == (True, False)
    assert world.backups.read_commit("job", 10) is not None
    assert [s for s, _ in world.metrics.backups] == [10]
    assert world.errors == []  # the workload hears of a drain from its caller, not here


def test_a_drain_with_nothing_held_does_nothing(world: World) -> None:
    m = world.member()
    released(m, None)
    drained = asyncio.run(m.drain(None, never))
    assert drained.plan.step is None
    assert (drained.committed, drained.upload_failed) == (False, False)
    assert world.threads == 0


def test_a_drain_of_a_step_the_bucket_holds_uploads_nothing(world: World) -> None:
    item = world.commit(10)
    manifest = world.store.get(item)
    assert manifest is not None
    world.backups.upload_item(manifest, world.store.data_path(item))
    assert world.backups.try_commit("job", 10, ["0-0"]) is not None
    m = world.member()
    released(m, 10)
    threads = world.threads
    drained = asyncio.run(m.drain(10, never))
    assert not drained.plan.upload
    assert (drained.committed, drained.upload_failed) == (True, False)
    assert world.threads == threads + 1  # the COMMIT read, nothing more


def test_a_drain_whose_upload_fails_says_so_and_commits_nothing(world: World) -> None:
    world.commit(10)
    world.bucket.down = True
    m = world.member()
    released(m, 10)
    drained = asyncio.run(m.drain(10, never))
    assert (drained.committed, drained.upload_failed) == (False, True)
    assert world.backups.read_commit("job", 10) is None


def test_a_drain_cancelled_past_its_deadline_is_an_upload_failed(world: World) -> None:
    world.commit(10)
    m = world.member()
    released(m, 10)
    drained = asyncio.run(m.drain(10, lambda: True))
    assert (drained.committed, drained.upload_failed) == (False, True)


def test_a_drain_of_one_uploader_of_two_uploads_and_leaves_the_commit_to_the_last(
    world: World,
) -> None:
    world.commit(10, TWO)
    m = world.member(TWO)
    released(m, 10)
    drained = asyncio.run(m.drain(10, never))
    assert drained.plan.upload
    assert (drained.committed, drained.upload_failed) == (False, False)
    assert world.backups.read_commit("job", 10) is None


def test_a_drain_lets_the_ordered_upload_of_its_step_end_and_uploads_it_once(
    world: World,
) -> None:
    m = ordered(world)

    async def body() -> bool:
        world.gate = asyncio.Event()
        await m.tick(10, force=True)
        await asyncio.sleep(0)  # the ordered upload begins, held at the gate
        assert m.uploading == 10
        drain = asyncio.create_task(m.drain(10, never))
        await asyncio.sleep(0)
        world.gate.set()
        drained = await drain
        return drained.committed

    assert asyncio.run(body())
    assert len(world.bucket.puts) == 1  # the ordered upload's one file, not the drain's too
    assert m.uploaded == 10
