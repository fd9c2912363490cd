"""Tests for ``mtc_replicator.core.policy``: pure decisions, so no files, sockets or clocks."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig, save_file_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import (
    Entry,
    Handoff,
    LastBackup,
    backup_due,
    complete_steps,
    find_handoffs,
    marker_item,
    newest_kept,
    retention,
    retention_of_copies,
    worker_slots,
)

DIGEST = "0" * 64
ORBAX = JobConfig("job", Framework.ORBAX, node_rank=1, nodes=4)
ORBAX_4_WORKERS = JobConfig("job", Framework.ORBAX, node_rank=1, nodes=4, workers_per_node=4)
SAVE = JobConfig("job", Framework.PYTORCH, node_rank=1, nodes=4, workers_per_node=2)


def item(step: int, rank: int = 1, worker: int = 0, job: str = "job") -> ItemId:
    return ItemId(job, step, rank, worker)


def commit(step: int, *keys: str, job: str = "job") -> CommitRecord:
    return CommitRecord(job, step, dict.fromkeys(keys, DIGEST), created=0.0)


# --- slots ---------------------------------------------------------------------------------------


def test_worker_slots_and_marker_items() -> None:
    assert list(worker_slots(ORBAX_4_WORKERS)) == [0]  # one <N>/ per node, shared
    assert list(worker_slots(SAVE)) == [0, 1]  # one .save file per worker
    assert [marker_item(ORBAX_4_WORKERS, 5, w) for w in range(4)] == [item(5)] * 4
    assert [marker_item(SAVE, 5, w) for w in range(2)] == [item(5, worker=0), item(5, worker=1)]


def test_complete_steps() -> None:
    have = [item(1, worker=0), item(1, worker=1), item(2, worker=0), item(3, worker=1)]
    assert complete_steps(SAVE, have) == [1]
    assert complete_steps(SAVE, [*have, item(3, worker=0)]) == [1, 3]
    assert complete_steps(SAVE, [item(4, rank=0), item(4, rank=0, worker=1)]) == []
    assert complete_steps(SAVE, [item(4, rank=0), item(4, rank=0, worker=1)], rank=0) == [4]


# --- retention -----------------------------------------------------------------------------------


def test_retention_keeps_the_newest_complete_step_and_newer_ones() -> None:
    have = [item(s) for s in (1, 2, 3, 4)]
    assert retention(ORBAX, have, protected=()) == [item(1), item(2), item(3)]
    # Step 5 is still arriving (one worker of two): 4 is the newest complete one.
    have_save = [item(s, worker=w) for s in (3, 4) for w in (0, 1)] + [item(5, worker=1)]
    assert retention(SAVE, have_save, protected=()) == [item(3, worker=0), item(3, worker=1)]


def test_retention_keeps_protected_steps() -> None:
    have = [item(s) for s in (1, 2, 3, 4)]
    assert retention(ORBAX, have, protected={2}) == [item(1), item(3)]
    assert retention(ORBAX, have, protected={1, 2, 3}) == []


def test_retention_with_no_complete_step_deletes_nothing() -> None:
    have = [item(1, worker=0), item(2, worker=1), item(3, worker=0)]
    assert retention(SAVE, have, protected=()) == []
    assert retention(ORBAX, [], protected=()) == []


def test_retention_ignores_other_ranks_and_jobs() -> None:
    have = [item(1), item(2), item(1, rank=0), item(1, rank=2), item(1, job="old")]
    assert retention(ORBAX, have, protected=()) == [item(1)]
    # Another rank's newer steps (peer copies) do not make this rank's step deletable.
    assert retention(ORBAX, [item(1), item(9, rank=0)], protected=()) == []


ALL_CONFIGS = [ORBAX, ORBAX_4_WORKERS, SAVE, JobConfig("job", Framework.PYTORCH, 1, 4)]


@settings(max_examples=300, deadline=None)
@given(
    config=st.sampled_from(ALL_CONFIGS),
    have=st.sets(
        st.builds(
            ItemId,
            job=st.sampled_from(["job", "other"]),
            step=st.integers(0, 12),
            rank=st.integers(0, 2),
            worker=st.integers(0, 2),
        ),
        max_size=40,
    ),
    protected=st.sets(st.integers(0, 12), max_size=5),
)
def test_retention_property(config: JobConfig, have: set[ItemId], protected: set[int]) -> None:
    deleted = retention(config, have, protected)
    mine = {i for i in have if i.job == config.job_name and i.rank == config.node_rank}
    assert set(deleted) <= mine
    assert len(deleted) == len(set(deleted))
    slots = list(worker_slots(config))
    complete = [s for s in {i.step for i in mine} if all(item(s, worker=w) in mine for w in slots)]
    if not complete:
        assert deleted == []
        return
    newest = max(complete)
    for d in deleted:
        assert d.step < newest
        assert d.step not in protected
    # ...and it does delete everything else, so the store stays bounded.
    assert set(deleted) == {i for i in mine if i.step < newest and i.step not in protected}


# --- backups -------------------------------------------------------------------------------------


def test_backup_due_every_n_steps() -> None:
    every_100 = BackupInterval(steps=100)
    assert backup_due(every_100, 5, None, now=0.0)  # the first backup goes at once
    last = LastBackup(step=200, at=0.0)
    assert not backup_due(every_100, 250, last, now=1e9)
    assert not backup_due(every_100, 299, last, now=1e9)
    assert backup_due(every_100, 300, last, now=0.0)
    assert backup_due(every_100, 1000, last, now=0.0)
    assert not backup_due(every_100, 200, last, now=1e9)
    assert not backup_due(every_100, 100, last, now=1e9)


def test_backup_due_every_n_minutes() -> None:
    every_30m = BackupInterval(minutes=30)
    assert backup_due(every_30m, 0, None, now=0.0)
    last = LastBackup(step=10, at=1000.0)
    assert not backup_due(every_30m, 11, last, now=1000.0 + 30 * 60 - 1)
    assert backup_due(every_30m, 11, last, now=1000.0 + 30 * 60)
    assert not backup_due(every_30m, 10, last, now=1e9)  # never the same step again
    assert not backup_due(every_30m, 9, last, now=1e9)
    assert BackupInterval().minutes == 30
    assert backup_due(BackupInterval(), 11, last, now=1000.0 + 1800)


# --- hand-offs -----------------------------------------------------------------------------------


def d(name: str, mtime: float = 0.0) -> Entry:
    return Entry(name, is_dir=True, is_file=False, mtime=mtime)


def f(name: str, mtime: float = 0.0) -> Entry:
    return Entry(name, is_dir=False, is_file=True, mtime=mtime)


def link(name: str) -> Entry:
    return Entry(name, is_dir=False, is_file=False, mtime=0.0)


def handoffs(config: JobConfig, entries: list[Entry], closed: tuple[str, ...] = ()) -> list[int]:
    return [h.step for h in find_handoffs(config, entries, closed, now=100.0, settle_seconds=5.0)]


def test_step_dirs_are_handed_off_in_numeric_order() -> None:
    entries = [d("100"), d("9"), d("20"), d("0")]
    found = find_handoffs(ORBAX, entries, (), now=0.0, settle_seconds=5.0)
    assert found == [
        Handoff(0, {item(0): "0"}),
        Handoff(9, {item(9): "9"}),
        Handoff(20, {item(20): "20"}),
        Handoff(100, {item(100): "100"}),
    ]


def test_step_dirs_are_one_item_for_all_workers() -> None:
    found = find_handoffs(ORBAX_4_WORKERS, [d("5")], (), now=0.0, settle_seconds=5.0)
    assert found == [Handoff(5, {item(5): "5"})]


def test_only_real_step_dirs_are_handed_off() -> None:
    entries = [
        link("12"),  # a client's renamed restore marker: a symlink into our store
        f("13"),
        d("12.orbax-checkpoint-tmp-1"),
        d("14.orbax-checkpoint-tmp-1757000000"),
        d("step=3"),
        d("step=3-unfinished"),
        d(".mtc"),
        d("15.tmp"),
        d("-1"),
        d("1e3"),
        d(" 4"),
        f("replicator.yaml"),
        f("job-s1-n1-w0.save"),
        d("7"),
    ]
    assert handoffs(ORBAX, entries) == [7]
    assert handoffs(ORBAX, entries[:-1]) == []
    assert handoffs(JobConfig("job", Framework.PYTORCH_DISTRIBUTED, 1, 4), entries) == [7]


def save(step: int, worker: int, rank: int = 1, job: str = "job", mtime: float = 0.0) -> Entry:
    return f(save_file_name(job, step, rank, worker), mtime)


def test_save_files_need_every_worker() -> None:
    assert handoffs(SAVE, [save(5, 0)]) == []
    assert handoffs(SAVE, [save(5, 0), save(5, 1)]) == [5]
    found = find_handoffs(SAVE, [save(5, 1), save(5, 0)], (), now=100.0, settle_seconds=5.0)
    assert found == [
        Handoff(
            5,
            {item(5, worker=0): "job-s5-n1-w0.save", item(5, worker=1): "job-s5-n1-w1.save"},
        )
    ]


def test_save_files_must_be_closed_or_settled() -> None:
    fresh = [save(5, 0, mtime=99.0), save(5, 1, mtime=99.0)]
    assert handoffs(SAVE, fresh) == []  # still being written, as far as we know
    assert handoffs(SAVE, fresh, closed=("job-s5-n1-w0.save",)) == []
    assert handoffs(SAVE, fresh, closed=("job-s5-n1-w0.save", "job-s5-n1-w1.save")) == [5]
    # Close events can be lost: unchanged for settle_seconds counts as finished.
    assert handoffs(SAVE, [save(5, 0, mtime=95.0), save(5, 1, mtime=94.0)]) == [5]
    assert handoffs(SAVE, [save(5, 0, mtime=95.1), save(5, 1, mtime=0.0)]) == []
    assert handoffs(SAVE, [save(5, 0, mtime=95.1), save(5, 1)], ("job-s5-n1-w0.save",)) == [5]


def test_save_files_of_others_are_ignored() -> None:
    entries = [
        save(5, 0),
        save(5, 1, job="other"),
        save(5, 1, rank=0),
        save(5, 2),  # worker out of range for workers_per_node=2
        Entry("job-s5-n1-w1.save", is_dir=True, is_file=False, mtime=0.0),
        link("job-s5-n1-w1.save"),
        f("job-s5-n1-w1.save.tmp"),
        f("job-s5-n1-w1.restore"),
    ]
    assert handoffs(SAVE, entries) == []
    assert handoffs(SAVE, [*entries, save(5, 1)]) == [5]


def test_save_steps_in_numeric_order_only_when_complete() -> None:
    entries = [save(s, w) for s in (30, 4, 100) for w in (0, 1)] + [save(7, 1)]
    assert handoffs(SAVE, entries) == [4, 30, 100]


def test_save_job_ignores_step_dirs_and_dir_job_ignores_save_files() -> None:
    assert handoffs(SAVE, [d("5")]) == []
    assert handoffs(ORBAX, [save(5, 0), save(5, 1)]) == []


def test_retention_of_copies_keeps_each_owners_newest_and_protected_steps() -> None:
    cfg = JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=4)
    have = [
        ItemId("j", s, r, 0)
        for r, steps in {0: (1, 2, 3), 1: (1, 2, 3), 2: (2, 5)}.items()
        for s in steps
    ] + [ItemId("other", 1, 1, 0)]
    doomed = retention_of_copies(cfg, have, protected={2}, pushing={1, 2})
    # Own items (rank 0) and other jobs are never copies. Against this rank's newest step
    # (3): rank 1 keeps 3 (its newest up to it) and 2 (protected); rank 2 keeps 2 (its
    # newest up to 3) and 5 (newer, still arriving here).
    assert doomed == [ItemId("j", 1, 1, 0)]
    assert retention_of_copies(cfg, have, protected=(), pushing={1, 2}) == [
        ItemId("j", 1, 1, 0),
        ItemId("j", 2, 1, 0),
    ]


def test_a_far_future_copy_never_makes_real_copies_look_old() -> None:
    """Measured against a copy's own newest step, a pushed step 10**15 would doom every
    real copy of its rank; against this rank's newest step it dooms nothing."""
    cfg = JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=4)
    have = [item(s, 0, job="j") for s in (9, 10)] + [item(s, 3, job="j") for s in (9, 10, 10**15)]
    assert retention_of_copies(cfg, have, protected=(), pushing={3}) == [item(9, 3, job="j")]


def test_before_its_first_own_step_a_node_keeps_every_copy_of_its_job() -> None:
    cfg = JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=4)
    have = [item(s, 3, job="j") for s in (1, 2, 10**15)] + [item(1, 2, job="j")]
    assert retention_of_copies(cfg, have, protected=(), pushing={3}) == []


def test_copies_of_ranks_that_left_are_collected() -> None:
    """After a resize (rank >= nodes) every copy goes, protected step or not: no round of
    this config plans such an item. A rank in the job that no longer pushes here (the
    layout changed) keeps what a restore may still want: protected steps and steps at or
    after this rank's newest."""
    cfg = JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=4)
    own = [item(s, 0, job="j") for s in (5, 6)]
    resized = [item(s, r, job="j") for r in (4, 7) for s in (5, 6)]
    moved = [item(s, 2, job="j") for s in (4, 5, 6, 7)]
    doomed = retention_of_copies(cfg, own + resized + moved, protected={5, 6}, pushing={3})
    assert doomed == sorted([*resized, item(4, 2, job="j")])
    assert retention_of_copies(cfg, own + moved, protected=(), pushing={3}) == [
        item(4, 2, job="j"),
        item(5, 2, job="j"),
    ]


def test_keep_steps_adds_the_newest_n_to_what_the_safety_rules_keep() -> None:
    """``--keep-steps``: the newest N complete own steps, and the copies of other ranks of
    those steps, stay; a protected step (the restorable one, an upload) stays whatever N."""
    cfg = JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=2)
    own = [ItemId("j", s, 0, 0) for s in (1, 2, 3, 4, 5)]
    copies = [ItemId("j", s, 1, 0) for s in (1, 2, 3, 4, 5)]
    complete = complete_steps(cfg, own)
    assert newest_kept(complete, 3) == {3, 4, 5}
    assert newest_kept(complete, 9) == {1, 2, 3, 4, 5}
    protected = {1} | newest_kept(complete, 3)  # step 1: the restorable one, say
    assert retention(cfg, own, protected) == [ItemId("j", 2, 0, 0)]
    doomed = retention_of_copies(cfg, own + copies, protected, pushing={1})
    assert doomed == [ItemId("j", 2, 1, 0)]
    # N = 1 is what retention kept before the setting: the newest and the protected.
    assert retention(cfg, own, {1} | newest_kept(complete, 1)) == own[1:4]
