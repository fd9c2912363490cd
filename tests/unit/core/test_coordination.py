"""The coordinator's state machine: rounds, incarnations, plans, readiness, backup orders."""

from __future__ import annotations

import itertools

import pytest

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.coordination import (
    JobCoordinator,
    Join,
    JoinRejected,
    Phase,
    ReportRefused,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import LastBackup, Source
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import NodeInventory, SourceKey

JOB = "job"
VIEW = '{"nodes": 4}'


def config(nodes: int = 4, dp: int | None = None, **kw: object) -> JobConfig:
    return JobConfig(
        job_name=JOB,
        framework=Framework.ORBAX,
        node_rank=0,
        nodes=nodes,
        peers_per_node=1,
        data_parallelism=dp,
        backup_interval=kw.get("interval", BackupInterval(minutes=None, steps=10)),  # type: ignore[arg-type]
    )


def digest(rank: int, step: int) -> str:
    return f"{rank:02x}{step:02x}".ljust(64, "0")


def own(rank: int, *steps: int) -> dict[ItemId, str]:
    return {ItemId(JOB, s, rank, 0): digest(rank, s) for s in steps}


def join(rank: int, inc: str, items: dict[ItemId, str] | None = None, view: str = VIEW) -> Join:
    inventory = NodeInventory(rank, f"127.0.0.1:{7000 + rank}", items or {})
    return Join(rank, inc, view, inventory)


def everyone_joins(c: JobCoordinator, inc: str, steps: tuple[int, ...] = (5,)) -> None:
    for r in range(c.config.nodes):
        c.join(join(r, f"{inc}{r}", own(r, *steps)), {})


def release(c: JobCoordinator, inc: str) -> None:
    for r in range(c.config.nodes):
        s = c.status(r, f"{inc}{r}")
        c.report_restore(r, f"{inc}{r}", s.round, s.plan_version, ready=True)
    assert c.phase is Phase.RELEASED


def test_waiting_names_the_missing_ranks_then_plans_when_all_joined() -> None:
    c = JobCoordinator(config(), VIEW)
    c.join(join(0, "a0", own(0, 5)), {})
    c.join(join(2, "a2", own(2, 5)), {})
    s = c.status(0, "a0")
    assert s.phase is Phase.WAITING
    assert s.missing == (1, 3)
    assert "1" in s.message
    assert "3" in s.message
    c.join(join(1, "a1", own(1, 5)), {})
    c.join(join(3, "a3", own(3, 5)), {})
    s = c.status(2, "a2")
    assert s.phase is Phase.FETCH
    assert s.step == 5
    (fetches,) = s.assignments.values()
    assert fetches[0].source is Source.LOCAL


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_every_join_order_converges_on_one_round_and_step(order: tuple[int, ...]) -> None:
    # Rank 0 first, rank 0 last, and every interleaving in between.
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "old", (5,))
    release(c, "old")
    for r in order:
        c.join(join(r, f"new{r}", own(r, 5, 10)), {})
    statuses = [c.status(r, f"new{r}") for r in range(4)]
    assert {s.round for s in statuses} == {2}
    assert {s.step for s in statuses} == {10}
    assert {s.phase for s in statuses} == {Phase.FETCH}


def test_rejoining_with_the_same_incarnation_is_not_news() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    version = c.plan_version
    assert c.join(join(1, "a1", own(1, 5)), {}) == 1
    assert c.plan_version == version
    assert c.phase is Phase.FETCH


def test_a_stale_agent_never_joins_the_next_round() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "old")
    release(c, "old")
    c.join(join(0, "new0", own(0, 5)), {})  # the job restarts: a new round opens
    assert c.round == 2
    c.join(join(1, "old1", own(1, 5)), {})  # rank 1's agent of the old run reconnects
    assert 1 not in c.members
    assert c.status(1, "old1").phase is None  # told to join again, with a new incarnation
    for r in (1, 2, 3):
        c.join(join(r, f"new{r}", own(r, 5)), {})
    assert c.phase is Phase.FETCH
    assert all(c.members[r].incarnation_id == f"new{r}" for r in range(4))


def test_a_new_incarnation_during_a_round_restarts_planning_and_voids_old_reports() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    old_round, old_version = c.round, c.plan_version
    c.report_restore(0, "a0", old_round, old_version, ready=True)
    c.join(join(2, "b2", own(2, 5)), {})  # rank 2's workload restarted again
    assert c.round == old_round + 1
    assert c.phase is Phase.FETCH  # the other three are still members: planned at once
    assert c.plan_version > old_version
    assert c.ready == set()
    c.report_restore(1, "a1", old_round, old_version, ready=True)  # a report of the old round
    assert c.ready == set()
    assert c.status(2, "a2").phase is None


def test_disagreeing_configs_are_rejected_with_a_clear_reason() -> None:
    c = JobCoordinator(config(), VIEW)
    with pytest.raises(JoinRejected, match="disagrees with rank 0"):
        c.join(join(1, "x", view='{"nodes": 8}'), {})
    with pytest.raises(JoinRejected, match="out of range"):
        c.join(join(9, "x"), {})


def test_released_only_when_every_rank_is_ready() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    for r in range(3):
        c.report_restore(r, f"a{r}", c.round, c.plan_version, ready=True)
        assert c.phase is Phase.FETCH
    c.report_restore(3, "a3", c.round, c.plan_version, ready=True)
    assert c.phase is Phase.RELEASED
    assert c.status(3, "a3").phase is Phase.RELEASED


def test_a_failed_source_replans_to_an_older_step() -> None:
    c = JobCoordinator(config(), VIEW)
    for r in range(4):
        c.join(join(r, f"a{r}", own(r, 5, 10)), {})
    assert c.plan is not None
    assert c.plan.step == 10
    bad = SourceKey(1, ItemId(JOB, 10, 1, 0))  # rank 1's only copy of step 10 is corrupt
    c.report_restore(1, "a1", c.round, c.plan_version, ready=False, failed=[bad])
    assert c.plan is not None
    assert c.plan.step == 5
    assert c.status(0, "a0").step == 5


def test_a_fresh_start_when_nothing_is_restorable() -> None:
    c = JobCoordinator(config(), VIEW)
    for r in range(4):
        c.join(join(r, f"a{r}"), {})
    s = c.status(0, "a0")
    assert s.phase is Phase.FETCH
    assert s.step is None
    assert s.assignments == {}


def test_backup_from_a_committed_backup_when_every_node_was_wiped() -> None:
    c = JobCoordinator(config(), VIEW)
    record = CommitRecord(JOB, 7, {f"{r}-0": digest(r, 7) for r in range(4)}, 0.0)
    for r in range(4):
        c.join(join(r, f"a{r}"), {7: record})
    s = c.status(3, "a3")
    assert s.step == 7
    (fetches,) = s.assignments.values()
    assert fetches[0].source is Source.BACKUP


def test_backup_orders_follow_the_restorable_step_and_the_interval() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a", (0,))
    release(c, "a")
    c.note_committed_backup(0, at=0.0)
    answers = [c.report_progress(r, f"a{r}", Progress(10), now=1.0) for r in range(3)]
    assert all(a is not None and a.backup_step is None for a in answers)  # rank 3 lags
    last = c.report_progress(3, "a3", Progress(10), now=1.0)
    assert last is not None
    assert last.restorable_step == 10
    assert last.backup_step == 10  # 10 - 0 >= 10 steps
    # One backup in flight: it stays the order until every uploader reported it, and
    # the coordinator writes its COMMIT then, once.
    for r in range(4):
        assert c.take_commit() is None
        a = c.report_progress(r, f"a{r}", Progress(20, 10), now=2.0)
        assert a is not None
        assert a.backup_step is None  # every rank has it now
    assert c.take_commit() == 10
    assert c.take_commit() is None  # already being written
    assert c.backup_in_flight == 10  # no new order while the COMMIT is being written
    c.backup_committed(10, at=2.5)
    assert c.last_backup == LastBackup(10, 2.5)
    a = c.report_progress(0, "a0", Progress(20, 10), now=3.0)
    assert a is not None
    assert a.last_backup == LastBackup(10, 2.5)
    assert c.backup_in_flight == 20


def test_a_commit_that_cannot_be_written_orders_a_backup_again_later() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a", (0,))
    release(c, "a")
    c.note_committed_backup(0, at=0.0)
    for r in range(4):
        c.report_progress(r, f"a{r}", Progress(10, 10), now=1.0)
    assert c.take_commit() == 10
    c.backup_not_committed(10, now=1.0)
    assert c.last_backup == LastBackup(0, 0.0)  # nothing new is backed up
    a = c.report_progress(0, "a0", Progress(10, 10), now=1.0 + 29)
    assert a is not None
    assert c.backup_in_flight is None  # not before COMMIT_RETRY_SECONDS
    c.report_progress(0, "a0", Progress(10, 10), now=1.0 + 31)
    assert c.backup_in_flight == 10


def test_a_backup_of_step_0_completes_like_any_other() -> None:
    """Step 0 is falsy in Python, never in the protocol: its upload ends the order."""
    c = JobCoordinator(config(nodes=1), '{"nodes": 1}')
    c.join(join(0, "a0", view='{"nodes": 1}'), {})
    c.report_restore(0, "a0", c.round, c.plan_version, ready=True)
    first = c.report_progress(0, "a0", Progress(0), now=1.0)
    assert first is not None
    assert first.backup_step == 0  # the first restorable step goes up at once
    done = c.report_progress(0, "a0", Progress(0, 0), now=2.0)
    assert done is not None
    assert done.backup_step is None
    assert c.take_commit() == 0
    c.backup_committed(0, at=2.0)
    assert c.last_backup is not None
    assert c.last_backup.step == 0
    assert c.backup_in_flight is None


def test_promises_bound_the_restorable_step_and_it_never_goes_back() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    release(c, "a")

    def report(rank: int, replicated: int, held: set[int], pushing: int | None = None) -> None:
        c.report_progress(
            rank,
            f"a{rank}",
            Progress(replicated, held=frozenset(held), replicating_step=pushing),
            now=1.0,
        )

    for r in range(3):
        report(r, 9, {5, 8, 9})
    # Rank 3 stalled at 5 while the others went on: the restored step stays restorable.
    answer = c.report_progress(3, "a3", Progress(5), now=1.0)
    assert answer is not None
    assert answer.restorable_step == 5
    assert answer.keep_steps == {9}  # what the others replicated may be next
    # Rank 3 comes back pushing 9; the others keep it (it is asked for), and once rank 3
    # replicated it, 9 is restorable.
    report(3, 5, {5, 9}, pushing=9)
    answer = c.report_progress(0, "a0", Progress(9, held=frozenset({5, 9})), now=1.0)
    assert answer is not None
    assert answer.restorable_step == 5
    assert answer.keep_steps == {9}
    report(3, 9, {5, 9})
    assert c.restorable == 9
    # A later promise without 9 does not take it back: ranks that heard 9 keep it.
    report(1, 12, {12})
    answer = c.report_progress(2, "a2", Progress(12), now=1.0)
    assert answer is not None
    assert answer.restorable_step == 9


def test_a_step_a_rank_no_longer_holds_is_never_named_restorable() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    release(c, "a")
    for r in range(4):
        c.report_progress(
            r, f"a{r}", Progress(12, held=frozenset({5, 12} if r != 2 else {5, 13})), now=1.0
        )
    assert c.restorable == 5  # everyone replicated 12, but rank 2 dropped it


def test_only_replica_zero_uploads_with_data_parallelism() -> None:
    c = JobCoordinator(config(dp=2), VIEW)
    everyone_joins(c, "a", (0,))
    release(c, "a")
    c.note_committed_backup(0, at=0.0)
    for r in range(4):
        c.report_progress(r, f"a{r}", Progress(10), now=1.0)
    orders = {r: c.report_progress(r, f"a{r}", Progress(10), now=1.0) for r in range(4)}
    assert {r for r, a in orders.items() if a is not None and a.backup_step == 10} == {0, 1}


def test_progress_of_an_agent_outside_the_released_round_is_refused() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    assert c.report_progress(0, "a0", Progress(5), now=0) is None
    release(c, "a")
    assert c.report_progress(0, "zz", Progress(5), now=0) is None
    assert c.report_progress(0, "a0", Progress(5), now=0) is not None


def test_a_restarted_coordinator_takes_steady_ranks_back_by_their_reports() -> None:
    c = JobCoordinator(config(), VIEW)
    c.resume_steady()
    assert c.unadopted(2) == (4, [0, 1])
    first = []
    unadopted = [(3, [1, 2]), (2, [2, 3]), (1, [3]), (0, [])]
    for r in range(4):
        first.append(c.report_progress(r, f"s{r}", Progress(7 + r), now=1.0))
        assert c.unadopted(2) == unadopted[r]
    assert all(a is not None for a in first)
    # Only once every rank reported is a step restorable: the oldest of their newest.
    assert [a.restorable_step for a in first if a is not None] == [None, None, None, 7]
    # Each rank's first report fixed its incarnation: another one must join instead.
    assert c.report_progress(2, "other", Progress(9), now=1.0) is None
    # A job restart opens a round as after any release (rank 0's new incarnation opens it;
    # rank 1's waits for it); the adopted agents stay out of it.
    c.join(join(1, "new1", own(1, 7)), {})
    assert c.phase is Phase.RELEASED
    c.join(join(0, "new0", own(0, 7)), {})
    assert c.phase is Phase.WAITING
    assert c.members[1].incarnation_id == "new1"
    assert c.report_progress(1, "s1", Progress(9), now=1.0) is None
    assert c.status(1, "s1").phase is None
    assert not c.adopting


def test_progress_reports_refresh_the_peer_addresses() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a")
    release(c, "a")
    before = c.report_progress(0, "a0", Progress(5), now=1.0)
    assert before is not None
    assert before.addresses[2] == "127.0.0.1:7002"
    # Rank 2's daemon restarted on another port: its report carries the new address.
    c.report_progress(2, "a2", Progress(5, address="h:9"), now=1.0)
    after = c.report_progress(0, "a0", Progress(5), now=1.0)
    assert after is not None
    assert after.addresses == {
        0: "127.0.0.1:7000",
        1: "127.0.0.1:7001",
        2: "h:9",
        3: "127.0.0.1:7003",
    }


def test_a_coordinator_that_was_not_resumed_refuses_unknown_ranks() -> None:
    c = JobCoordinator(config(), VIEW)
    assert c.report_progress(0, "s0", Progress(5), now=1.0) is None


def test_a_restore_pin_makes_the_round_use_the_pinned_step_once() -> None:
    c = JobCoordinator(config(), VIEW)
    everyone_joins(c, "a", (5,))
    release(c, "a")
    backups = {3: CommitRecord(JOB, 3, {f"{r}-0": digest(r, 3) for r in range(4)}, 0.0)}
    for r in range(4):  # every rank holds step 5 and 3 locally; the operator pinned 3
        c.join(join(r, f"b{r}", own(r, 3, 5)), backups, pinned=3)
    s = c.status(0, "b0")
    assert s.step == 3
    (fetches,) = s.assignments.values()
    assert fetches[0].source is Source.LOCAL  # the local copy matches the committed digest
    assert c.pin_consumed is None
    release(c, "b")
    assert c.pin_consumed == 3


def test_a_pinned_step_nobody_can_serve_falls_back_to_the_newest() -> None:
    c = JobCoordinator(config(), VIEW)
    for r in range(4):  # step 3 is pinned but neither held nor in the backup listing
        c.join(join(r, f"a{r}", own(r, 5)), {}, pinned=3)
    assert c.status(0, "a0").step == 5
    release(c, "a")
    assert c.pin_consumed == 3  # used up all the same: it must not surprise a later restart


# --- hostile members and strangers (issue 16) ----------------------------------------------


def _everyone_holds(c: JobCoordinator, inc: str, step: int) -> None:
    """Every rank holds its own item of ``step`` and a copy of the next rank's."""
    n = c.config.nodes
    for r in range(n):
        items = {**own(r, step), **own((r + 1) % n, step)}
        c.join(join(r, f"{inc}{r}", items), {})


def test_a_member_may_report_failed_only_the_sources_its_plan_gave_it() -> None:
    c = JobCoordinator(config(), VIEW)
    _everyone_holds(c, "a", 10)
    assert c.plan is not None
    version = c.plan_version
    survivors = [
        SourceKey(0, ItemId(JOB, 10, 0, 0)),  # rank 0's own copy
        SourceKey(3, ItemId(JOB, 10, 0, 0)),  # a peer copy rank 0 might use
        SourceKey(None, ItemId(JOB, 10, 1, 0)),  # the backup of rank 1's item
    ]
    for key in survivors:
        with pytest.raises(ReportRefused, match="did not give it"):
            c.report_restore(2, "a2", c.round, version, ready=False, failed=[key])
    # Mixed with a source it was given: refused whole, nothing excluded.
    mine = SourceKey(2, ItemId(JOB, 10, 2, 0))
    with pytest.raises(ReportRefused):
        c.report_restore(2, "a2", c.round, version, ready=False, failed=[mine, survivors[0]])
    with pytest.raises(ReportRefused, match="names no failed source"):
        c.report_restore(2, "a2", c.round, version, ready=False)
    assert (c.plan_version, c.exclude, c.plan.step) == (version, set(), 10)
    # A source it was given is excluded for its own restore only.
    c.report_restore(2, "a2", c.round, version, ready=False, failed=[mine])
    assert c.plan is not None
    assert c.plan.step == 10
    firsts = {t.rank: f[0] for t, f in c.plan.sources.items()}
    assert (firsts[2].source, firsts[2].holder) == (Source.PEER, 1)
    assert all(firsts[r].source is Source.LOCAL for r in (0, 1, 3))


def test_an_equivalent_that_failed_for_one_rank_still_serves_its_owner() -> None:
    c = JobCoordinator(config(dp=2), VIEW)  # ranks 0 and 2 are equivalent
    record = CommitRecord(JOB, 10, {f"{r}-0": digest(r, 10) for r in range(4)}, 0.0)
    for r in range(4):
        c.join(join(r, f"a{r}", {} if r == 2 else own(r, 10)), {10: record})
    assert c.plan is not None
    (fetches,) = c.plan.for_rank(2).values()
    equivalent = fetches[0]
    assert (equivalent.source, equivalent.holder, equivalent.equivalent) == (Source.PEER, 0, True)
    c.report_restore(2, "a2", c.round, c.plan_version, ready=False, failed=[equivalent.key])
    # Rank 2's word takes nothing from rank 0, which still restores its own copy.
    assert c.plan is not None
    assert c.plan.step == 10
    assert c.plan.for_rank(0)[ItemId(JOB, 10, 0, 0)][0].source is Source.LOCAL
    assert c.plan.for_rank(2)[ItemId(JOB, 10, 2, 0)][0].source is Source.BACKUP


def test_a_stray_join_in_steady_state_leaves_the_running_job_alone() -> None:
    c = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    everyone_joins(c, "a", (5,))
    release(c, "a")
    for r in range(4):
        c.report_progress(r, f"a{r}", Progress(5), now=1.0)
    # A leftover or forged joiner of rank 2, and one posing as rank 0.
    c.join(join(2, "stray2", own(2, 5)), {})
    c.join(join(0, "stray0", own(0, 5)), {})
    assert (c.round, c.phase) == (1, Phase.RELEASED)
    assert c.status(0, "stray0").phase is None
    waiting = c.status(2, "stray2")
    assert (waiting.phase, waiting.missing) == (Phase.WAITING, (0,))
    # The released ranks go on: progress is answered and backups are ordered.
    answers = [c.report_progress(r, f"a{r}", Progress(10), now=2.0) for r in range(4)]
    assert all(a is not None for a in answers)
    assert answers[-1] is not None
    assert answers[-1].restorable_step == 10


def test_a_real_restart_opens_the_round_when_rank_0_rejoins_in_any_order() -> None:
    c = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    everyone_joins(c, "a", (5,))
    release(c, "a")
    c.rank0_incarnation = "b0"  # rank 0's daemon accepted the new replicator.yaml
    for r in (3, 1):
        c.join(join(r, f"b{r}", own(r, 5, 10)), {})
    assert c.phase is Phase.RELEASED
    c.join(join(0, "b0", own(0, 5, 10)), {})
    assert (c.round, c.phase) == (2, Phase.WAITING)
    assert c.status(3, "b3").missing == (2,)
    c.join(join(2, "b2", own(2, 5, 10)), {})
    assert (c.phase, c.status(1, "b1").step) == (Phase.FETCH, 10)


def test_a_refused_join_carries_none_of_the_jobs_settings() -> None:
    view = '{"job-name": "job", "nodes": 4, "workers-per-node": 1}'
    c = JobCoordinator(config(), view)
    theirs = '{"job-name": "job", "nodes": 5, "workers-per-node": 1}'
    with pytest.raises(JoinRejected) as refused:
        c.join(join(1, "x", view=theirs), {})
    assert "nodes" in str(refused.value)
    assert "4" not in str(refused.value)
    assert view not in str(refused.value)
    with pytest.raises(JoinRejected) as refused:
        c.join(join(7, "x", view=view), {})
    assert "4" not in str(refused.value)


def test_waiting_ranks_see_at_most_64_missing_and_an_exact_message_near_the_end() -> None:
    c = JobCoordinator(config(nodes=256), VIEW)
    c.join(join(0, "a0"), {})
    early = c.status(0, "a0")
    assert early.missing == tuple(range(1, 65))  # the rest are counted in the message
    assert "(1 of 256 joined)" in early.message
    for r in range(1, 255):
        c.join(join(r, f"a{r}"), {})
        c.status(r, f"a{r}")  # every joined rank polls
    late = c.status(0, "a0")
    assert late.missing == (255,)
    assert late.message.startswith("waiting for rank 255 of job job")


def test_a_step_restored_after_a_job_restart_is_ordered_backed_up_at_once() -> None:
    # One node, a backup every step: step 20's upload was ordered, and the job restarted
    # before it ended (the uploader is gone with its incarnation). The new incarnation
    # restores step 30 locally: its backup is due now, not after the next save.
    c = JobCoordinator(config(nodes=1, interval=BackupInterval(minutes=None, steps=1)), VIEW)
    c.join(join(0, "a0", own(0, 10, 20)), {})
    release(c, "a")
    c.backup_committed(10, 1.0)
    order = c.report_progress(0, "a0", Progress(20), now=2.0)
    assert order is not None
    assert order.backup_step == 20
    c.rank0_incarnation = "b0"
    c.join(join(0, "b0", own(0, 10, 20, 30)), {})
    release(c, "b")
    answer = c.report_progress(0, "b0", Progress(30), now=3.0)
    assert answer is not None
    assert answer.backup_step == 30


def test_a_members_own_failures_may_cost_the_step_but_the_operator_sees_who() -> None:
    c = JobCoordinator(config(), VIEW)
    _everyone_holds(c, "a", 10)
    assert c.plan is not None
    assert c.passed_over is None
    # Rank 2 reports every source the plan gave it: its own copy, then the peer copy.
    for _ in range(2):
        (fetches,) = c.plan.for_rank(2).values()
        c.report_restore(2, "a2", c.round, c.plan_version, ready=False, failed=[fetches[0].key])
        assert c.plan is not None or c.passed_over is not None
        if c.plan is None:
            break
    # Its word counts for its own restore: step 10 has no source for rank 2 any more, so
    # the job starts fresh; but the step was complete, and the coordinator says who did it.
    assert c.plan is None
    assert c.passed_over is not None
    assert (c.passed_over.step, c.passed_over.reporters) == (10, (2,))


def test_a_restart_before_rank_0s_markers_serves_the_released_round_again() -> None:
    """Rank 0's daemon killed between the release and its own markers (chaos seed 4112):
    the restarted coordinator serves the same round from the record the release left,
    rank 0's agent gets its own items of the step, and the ranks that ran on keep
    reporting; before, it opened a new round the others never joined, and rank 0 waited
    forever for them."""
    c = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    everyone_joins(c, "a", steps=(3, 5))
    release(c, "a")
    record = c.released_record()
    assert record is not None
    assert record.step == 5
    assert record.rank0 == "a0"

    again = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    again.resume_released(record)
    answer = again.report_progress(2, "a2", Progress(5), now=1.0)
    assert answer is not None
    assert answer.restorable_step == 5
    again.join(join(0, "a0", own(0, 3, 5)), {})
    status = again.status(0, "a0")
    assert status.phase is Phase.RELEASED
    assert status.step == 5
    assert [(i.step, f[0].source) for i, f in status.assignments.items()] == [(5, Source.LOCAL)]
    # A stray incarnation of another rank still waits for rank 0's next one.
    assert again.status(1, "zz").phase is None
    # Kept again, the record still names the round and its step.
    assert again.released_record() == record


def test_a_released_round_is_served_again_only_to_its_own_rank_0() -> None:
    c = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    everyone_joins(c, "a")
    release(c, "a")
    record = c.released_record()
    assert record is not None
    # The job restarted meanwhile (rank 0's new incarnation): a new round, as ever.
    newer = JobCoordinator(config(), VIEW, rank0_incarnation="b0")
    newer.resume_released(record)
    assert newer.phase is Phase.WAITING
    assert newer.resumed is None
    # Rank 0's store lost the step since: never a plan made of nothing.
    lost = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    lost.resume_released(record)
    lost.join(join(0, "a0", own(0, 4)), {})
    assert lost.resumed is None
    assert lost.status(0, "a0").phase is not Phase.RELEASED
