"""The coordinator over real gRPC: a grpc.aio server on loopback in this process, real clients.

Each test runs its own event loop (``run``); the server is the daemon's ``RpcServer`` with the
coordinator registered as the daemon registers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc
from mtc_replicator.cluster.coordinator_client import CoordinatorClient, find_coordinator
from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.link import (
    CoordinatorChanged,
    CoordinatorError,
    LocalCoordinator,
    LocalFinder,
    MustRejoin,
    NoCoordinator,
    NotAMember,
    WrongCoordinator,
)
from mtc_replicator.cluster.messages import (
    SERVICE,
    FailedFetch,
    Joined,
    RestoreReport,
    RoundState,
    cluster_view_json,
)
from mtc_replicator.cluster.registry import Registry, RegistryEntry, open_registry
from mtc_replicator.cluster.rounds import JobRank, RoundContext, RoundOutcome, RoundParticipant
from mtc_replicator.cluster.sources import ItemSources
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.coordination import JoinRejected, Phase
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.objectstore import TransientError
from mtc_replicator.transport.grpc_server import RpcServer

T = TypeVar("T")
JOB = "train"
NODES = 4


def run(coro: Awaitable[T], timeout: float = 15.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def config(nodes: int = NODES, job: str = JOB, steps: int = 10) -> JobConfig:
    return JobConfig(
        job_name=job,
        framework=Framework.ORBAX,
        node_rank=0,
        nodes=nodes,
        peers_per_node=1,
        backup_interval=BackupInterval(steps=steps),
    )


VIEW = cluster_view_json(config())


def digest(rank: int, step: int) -> str:
    return f"{rank:02x}{step:04x}".ljust(64, "0")


def own(rank: int, *steps: int) -> dict[ItemId, str]:
    return {ItemId(JOB, s, rank, 0): digest(rank, s) for s in steps}


def peer_address(rank: int) -> str:
    return f"127.0.0.1:{7100 + rank}"


BackupsFor = Callable[[str], Mapping[int, CommitRecord]]


class FetchingNothing(ItemSources):
    """The sources of a round that must fetch nothing: a fetch fails the test."""

    def __init__(self, store: LocalStore, why: str) -> None:
        super().__init__(store, 0)
        self.why = why

    async def fetch(self, f: Fetch, addresses: Mapping[int, str], *, last: bool) -> None:
        raise AssertionError(self.why)


def no_backups(job: str) -> dict[int, CommitRecord]:
    return {}


class Commits:
    """The COMMITs a coordinator wrote (``Coordinators(commit=...)``), in order."""

    def __init__(self) -> None:
        self.written: list[tuple[int, list[str]]] = []
        self.done = threading.Event()

    def __call__(self, job: str, step: int, keys: Sequence[str]) -> CommitRecord:
        self.written.append((step, list(keys)))
        self.done.set()
        return CommitRecord(job, step, dict.fromkeys(keys, "0" * 64), 1000.0 + step)


@contextlib.asynccontextmanager
async def serving(
    host: CoordinatorHost, backups_for: BackupsFor = no_backups, commits: Commits | None = None
) -> AsyncIterator[str]:
    rpc = RpcServer()
    coordinators = Coordinators(host, backups_for, commit=commits)
    rpc.add_service(SERVICE, CoordinatorServicer(coordinators).register)
    address = rpc.bind("127.0.0.1:0")
    await rpc.start()
    try:
        yield address
    finally:
        host.close()
        await rpc.stop(0.5)


@contextlib.asynccontextmanager
async def cluster(
    backups_for: BackupsFor = no_backups, commits: Commits | None = None, **kw: Any
) -> AsyncIterator[tuple[CoordinatorHost, CoordinatorClient]]:
    """A hosted coordinator of ``JOB`` and one client (ranks share it, as agents would not)."""
    host = CoordinatorHost()
    host.host(config(**kw), cluster_view_json(config(**kw)))
    async with (
        serving(host, backups_for, commits) as address,
        CoordinatorClient(JOB, address, timeout=5.0) as client,
    ):
        yield host, client


async def join(
    client: CoordinatorClient, rank: int, inc: str, items: Mapping[ItemId, str], view: str = VIEW
) -> int:
    return (await client.join(rank, inc, view, peer_address(rank), items)).round


async def status(
    client: CoordinatorClient,
    rank: int,
    inc: str,
    round_: int = 1,
    seen: RoundState | None = None,
    wait: float = 0.0,
) -> RoundState:
    return await client.round_status(rank, inc, round_, seen=seen, wait_seconds=wait)


async def all_join(client: CoordinatorClient, inc: str, *steps: int) -> None:
    for r in range(NODES):
        await join(client, r, f"{inc}{r}", own(r, *steps))


# --- restore rounds --------------------------------------------------------------------------


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (2, 0, 3, 1)])
def test_every_join_order_gives_every_rank_the_same_plan(order: tuple[int, ...]) -> None:
    async def scenario() -> list[RoundState]:
        async with cluster() as (_, client):
            for r in order:
                assert await join(client, r, f"a{r}", own(r, 5, 10)) == 1
            return [await status(client, r, f"a{r}") for r in range(NODES)]

    states = run(scenario())
    assert {s.phase for s in states} == {Phase.FETCH}
    assert {s.step for s in states} == {10}
    assert len({s.plan_version for s in states}) == 1
    for rank, s in enumerate(states):
        ((target, fetches),) = s.assignments.items()
        assert target == ItemId(JOB, 10, rank, 0)
        assert fetches[0].source is Source.LOCAL
        assert s.addresses == {r: peer_address(r) for r in range(NODES)}


def test_waiting_names_the_missing_rank() -> None:
    async def scenario() -> RoundState:
        async with cluster() as (_, client):
            for r in (0, 1, 3):
                await join(client, r, f"a{r}", own(r, 5))
            return await status(client, 3, "a3")

    state = run(scenario())
    assert state.phase is Phase.WAITING
    assert state.missing == (2,)
    assert "rank 2 of job train" in state.message
    assert "3 of 4 joined" in state.message
    assert state.assignments == {}


def test_a_long_poll_wakes_promptly_on_the_last_join() -> None:
    async def scenario() -> tuple[RoundState, float, float]:
        async with cluster() as (_, client):
            for r in (0, 1, 2):
                await join(client, r, f"a{r}", own(r, 5))
            seen = await status(client, 0, "a0")
            assert seen.phase is Phase.WAITING
            t0 = time.monotonic()
            poll = asyncio.ensure_future(status(client, 0, "a0", seen=seen, wait=20))
            await asyncio.sleep(0.3)
            assert not poll.done()  # nothing changed yet: it waits
            await join(client, 3, "a3", own(3, 5))
            joined = time.monotonic()
            state = await poll
            return state, time.monotonic() - joined, joined - t0

    state, after_join, before = run(scenario())
    assert state.phase is Phase.FETCH
    assert state.step == 5
    assert before >= 0.3
    assert after_join < 0.1, f"the poll answered {after_join:.3f}s after the last join"


def test_a_long_poll_answers_at_once_when_the_change_came_between_polls() -> None:
    async def scenario() -> tuple[RoundState, float]:
        async with cluster() as (_, client):
            await all_join(client, "a", 5)
            # The caller's last answer said WAITING; FETCH happened before this poll.
            seen = RoundState(1, Phase.WAITING)
            t0 = time.monotonic()
            state = await status(client, 2, "a2", seen=seen, wait=20)
            return state, time.monotonic() - t0

    state, took = run(scenario())
    assert state.phase is Phase.FETCH
    assert took < 1.0


def test_a_long_poll_without_change_ends_after_its_wait() -> None:
    async def scenario() -> tuple[RoundState, float]:
        async with cluster() as (_, client):
            await join(client, 0, "a0", own(0, 5))
            seen = await status(client, 0, "a0")
            await join(client, 1, "a1", own(1, 5))  # another join: not a change for rank 0
            t0 = time.monotonic()
            state = await status(client, 0, "a0", seen=seen, wait=1)
            return state, time.monotonic() - t0

    state, took = run(scenario())
    assert state.phase is Phase.WAITING
    assert state.missing == (2, 3)  # answered with what there is at the end of the wait
    assert 0.9 <= took < 2.5


def test_a_long_polled_join_answers_once_the_round_is_planned() -> None:
    """A join with a wait is the join and the polls that would follow it, in one call:
    waiting joiners get the plan as the last rank joins, the last joiner at once, and a
    joiner whose wait ends first gets WAITING with the missing ranks."""

    async def scenario() -> tuple[list[RoundState], float, RoundState, float, Joined]:
        async with cluster() as (_, client):
            early = await client.join(0, "a0", VIEW, peer_address(0), own(0, 5), wait_seconds=1)
            t0 = time.monotonic()
            waiting = [
                asyncio.ensure_future(
                    client.join(
                        r, f"a{r}", VIEW, peer_address(r), own(r, 5),
                        wait_seconds=20, address_ranks=[(r + 1) % NODES],
                    )
                )
                for r in (1, 2)
            ]  # fmt: skip
            await asyncio.sleep(0.3)
            assert not any(w.done() for w in waiting)
            last = await client.join(
                3, "a3", VIEW, peer_address(3), own(3, 5), wait_seconds=20, address_ranks=[0]
            )
            joined = time.monotonic()
            answers = [await w for w in waiting]
            after = time.monotonic() - joined
            assert last.state is not None
            assert all(a.state is not None for a in answers)
            states = [a.state for a in answers if a.state is not None]
            # Each is what a poll with the same address ranks answers.
            for rank, state in zip((1, 2), states, strict=True):
                poll = await client.round_status(rank, f"a{rank}", 1, address_ranks=[rank + 1])
                assert state == poll
            assert last.state == await client.round_status(3, "a3", 1, address_ranks=[0])
            return states, after, last.state, joined - t0, early

    states, after, last, before, early = run(scenario())
    assert early.round == 1
    assert early.state is not None
    assert early.state.phase is Phase.WAITING
    assert early.state.missing == (1, 2, 3)
    assert before >= 0.3
    assert after < 0.5, f"the waiting joins answered {after:.3f}s after the last join"
    for rank, state in zip((1, 2, 3), [*states, last], strict=True):
        assert (state.phase, state.step) == (Phase.FETCH, 5)
        assert list(state.assignments) == [ItemId(JOB, 5, rank, 0)]
        assert (rank + 1) % NODES in state.addresses
        assert len(state.addresses) < NODES  # the asked-for ones, not every member's


def test_a_rank_that_joins_before_rank_0_reopens_the_job_waits_in_one_call() -> None:
    """At a job restart most ranks may join before rank 0 does: their long-polled join
    waits through the new round's opening (still waiting for joins) until the plan."""

    async def scenario() -> tuple[Joined, float]:
        async with cluster() as (_, client):
            await all_join(client, "old", 5)
            for r in range(NODES):
                await client.report_restore(r, f"old{r}", RestoreReport(1, 1, True))
            early = asyncio.ensure_future(
                client.join(1, "new1", VIEW, peer_address(1), own(1, 5, 10), wait_seconds=20)
            )
            await asyncio.sleep(0.3)
            assert await join(client, 0, "new0", own(0, 5, 10)) == 2  # rank 0 reopens
            await asyncio.sleep(0.3)
            assert not early.done()  # round 2 opened, but it still waits for joins
            for r in (2, 3):
                await join(client, r, f"new{r}", own(r, 5, 10))
            planned = time.monotonic()
            joined = await early
            return joined, time.monotonic() - planned

    joined, after = run(scenario())
    assert joined.round == 1  # joined while round 1 stood released: it waited for rank 0
    assert joined.state is not None
    assert (joined.state.round, joined.state.phase, joined.state.step) == (2, Phase.FETCH, 10)
    assert after < 0.5


def test_a_long_polled_report_answers_with_the_release() -> None:
    """A report with a wait returns once the round moved past it: the last ready report
    at once with RELEASED, earlier reporters as the last one arrives."""

    async def scenario() -> tuple[list[RoundState | None], float, RoundState | None]:
        async with cluster() as (_, client):
            await all_join(client, "a", 5)
            plan = await status(client, 0, "a0")
            no_wait = await client.report_restore(
                0, "a0", RestoreReport(plan.round, plan.plan_version, True)
            )
            assert no_wait is None  # without a wait: the old answer, no state
            early = [
                asyncio.ensure_future(
                    client.report_restore(
                        r,
                        f"a{r}",
                        RestoreReport(plan.round, plan.plan_version, True),
                        wait_seconds=20,
                    )
                )
                for r in (1, 2)
            ]
            await asyncio.sleep(0.3)
            assert not any(e.done() for e in early)
            last = await client.report_restore(
                3, "a3", RestoreReport(plan.round, plan.plan_version, True), wait_seconds=20
            )
            reported = time.monotonic()
            answers = [await e for e in early]
            return answers, time.monotonic() - reported, last

    answers, after, last = run(scenario())
    assert after < 0.5
    for state in [*answers, last]:
        assert state is not None
        assert (state.phase, state.step) == (Phase.RELEASED, 5)


def test_a_long_polled_report_of_a_failed_source_answers_with_the_new_plan() -> None:
    async def scenario() -> tuple[RoundState, RoundState | None]:
        async with cluster() as (_, client):
            for r in range(NODES):
                # Rank 1's item is on rank 2 only (its RAM disk was wiped).
                items = {} if r == 1 else own(r, 5)
                if r == 2:
                    items[ItemId(JOB, 5, 1, 0)] = digest(1, 5)
                await join(client, r, f"a{r}", items)
            plan = await status(client, 1, "a1")
            (fetch,) = plan.assignments[ItemId(JOB, 5, 1, 0)]
            failure = FailedFetch(fetch, False, "unreachable")
            answer = await client.report_restore(
                1,
                "a1",
                RestoreReport(plan.round, plan.plan_version, False, (failure,), plan.addresses),
                wait_seconds=20,
            )
            return plan, answer

    plan, answer = run(scenario())
    assert answer is not None
    assert answer.plan_version == plan.plan_version + 1  # at once: the report re-planned
    assert answer.phase is Phase.FETCH
    assert answer.step is None  # rank 1's step 5 has no other source: a fresh start


def test_dropping_the_coordinator_ends_its_long_polls() -> None:
    async def scenario() -> float:
        async with cluster() as (host, client):
            await join(client, 0, "a0", own(0, 5))
            seen = await status(client, 0, "a0")
            poll = asyncio.ensure_future(status(client, 0, "a0", seen=seen, wait=20))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            host.drop(JOB)
            with pytest.raises(NoCoordinator, match="no coordinator for job train"):
                await poll
            return time.monotonic() - t0

    assert run(scenario()) < 1.0


def test_a_stale_incarnation_is_told_to_rejoin_after_a_new_round_opened() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            await all_join(client, "old", 5)
            for r in range(NODES):
                await client.report_restore(r, f"old{r}", RestoreReport(1, 1, True))
            assert (await status(client, 1, "old1")).phase is Phase.RELEASED
            assert await join(client, 0, "new0", own(0, 5, 10)) == 2  # the job restarted
            stale = await status(client, 1, "old1", round_=1)
            assert stale.phase is None
            assert stale.round == 2
            # The old run's agent reconnects: its join never makes it a member.
            assert await join(client, 1, "old1", own(1, 5)) == 2
            assert (await status(client, 1, "old1", round_=2)).phase is None
            for r in (1, 2, 3):
                await join(client, r, f"new{r}", own(r, 5, 10))
            fresh = await status(client, 1, "new1", round_=2)
            assert (fresh.round, fresh.phase, fresh.step) == (2, Phase.FETCH, 10)

    run(scenario())


def test_the_round_is_released_when_every_rank_reported_ready() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            await all_join(client, "a", 5)
            plan = await status(client, 0, "a0")
            for r in range(NODES - 1):
                await client.report_restore(
                    r, f"a{r}", RestoreReport(plan.round, plan.plan_version, True)
                )
            waiting = await status(client, 0, "a0", seen=plan, wait=0)
            assert waiting.phase is Phase.FETCH  # rank 3 is not ready yet
            poll = asyncio.ensure_future(status(client, 0, "a0", seen=plan, wait=20))
            await asyncio.sleep(0.2)
            assert not poll.done()
            await client.report_restore(3, "a3", RestoreReport(plan.round, plan.plan_version, True))
            released = await poll
            assert (released.phase, released.step) == (Phase.RELEASED, 5)
            assert released.plan_version == plan.plan_version

    run(scenario())


def test_a_failed_source_replans_to_an_older_step() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            # Rank 2 lost step 10; only rank 3 holds a copy of it.
            for r in range(NODES):
                items = own(r, 5) if r == 2 else own(r, 5, 10)
                if r == 3:
                    items[ItemId(JOB, 10, 2, 0)] = digest(2, 10)
                await join(client, r, f"a{r}", items)
            plan = await status(client, 2, "a2")
            assert plan.step == 10
            (fetches,) = plan.assignments.values()
            (peer,) = fetches
            assert (peer.source, peer.holder) == (Source.PEER, 3)
            assert plan.addresses[3] == peer_address(3)
            failure = FailedFetch(peer, corrupt=True, detail="crc mismatch in file 0")
            await client.report_restore(
                2,
                "a2",
                RestoreReport(plan.round, plan.plan_version, False, (failure,), plan.addresses),
            )
            others = [await status(client, r, f"a{r}", seen=plan, wait=5) for r in range(NODES)]
            assert {s.plan_version for s in others} == {plan.plan_version + 1}
            assert {s.step for s in others} == {5}
            assert others[2].assignments[ItemId(JOB, 5, 2, 0)][0].source is Source.LOCAL

    run(scenario())


def test_a_committed_backup_is_planned_from_the_listing() -> None:
    listed: list[str] = []

    def backups_for(job: str) -> dict[int, CommitRecord]:
        listed.append(job)
        items = {f"{r}-0": digest(r, 7) for r in range(NODES)}
        return {7: CommitRecord(job, 7, items, created=1.0)}

    async def scenario() -> RoundState:
        async with cluster(backups_for) as (_, client):
            await all_join(client, "a")  # every node wiped
            return await status(client, 1, "a1")

    state = run(scenario())
    assert state.step == 7
    (fetches,) = state.assignments.values()
    assert [f.source for f in fetches] == [Source.BACKUP]
    assert fetches[0].digest == digest(1, 7)
    assert listed == [JOB]  # one listing served the round's joins


def test_a_backup_listing_that_fails_refuses_the_join_for_now() -> None:
    def backups_for(job: str) -> dict[int, CommitRecord]:
        raise OSError("bucket unreachable")

    async def scenario() -> None:
        async with cluster(backups_for) as (host, client):
            with pytest.raises(NoCoordinator, match="bucket unreachable"):
                await join(client, 0, "a0", own(0, 5))
            hosted = host.get(JOB)
            assert hosted is not None
            assert hosted.coordinator.members == {}

    run(scenario())


# --- steady state ----------------------------------------------------------------------------


def test_progress_reports_give_the_restorable_step_and_backup_orders() -> None:
    async def scenario() -> None:
        commits = Commits()
        async with cluster(commits=commits) as (_, client):
            await all_join(client, "a", 5)
            for r in range(NODES):
                await client.report_restore(r, f"a{r}", RestoreReport(1, 1, True))
            first = await client.report_progress(0, "a0", Progress(10))
            # Step 5 is complete everywhere and nothing is backed up yet: back it up now.
            assert (first.restorable_step, first.backup_step) == (5, 5)
            for r in range(1, NODES):
                answer = await client.report_progress(r, f"a{r}", Progress(10))
                assert answer.backup_step == 5  # the one backup in flight
            assert answer.restorable_step == 10
            for r in range(NODES):
                assert not commits.written  # not before every uploader is done
                done = await client.report_progress(r, f"a{r}", Progress(10, 5))
            assert done.backup_step is None  # 10 is not 10 steps after 5
            # The coordinator writes the COMMIT once, naming every uploader's item, and
            # tells the ranks in its answers.
            assert await asyncio.to_thread(commits.done.wait, 10)
            assert commits.written == [(5, [f"{r}-0" for r in range(NODES)])]
            again = await client.report_progress(1, "a1", Progress(10))
            assert again.last_backup is not None
            assert again.last_backup.step == 5
            for r in range(NODES):
                later = await client.report_progress(r, f"a{r}", Progress(15))
            assert (later.restorable_step, later.backup_step) == (15, 15)
            with pytest.raises(NotAMember, match="join again"):
                await client.report_progress(2, "stranger", Progress(15))

    run(scenario())


def test_progress_before_the_release_is_refused() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            await all_join(client, "a", 5)
            with pytest.raises(NotAMember, match="not a member of the released round"):
                await client.report_progress(0, "a0", Progress(5))

    run(scenario())


# --- errors and identities -------------------------------------------------------------------


def test_an_unhosted_job_is_not_found() -> None:
    async def scenario() -> None:
        host = CoordinatorHost()
        host.host(config(job="other"), cluster_view_json(config(job="other")))
        async with serving(host) as address, CoordinatorClient(JOB, address) as client:
            with pytest.raises(NoCoordinator, match=r"NOT_FOUND.*no coordinator for job train"):
                await join(client, 0, "a0", own(0, 5))

    run(scenario())


def test_a_disagreeing_cluster_view_is_rejected_with_the_reason() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            view = cluster_view_json(config(nodes=8))
            with pytest.raises(JoinRejected, match="disagrees with rank 0") as refused:
                await join(client, 1, "a1", own(1, 5), view=view)
            # The key's name, never rank 0's settings: whoever asked may be no rank of it.
            assert "nodes" in str(refused.value)
            assert VIEW not in str(refused.value)
            assert f"{NODES}" not in str(refused.value).replace("rank 0", "")
            with pytest.raises(CoordinatorError) as refused:
                await join(client, 9, "a9", {})
            assert str(refused.value).endswith("rank 9 is out of range for job train")

    run(scenario())


def test_a_forged_owner_that_contradicts_the_backup_serves_no_one() -> None:
    # Rank 2's node is gone; a joiner posing as rank 2 claims its step 7 with bytes of its
    # own choosing. The committed backup says otherwise, so nobody is sent to its copy.
    def backups_for(job: str) -> dict[int, CommitRecord]:
        items = {f"{r}-0": digest(r, 7) for r in range(NODES)}
        return {7: CommitRecord(job, 7, items, created=1.0)}

    forged = "f" * 64

    async def scenario() -> dict[int, RoundState]:
        async with cluster(backups_for) as (_, client):
            for r in range(NODES):
                items = {ItemId(JOB, 7, 2, 0): forged} if r == 2 else own(r, 7)
                await join(client, r, f"a{r}", items)
            return {r: await status(client, r, f"a{r}") for r in range(NODES)}

    states = run(scenario())
    assert {s.step for s in states.values()} == {7}
    for state in states.values():
        for fetches in state.assignments.values():
            assert all(f.digest != forged for f in fetches)
    (mine,) = states[2].assignments.values()
    assert [f.source for f in mine] == [Source.BACKUP]


def test_an_invalid_request_is_an_error_of_ours() -> None:
    async def scenario() -> None:
        async with cluster() as (_, client):
            with pytest.raises(CoordinatorError, match=r"INVALID_ARGUMENT.*address"):
                await client.join(0, "a0", VIEW, "not-an-address", own(0, 5))
            with pytest.raises(CoordinatorError, match=r"INVALID_ARGUMENT.*out of range"):
                await client.round_status(9, "a9", 1)

    run(scenario())


class _OtherJob(coordinator_pb2_grpc.CoordinatorServicer):
    """A server answering for another job: what a stale registry entry leads to."""

    async def Join(self, request: pb.JoinRequest, context: Any) -> pb.JoinResponse:
        return pb.JoinResponse(coordinator=pb.CoordinatorIdentity(job="other", coordinator_id="x"))


def test_an_answer_for_another_job_raises() -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(_OtherJob(), server)  # type: ignore[abstract]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with CoordinatorClient(JOB, f"127.0.0.1:{port}") as client:
                with pytest.raises(WrongCoordinator, match="job 'other' answered"):
                    await join(client, 0, "a0", own(0, 5))
                assert client.coordinator_id is None
        finally:
            await server.stop(None)

    run(scenario())


def test_a_restarted_coordinator_is_noticed_at_the_next_call() -> None:
    async def scenario() -> None:
        async with cluster() as (host, client):
            await join(client, 0, "a0", own(0, 5))
            first_id = client.coordinator_id
            assert first_id == host.coordinator_id(JOB)
            host.drop(JOB)  # its daemon restarted: a new coordinator with no joins
            host.host(config(), VIEW)
            with pytest.raises(CoordinatorChanged) as raised:
                await status(client, 0, "a0")
            assert isinstance(raised.value, MustRejoin)
            assert raised.value.old_id == first_id
            assert raised.value.new_id == host.coordinator_id(JOB) != first_id
            # The agent joins again; the client now expects the new coordinator.
            await join(client, 0, "a0", own(0, 5))
            assert (await status(client, 0, "a0")).phase is Phase.WAITING

    run(scenario())


def test_rehosting_with_the_same_view_keeps_the_coordinator() -> None:
    host = CoordinatorHost()
    first = host.host(config(), VIEW)
    first_id = host.coordinator_id(JOB)
    assert host.host(config(), VIEW) is first  # rank 0's new incarnation, same job
    assert host.coordinator_id(JOB) == first_id
    replaced = host.host(config(nodes=8), cluster_view_json(config(nodes=8)))
    assert replaced is not first
    assert host.coordinator_id(JOB) != first_id


def test_an_unreachable_coordinator_is_no_coordinator() -> None:
    async def scenario() -> None:
        host = CoordinatorHost()
        async with serving(host) as address:
            pass  # stopped: nothing listens there any more
        async with CoordinatorClient(JOB, address, timeout=2.0) as client:
            with pytest.raises(NoCoordinator, match="UNAVAILABLE"):
                await join(client, 0, "a0", own(0, 5))

    run(scenario())


# --- finding the coordinator -----------------------------------------------------------------


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self, on_sleep: Callable[[int], None] = lambda n: None) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        self.on_sleep(len(self.slept))


def test_find_coordinator_retries_until_one_registers_then_its_entry_works(
    tmp_path: Path,
) -> None:
    registry = open_registry(tmp_path.as_uri())

    async def scenario() -> tuple[RegistryEntry, FakeTime]:
        host = CoordinatorHost()
        host.host(config(), VIEW)
        async with serving(host) as address:
            coordinator_id = host.coordinator_id(JOB)
            assert coordinator_id is not None
            entry = RegistryEntry(JOB, address, coordinator_id, time.time())

            def register_late(sleeps: int) -> None:
                if sleeps == 6:
                    registry.register(entry)

            fake = FakeTime(register_late)
            found = await find_coordinator(
                registry, JOB, timeout=60, clock=fake.clock, sleep=fake.sleep
            )
            async with CoordinatorClient.for_entry(found) as client:
                assert await join(client, 0, "a0", own(0, 5)) == 1
                assert client.coordinator_id == found.coordinator_id
            return found, fake

    found, fake = run(scenario())
    assert found.job == JOB
    assert len(fake.slept) == 6
    # Jittered doubling from 0.1 s, capped at 3 s: each delay in [half, whole] of its slot.
    for delay, slot in zip(fake.slept, [0.1, 0.2, 0.4, 0.8, 1.6, 3.0], strict=True):
        assert slot / 2 <= delay <= slot


def test_find_coordinator_gives_up_at_its_deadline(tmp_path: Path) -> None:
    registry = open_registry(tmp_path.as_uri())
    fake = FakeTime()
    with pytest.raises(NoCoordinator, match="no coordinator for job train yet"):
        run(find_coordinator(registry, JOB, timeout=20, clock=fake.clock, sleep=fake.sleep))
    assert fake.now == pytest.approx(20)
    assert max(fake.slept) <= 3.0
    assert len(fake.slept) >= 7


class _Unreachable:
    url = "memory://down"

    def get_bytes(self, key: str) -> bytes:
        raise TransientError(f"{key}: connection reset")


def test_find_coordinator_says_when_the_registry_is_unreachable() -> None:
    registry = Registry(_Unreachable())  # type: ignore[arg-type]
    fake = FakeTime()
    with pytest.raises(NoCoordinator, match=r"memory://down is unreachable.*connection reset"):
        run(find_coordinator(registry, JOB, timeout=5, clock=fake.clock, sleep=fake.sleep))


# --- the in-process link (a one-node job's) answers as the wire does ---------------------------


def test_the_in_process_link_answers_as_the_wire_does() -> None:
    """The same coordinator, called over gRPC and in process: equal answers, equal errors."""

    async def scenario() -> None:
        host = CoordinatorHost()
        host.host(config(), VIEW)
        servicer = CoordinatorServicer(Coordinators(host, no_backups))
        local = LocalCoordinator(servicer.coordinators, JOB)
        rpc = RpcServer()
        rpc.add_service(SERVICE, servicer.register)
        address = rpc.bind("127.0.0.1:0")
        await rpc.start()
        try:
            async with CoordinatorClient(JOB, address, timeout=5.0) as wire:
                links = {0: wire, 1: local, 2: wire, 3: local}
                for r, link in links.items():
                    # The last joiner long-polls (in process): it is answered the plan.
                    joined = await link.join(
                        r, f"a{r}", VIEW, peer_address(r), own(r, 10), wait_seconds=5 * (r == 3)
                    )
                assert joined.state == await status(wire, 3, "a3")
                for r in range(NODES):
                    over_wire = await status(wire, r, f"a{r}")
                    in_process = await local.round_status(r, f"a{r}", 1)
                    assert over_wire == in_process
                    assert over_wire.phase is Phase.FETCH
                    assert over_wire.addresses == {p: peer_address(p) for p in range(NODES)}
                    state = over_wire
                    # The last two reports long-poll, one over each link: rank 2's wait
                    # ends before the release, rank 3's report is the release.
                    answer = await links[r].report_restore(
                        r,
                        f"a{r}",
                        RestoreReport(state.round, state.plan_version, True),
                        wait_seconds=r // 2,
                    )
                    if r == 2:
                        assert answer == over_wire
                released = await local.round_status(0, "a0", 1)
                assert released == await status(wire, 0, "a0")
                assert answer == await status(wire, 3, "a3")
                assert released.phase is Phase.RELEASED
                assert released.step == 10
                # Not a member: both say "join again", neither answers for another rank.
                assert (await local.round_status(1, "stale", 1)).phase is None
                assert (await status(wire, 1, "stale")).phase is None
                for link in (wire, local):
                    with pytest.raises(NotAMember):
                        await link.report_progress(1, "stale", Progress(10))
                answers = [
                    await link.report_progress(r, f"a{r}", Progress(10, held=frozenset({10})))
                    for r, link in links.items()
                ]
                assert answers[-1] == await wire.report_progress(
                    3, "a3", Progress(10, held=frozenset({10}))
                )
                assert answers[-1].restorable_step == 10
                # The coordinator goes: both links say there is none, so agents look again.
                host.drop(JOB)
                for link in (wire, local):
                    with pytest.raises(NoCoordinator):
                        await link.round_status(0, "a0", 1)
                with pytest.raises(NoCoordinator):
                    await LocalFinder(servicer.coordinators).find(JOB, timeout=0)
        finally:
            host.close()
            await rpc.stop(0.5)

    run(scenario())


def test_a_one_node_jobs_coordinator_is_not_served_over_the_network() -> None:
    """A one-node job's coordinator answers its own daemon in process only: over gRPC it
    is not there, so nobody on the network can join its rounds or report for it."""
    one = config(nodes=1)

    async def scenario() -> None:
        host = CoordinatorHost()
        host.host(one, cluster_view_json(one))
        async with serving(host) as address, CoordinatorClient(JOB, address) as client:
            with pytest.raises(NoCoordinator, match="hosts no coordinator"):
                await client.join(0, "intruder", cluster_view_json(one), peer_address(0), {})
            with pytest.raises(NoCoordinator):
                await client.round_status(0, "intruder", 1)
            with pytest.raises(NoCoordinator):
                await client.report_progress(0, "intruder", Progress(1))
            hosted = host.get(JOB)
            assert hosted is not None
            assert hosted.coordinator.members == {}

    run(scenario())


# --- cost at scale ---------------------------------------------------------------------------


def test_answers_carry_only_the_addresses_a_rank_asked_for_and_its_holders() -> None:
    """At thousands of ranks, every member's address in every answer is N^2 per round."""

    async def scenario() -> None:
        async with cluster() as (_, client):
            for r in range(NODES):
                # Rank 1 lost its disk: its item comes from rank 2's copy.
                items = own(r, 5) | ({ItemId(JOB, 5, 1, 0): digest(1, 5)} if r == 2 else {})
                await join(client, r, f"a{r}", {} if r == 1 else items)
            state = await client.round_status(1, "a1", 1, address_ranks=[3])
            assert state.phase is Phase.FETCH
            assert state.addresses == {3: peer_address(3), 2: peer_address(2)}
            everyone = await client.round_status(0, "a0", 1)
            assert everyone.addresses == {r: peer_address(r) for r in range(NODES)}
            for r in range(NODES):
                await client.report_restore(r, f"a{r}", RestoreReport(1, 1, True))
            answer = await client.report_progress(
                1, "a1", Progress(5, address_ranks=frozenset({0}))
            )
            assert answer.addresses == {0: peer_address(0)}
            assert answer.report_every == 1  # a job of 4 ranks reports every second

    run(scenario())


def test_asking_for_too_many_addresses_is_refused() -> None:
    """On every call that carries addresses, and before the call changes anything: the
    refused join is no member, the refused report is not counted."""

    async def scenario() -> None:
        async with cluster() as (host, client):
            too_many = range(1025)
            with pytest.raises(CoordinatorError, match="address_ranks: 1025 entries"):
                await client.join(
                    0, "a0", VIEW, peer_address(0), own(0, 5), wait_seconds=1,
                    address_ranks=too_many,
                )  # fmt: skip
            hosted = host.get(JOB)
            assert hosted is not None
            assert 0 not in hosted.coordinator.members
            await all_join(client, "a", 5)
            with pytest.raises(CoordinatorError, match="address_ranks: 1025 entries"):
                await client.round_status(0, "a0", 1, address_ranks=too_many)
            plan = await status(client, 0, "a0")
            with pytest.raises(CoordinatorError, match="address_ranks: 1025 entries"):
                await client.report_restore(
                    0,
                    "a0",
                    RestoreReport(plan.round, plan.plan_version, True),
                    wait_seconds=1,
                    address_ranks=too_many,
                )
            assert 0 not in hosted.coordinator.ready

    run(scenario())


# --- real round participants: calls per round, and an older coordinator ----------------------


class CountingServicer(CoordinatorServicer):
    """The real servicer, counting calls by method; ``old`` answers as a coordinator that
    predates the long-polled Join and ReportRestore (no ``status`` in their answers)."""

    def __init__(self, coordinators: Coordinators, *, old: bool) -> None:
        super().__init__(coordinators)
        self.old = old
        self.calls: dict[str, int] = {}

    def _count(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1

    async def Join(self, request: Any, context: Any) -> pb.JoinResponse:
        self._count("Join")
        if self.old:
            request.wait_seconds = 0
        return await super().Join(request, context)

    async def RoundStatus(self, request: Any, context: Any) -> pb.RoundStatusResponse:
        self._count("RoundStatus")
        return await super().RoundStatus(request, context)

    async def ReportRestore(self, request: Any, context: Any) -> pb.ReportRestoreResponse:
        self._count("ReportRestore")
        if self.old:
            request.wait_seconds = 0
        return await super().ReportRestore(request, context)


class _AtAddress:
    """A finder of the coordinator at one address (what the registry would say)."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def find(self, job: str, *, timeout: float) -> CoordinatorClient:
        return CoordinatorClient(job, self.address, timeout=5.0)

    def open(self, job: str, address: str) -> CoordinatorClient:
        return CoordinatorClient(job, address, timeout=5.0)


@pytest.mark.parametrize("old", [False, True], ids=["long-polls", "older-coordinator"])
def test_real_participants_restore_in_two_calls_each(tmp_path: Path, old: bool) -> None:
    """Four real round participants (a fresh job: nothing to fetch) against the coordinator
    over gRPC. Each joins and reports with a long poll, so a round costs two calls per rank
    and no RoundStatus; against a coordinator that predates the long polls the same
    participants fall back to polling and still restore."""
    servicers: list[CountingServicer] = []

    async def participant(rank: int, address: str) -> RoundOutcome:
        ckpt = tmp_path / f"n{rank}" / "checkpoint"
        ckpt.mkdir(parents=True)
        store = LocalStore(ckpt)
        store.open()

        ctx = RoundContext(
            JobRank(
                config=dataclasses.replace(config(), node_rank=rank),
                incarnation_id=f"a{rank}",
                store=store,
                finder=_AtAddress(address),
                advertise=peer_address(rank),
            ),
            FetchingNothing(store, "a fresh start fetches nothing"),
            error=lambda message, step: None,
        )
        try:
            return await RoundParticipant(ctx).run()
        finally:
            store.close()

    async def scenario() -> list[RoundOutcome]:
        host = CoordinatorHost()
        host.host(config(), VIEW)
        servicer = CountingServicer(Coordinators(host, no_backups), old=old)
        servicers.append(servicer)
        rpc = RpcServer()
        rpc.add_service(SERVICE, servicer.register)
        address = rpc.bind("127.0.0.1:0")
        await rpc.start()
        try:
            return await asyncio.gather(*(participant(r, address) for r in range(NODES)))
        finally:
            host.close()
            await rpc.stop(0.5)

    outcomes = run(scenario(), timeout=30)
    assert [o.step for o in outcomes] == [None] * NODES  # released: a fresh start
    calls = servicers[0].calls
    if old:
        assert calls["RoundStatus"] >= 2 * NODES  # polled for the plan and the release
    else:
        assert calls == {"Join": NODES, "ReportRestore": NODES}


def test_a_restarted_coordinator_names_the_ranks_it_has_not_heard_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Restarted in steady state, the coordinator needs every rank's report before a step
    is restorable; once a minute it names the ranks still silent, and stops once all
    reported."""
    now = [1000.0]
    host = CoordinatorHost()
    host.host(config(), VIEW, resume_steady=True)
    coordinators = Coordinators(host, no_backups, clock=lambda: now[0])

    async def report(rank: int) -> int | None:
        _, answer = await coordinators.report_progress(
            JOB, rank, f"s{rank}", Progress(replicated_step=5, held=frozenset({5}))
        )
        return answer.restorable_step

    async def scenario() -> list[int | None]:
        answers = [await report(r) for r in (0, 1)]
        now[0] += 59
        answers.append(await report(0))  # within the minute: nothing said yet
        said_early = [r.getMessage() for r in caplog.records if "not reported" in r.message]
        assert said_early == []
        now[0] += 2
        answers.append(await report(1))
        now[0] += 30
        answers += [await report(r) for r in (2, 3)]
        now[0] += 61
        answers.append(await report(0))
        return answers

    with caplog.at_level(logging.WARNING, logger="mtc_replicator.cluster.coordinators"):
        answers = run(scenario())
    said = [r.getMessage() for r in caplog.records if "not reported" in r.getMessage()]
    assert said == [
        "restarted coordinator: 2 of 4 ranks have not reported since (ranks 2, 3); no step "
        "is restorable and no backup is ordered until every rank has"
    ]
    assert answers[:4] == [None] * 4
    assert answers[-1] == 5  # every rank reported: step 5 is restorable


def test_a_join_never_admitted_backs_off_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank 0 agent that its own daemon does not run (its coordinator names another
    incarnation) is refused at every join: it retries with growing waits, not in a loop
    (the wedge of issue 23 sent 265,752 joins in 8 minutes), and says why."""
    servicers: list[CountingServicer] = []
    said: list[str] = []

    async def scenario() -> None:
        host = CoordinatorHost()
        host.host(config(), VIEW, rank0_incarnation="the-running-one")
        servicer = CountingServicer(Coordinators(host, no_backups), old=False)
        servicers.append(servicer)
        rpc = RpcServer()
        rpc.add_service(SERVICE, servicer.register)
        address = rpc.bind("127.0.0.1:0")
        await rpc.start()
        ckpt = tmp_path / "checkpoint"
        ckpt.mkdir()
        store = LocalStore(ckpt)
        store.open()

        ctx = RoundContext(
            JobRank(
                config=config(),
                incarnation_id="stale",
                store=store,
                finder=_AtAddress(address),
                advertise=peer_address(0),
                report_after=1.0,
            ),
            FetchingNothing(store, "never planned"),
            error=lambda message, step: said.append(message),
        )
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(4.0):
                    await RoundParticipant(ctx).run()
        finally:
            store.close()
            host.close()
            await rpc.stop(0.5)

    with caplog.at_level(logging.WARNING, logger="mtc_replicator.cluster.rounds"):
        run(scenario(), timeout=30)
    joins = servicers[0].calls["Join"]
    # Waits of 0.05-0.1, 0.1-0.2, 0.2-0.4, ... capped at 3 s: at most 7 joins in 4 s.
    assert 2 <= joins <= 8, joins
    assert any("another incarnation" in r.getMessage() for r in caplog.records)
    assert any("does not admit" in m and "another incarnation" in m for m in said)
