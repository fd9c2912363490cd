"""The Ray Train layout and refusals (mtc_replicator.core.raytrain), with plain data: no Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.raytrain import (
    Claim,
    DatedRunName,
    ElasticWorkers,
    ForeignCheckpoint,
    RanksDisagree,
    RayMeta,
    RayTrainRefused,
    SharedNodes,
    UnevenPlacement,
    WorkerPlace,
    agree_step,
    check_claim,
    check_fixed_workers,
    check_handed,
    continued_name,
    job_name_of,
    layout_of,
    may_release,
    own_lineage,
    pick_source,
    tune_job_name,
)


def places(*nodes: int) -> list[WorkerPlace]:
    """torchrun numbering: ``nodes[i]`` workers on node rank i, world ranks in order."""
    out: list[WorkerPlace] = []
    for node, count in enumerate(nodes):
        for local in range(count):
            out.append(WorkerPlace(len(out), local, count, node))
    return out


def test_even_layout_from_ranks() -> None:
    layout = layout_of(list(reversed(places(2, 2, 2))), 6)
    assert (layout.nodes, layout.workers_per_node, layout.world_size) == (3, 2, 6)
    assert layout.node_members == ((0, 1), (2, 3), (4, 5))
    assert layout.node_of(3) == 1


def test_one_worker_per_node_and_a_single_worker() -> None:
    assert layout_of(places(1, 1), 2).node_members == ((0,), (1,))
    assert layout_of(places(1), 1).nodes == 1


def test_uneven_placement_names_the_counts_and_the_fix() -> None:
    with pytest.raises(UnevenPlacement) as err:
        layout_of(places(3, 1), 4)
    assert "{0: 3, 1: 1}" in str(err.value)
    assert 'placement_strategy="STRICT_SPREAD"' in str(err.value)


def test_ranks_not_contiguous_per_node_are_refused() -> None:
    # Node 0 holds world ranks 0 and 2: after a restart (node 0, worker 1) would be another
    # world rank's data.
    mixed = [
        WorkerPlace(0, 0, 2, 0),
        WorkerPlace(2, 1, 2, 0),
        WorkerPlace(1, 0, 2, 1),
        WorkerPlace(3, 1, 2, 1),
    ]
    with pytest.raises(UnevenPlacement, match="torchrun's numbering"):
        layout_of(mixed, 4)


def test_node_ranks_with_a_gap_are_refused() -> None:
    gap = [WorkerPlace(0, 0, 1, 0), WorkerPlace(1, 0, 1, 2)]
    with pytest.raises(UnevenPlacement, match=r"node ranks \[0, 2\]"):
        layout_of(gap, 2)


def test_missing_or_duplicate_world_ranks_are_a_bug_not_a_refusal() -> None:
    with pytest.raises(ValueError, match="one place per world rank"):
        layout_of(places(1), 2)


@pytest.mark.parametrize(
    "name", ["ray_train_run-2026-11-26_00-49-19", "TorchTrainer_2026-01-31_12-00-00.123456"]
)
def test_dated_default_run_names_are_refused(name: str) -> None:
    with pytest.raises(DatedRunName, match=r'RunConfig\(name="my-job"\)'):
        job_name_of(name)


def test_a_stable_run_name_is_the_job_name() -> None:
    assert job_name_of("llm-7b.v2") == "llm-7b.v2"
    with pytest.raises(RayTrainRefused, match="cannot be the replicator's job name"):
        job_name_of("my run/1")


def test_elastic_and_changed_worker_counts_are_refused() -> None:
    with pytest.raises(ElasticWorkers, match=r"num_workers=N"):
        check_fixed_workers(True, 4, None)
    with pytest.raises(ElasticWorkers, match="saved with 4 workers and now runs 2"):
        check_fixed_workers(False, 2, 4)
    check_fixed_workers(False, 4, 4)
    check_fixed_workers(False, 4, None)


def test_another_jobs_recent_claim_is_refused_an_old_one_is_not() -> None:
    claim = Claim("trial-a", 2, at=1000.0)
    with pytest.raises(SharedNodes) as err:
        check_claim(claim, "trial-b", now=1030.0, lease=120.0, where="/ckpt/ray-train.claim")
    text = str(err.value)
    assert "'trial-a'" in text
    assert "max_concurrent_trials" in text
    assert "wait 90 s or delete /ckpt/ray-train.claim" in text
    check_claim(claim, "trial-b", now=1121.0, lease=120.0, where="x")
    check_claim(claim, "trial-a", now=1001.0, lease=120.0, where="x")
    check_claim(None, "trial-b", now=0.0, lease=120.0, where="x")


def test_claims_round_trip_and_damaged_ones_claim_nothing() -> None:
    claim = Claim("job", 4, 12.5, holder="f00d")
    assert Claim.from_json(claim.to_json()) == claim
    # A claim written before holders existed is still a claim, one nobody may release.
    assert Claim.from_json({"job": "job", "world-size": 4, "at": 12.5}) == Claim("job", 4, 12.5)
    for bad in (None, [], {"job": 1, "world-size": 2, "at": 1}, {"job": "j", "world-size": True}):
        assert Claim.from_json(bad) is None


def test_only_the_incarnation_that_wrote_a_claim_may_release_it() -> None:
    mine = Claim("trial-a", 2, 1000.0, holder="a1")
    assert may_release(mine, "a1")
    # The same job's next incarnation (Ray restarted its workers) holds the node now.
    assert not may_release(Claim("trial-a", 2, 1010.0, holder="a2"), "a1")
    # Another job took the node after trial-a's lease ran out.
    assert not may_release(Claim("trial-b", 2, 1200.0, holder="b1"), "a1")
    assert not may_release(None, "a1")
    assert not may_release(Claim("trial-a", 2, 1000.0), "")


def test_ray_metadata_round_trips_and_an_older_one_names_no_job() -> None:
    meta = RayMeta(6, 2, "files", "sweep-a")
    assert RayMeta.from_json(meta.to_json()) == meta
    assert RayMeta.from_json({"step": 3, "world-size": 2, "mode": "dcp"}) == RayMeta(
        3, 2, "dcp", None
    )
    for bad in (None, [], {"step": "3", "world-size": 2}, {"step": 3, "world-size": 0}):
        assert RayMeta.from_json(bad) is None


def test_a_checkpoint_of_this_job_may_be_continued_from() -> None:
    check_handed("sweep-b", RayMeta(6, 2, "files", "sweep-b"), "/s/sweep-b/checkpoint_1")


def test_another_jobs_checkpoint_is_refused_naming_both_jobs_and_what_to_do() -> None:
    with pytest.raises(ForeignCheckpoint) as err:
        check_handed("sweep-b", RayMeta(6, 2, "files", "sweep-a"), "/s/sweep-a/checkpoint_1")
    text = str(err.value)
    assert "job 'sweep-b' was asked to continue from job 'sweep-a''s checkpoint of step 6" in text
    assert "/s/sweep-a/checkpoint_1" in text
    assert "PopulationBasedTraining" in text
    assert "Nothing was loaded" in text
    assert "run the trials as Tune functions on TuneCheckpointer" in text
    assert isinstance(err.value, RayTrainRefused)


def test_a_checkpoint_that_names_no_job_or_is_not_ours_is_refused() -> None:
    with pytest.raises(ForeignCheckpoint, match="written by an older mtc-replicator"):
        check_handed("sweep-b", RayMeta(6, 2, "files", None), "/s/x")
    with pytest.raises(ForeignCheckpoint, match=r"RayCheckpointer.report did not write"):
        check_handed("sweep-b", None, "/s/x")


def test_every_node_must_offer_the_same_step() -> None:
    assert agree_step({0: 7, 1: 7}) == 7
    assert agree_step({0: None, 1: None}) is None
    assert agree_step({}) is None
    with pytest.raises(RanksDisagree, match=r"\{0: 7, 1: 5\}"):
        agree_step({1: 5, 0: 7})


def test_the_replicator_wins_unless_ray_holds_a_newer_step() -> None:
    assert pick_source(None, None) is None
    assert pick_source(10, None) == "replicator"
    assert pick_source(10, 10) == "replicator"
    assert pick_source(10, 5) == "replicator"
    assert pick_source(5, 10) == "ray"
    assert pick_source(None, 3) == "ray"


def test_importing_the_client_imports_neither_ray_nor_torch() -> None:
    code = (
        "import sys, mtc_replicator.client as c; c.RayCheckpointer; "
        "assert 'ray' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_tune_trials_job_names_and_its_continued_names() -> None:
    base = tune_job_name("pbt/sweep one", "2151e_00003")
    assert base == "pbt-sweep-one-2151e_00003"
    assert is_job_name(tune_job_name("..", "x"))
    assert is_job_name(tune_job_name("-a", "_b"))
    continued = continued_name(base, "pbt-sweep-one-2151e_00001", 6)
    assert continued == continued_name(base, "pbt-sweep-one-2151e_00001", 6)  # every try
    assert continued != continued_name(base, "pbt-sweep-one-2151e_00001", 8)
    assert is_job_name(continued)
    assert own_lineage(base, base)
    assert own_lineage(base, continued)
    assert not own_lineage(base, "pbt-sweep-one-2151e_00001")
    assert not own_lineage(base, base + ".xnothex!")
    assert not own_lineage(base + "3", continued)
