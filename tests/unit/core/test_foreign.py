"""Which items of jobs that no longer run here give way (``core.foreign``), and what a
stopping daemon does with the newest step (``core.drain``): pure decisions."""

from __future__ import annotations

import pytest

from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.drain import plan_drain
from mtc_replicator.core.foreign import (
    DropRefused,
    HeldJob,
    UploadRefused,
    check_drop,
    next_save_bytes,
    plan_eviction,
    plan_kept_upload,
    unprotected,
)
from mtc_replicator.core.manifest import ItemId

MiB = 1 << 20


def held(job: str, *, newest: int = 10, committed: int | None = 10, idle: float = 0.0,
         size: int = 10 * MiB) -> HeldJob:  # fmt: skip
    return HeldJob(job, newest, 1, size, size, idle, committed)


def test_a_job_is_backed_up_when_the_bucket_holds_its_newest_step_or_a_newer_one() -> None:
    assert held("a", newest=10, committed=10).backed_up
    assert held("a", newest=10, committed=20).backed_up
    assert not held("a", newest=10, committed=5).backed_up
    assert not held("a", committed=None).backed_up


def test_the_ttl_drops_only_backed_up_jobs() -> None:
    jobs = [held("old", idle=0.0), held("fresh", idle=900.0), held("only", committed=None)]
    plan = plan_eviction(jobs, now=1000.0, ttl=500.0)
    assert plan.jobs == ("old",)
    assert "ttl 500s" in plan.reasons["old"]
    assert [h.job for h in unprotected(jobs)] == ["only"]


def test_room_drops_the_longest_idle_backed_up_jobs_until_the_step_fits() -> None:
    jobs = [
        held("b", idle=20.0),
        held("a", idle=10.0),
        held("c", idle=30.0),
        held("only", idle=0.0, committed=None),
    ]
    plan = plan_eviction(jobs, now=100.0, ttl=3600.0, free=5 * MiB, need=20 * MiB)
    assert plan.jobs == ("a", "b")  # 5 + 10 + 10 >= 20; "only" is never dropped
    assert plan_eviction(jobs, now=100.0, ttl=3600.0, free=25 * MiB, need=20 * MiB).jobs == ()
    # No job runs: nothing needs room, only the TTL counts.
    assert plan_eviction(jobs, now=100.0, ttl=3600.0).jobs == ()


def test_room_is_the_running_jobs_step_or_before_its_first_the_largest_held() -> None:
    jobs = [held("a", size=7), held("b", size=9)]
    assert next_save_bytes(3, jobs) == 3
    assert next_save_bytes(None, jobs) == 9
    assert next_save_bytes(None, []) == 0


def test_a_drop_refuses_the_running_job_an_unknown_one_and_an_only_copy() -> None:
    with pytest.raises(DropRefused, match="runs on this node now"):
        check_drop("a", {"a"}, held("a"), only_copy=True)
    with pytest.raises(DropRefused, match="holds no items of job z"):
        check_drop("z", {"a"}, None, only_copy=True)
    only = held("b", newest=30, committed=20)
    with pytest.raises(DropRefused, match=r"30, is not committed .* \(newest committed: 20\)"):
        check_drop("b", {"a"}, only, only_copy=False)
    with pytest.raises(DropRefused, match="`mtc upload --job b` uploads that step"):
        check_drop("b", {"a"}, only, only_copy=False)
    assert check_drop("b", {"a"}, only, only_copy=True) is only
    assert check_drop("c", frozenset(), held("c"), only_copy=False).job == "c"


def config(rank: int = 0, nodes: int = 1, **kw: object) -> JobConfig:
    return JobConfig("job", Framework.ORBAX, rank, nodes, **kw)  # type: ignore[arg-type]


def test_one_node_drains_into_the_backup_when_the_bucket_is_older() -> None:
    plan = plan_drain(config(), newest=30, replicated=30, committed=False, has_backup=True)
    assert (plan.step, plan.push, plan.upload) == (30, False, True)
    plan = plan_drain(config(), newest=30, replicated=30, committed=True, has_backup=True)
    assert (plan.push, plan.upload) == (False, False)
    assert "the backup holds it" in plan.why
    plan = plan_drain(config(), newest=None, replicated=None, committed=False, has_backup=True)
    assert plan.step is None


def test_a_cluster_rank_pushes_to_peers_that_lack_it_and_uploads_if_it_is_an_uploader() -> None:
    c = config(rank=1, nodes=4, peers_per_node=1)
    plan = plan_drain(c, newest=30, replicated=20, committed=False, has_backup=True)
    assert (plan.push, plan.upload) == (True, True)
    plan = plan_drain(c, newest=30, replicated=30, committed=False, has_backup=False)
    assert (plan.push, plan.upload) == (False, False)
    assert "no backup is set" in plan.why
    # Replica 1 of a data-parallel job: replica 0 uploads the class's items.
    dp = config(rank=3, nodes=4, peers_per_node=1, data_parallelism=2)
    plan = plan_drain(dp, newest=30, replicated=None, committed=False, has_backup=True)
    assert plan.upload is False
    assert "another replica" in plan.why


def test_an_upload_of_a_kept_job_takes_the_newest_step_and_every_listed_item_held() -> None:
    c = config(rank=1, nodes=4, peers_per_node=1)
    # Rank 1's own steps 10 and 20, and a peer copy of rank 0's step 20; another job's item.
    held_here = [ItemId("job", 10, 1, 0), ItemId("job", 20, 1, 0), ItemId("job", 20, 0, 0)]
    plan = plan_kept_upload(c, [*held_here, ItemId("other", 30, 1, 0)])
    assert (plan.job, plan.step) == ("job", 20)
    assert plan.items == (ItemId("job", 20, 0, 0), ItemId("job", 20, 1, 0))
    assert [i.rank for i in plan.listed] == [0, 1, 2, 3]  # the COMMIT lists every rank
    assert plan_kept_upload(c, held_here, step=10).items == (ItemId("job", 10, 1, 0),)
    with pytest.raises(UploadRefused, match=r"step 15 .* \(steps held here: 10, 20\)"):
        plan_kept_upload(c, held_here, step=15)


def test_an_upload_needs_an_item_the_commit_lists() -> None:
    # Replica 1 of a data-parallel job: its items are never in a COMMIT (replica 0's are).
    dp = config(rank=3, nodes=4, peers_per_node=1, data_parallelism=2)
    with pytest.raises(UploadRefused, match=r"uploaders: ranks 0, 1;.*node of an uploading rank"):
        plan_kept_upload(dp, [ItemId("job", 20, 3, 0)])
    with pytest.raises(UploadRefused, match="holds no item of job job"):
        plan_kept_upload(config(), [])
