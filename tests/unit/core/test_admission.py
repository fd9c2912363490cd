"""Tests for ``mtc_replicator.core.admission``: which pushed items a node takes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mtc_replicator.core.admission import (
    MAX_STEP_LEAD,
    Served,
    Verdict,
    admit_copy,
    admit_push,
    expected_pushers,
    inode_room,
    step_limit,
)
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import ItemId

# 8 nodes, 2 peers each: rank 3 receives from two ranks of the computed ring layout.
CONFIG = JobConfig("job", Framework.ORBAX, node_rank=3, nodes=8, peers_per_node=2)
SERVED = Served(CONFIG, newest_step=100)


def verdict(item: ItemId, served: Served | None = SERVED, lead: int = MAX_STEP_LEAD) -> Verdict:
    return admit_push(served, item, max_lead=lead).verdict


def test_exactly_the_ranks_whose_targets_name_this_node_may_push() -> None:
    senders = {
        r
        for r in range(CONFIG.nodes)
        if 3 in replication_targets(JobConfig("job", Framework.ORBAX, r, 8, peers_per_node=2))
    }
    assert expected_pushers(CONFIG) == senders
    assert len(senders) == 2
    for rank in range(CONFIG.nodes):
        want = Verdict.ACCEPT if rank in senders else Verdict.NOT_A_PUSHER
        assert verdict(ItemId("job", 100, rank, 0)) is want, rank


def test_own_rank_is_refused_with_a_clear_reason() -> None:
    refusal = admit_push(SERVED, ItemId("job", 100, 3, 0))
    assert refusal.verdict is Verdict.NOT_A_PUSHER
    assert "own rank" in refusal.reason


def test_ranks_and_workers_outside_the_job_are_refused() -> None:
    for rank in (8, 9, 2**32 - 1):
        refusal = admit_push(SERVED, ItemId("job", 100, rank, 0))
        assert refusal.verdict is Verdict.NOT_IN_JOB
        assert "of 8 nodes" in refusal.reason
    # A step-directory job has one item per node: worker 0's.
    pusher = min(expected_pushers(CONFIG))
    assert verdict(ItemId("job", 100, pusher, 1)) is Verdict.NOT_IN_JOB


def test_another_job_or_no_job_is_not_served() -> None:
    pusher = min(expected_pushers(CONFIG))
    assert verdict(ItemId("other", 100, pusher, 0)) is Verdict.NOT_SERVED
    assert verdict(ItemId("job", 100, pusher, 0), served=None) is Verdict.NOT_SERVED


def test_a_step_beyond_the_bound_is_refused_and_taken_once_the_node_catches_up() -> None:
    pusher = min(expected_pushers(CONFIG))
    far = ItemId("job", 10**15, pusher, 0)
    refusal = admit_push(SERVED, far)
    assert refusal.verdict is Verdict.TOO_FAR_AHEAD
    assert str(step_limit(100)) in refusal.reason
    assert verdict(ItemId("job", 100 + MAX_STEP_LEAD, pusher, 0)) is Verdict.ACCEPT
    assert verdict(ItemId("job", 101 + MAX_STEP_LEAD, pusher, 0)) is Verdict.TOO_FAR_AHEAD
    assert verdict(far, served=Served(CONFIG, 10**15 - 5)) is Verdict.ACCEPT


def test_before_its_first_step_a_node_counts_from_zero() -> None:
    pusher = min(expected_pushers(CONFIG))
    fresh = Served(CONFIG, None)
    assert verdict(ItemId("job", 50, pusher, 0), fresh, lead=50) is Verdict.ACCEPT
    assert verdict(ItemId("job", 51, pusher, 0), fresh, lead=50) is Verdict.TOO_FAR_AHEAD


def test_with_explicit_peer_ranks_any_other_rank_but_an_equivalent_may_push() -> None:
    """Each node's peer-ranks are in its own replicator.yaml only: the receiver cannot tell
    which ranks chose it, but equivalents never push to each other."""
    config = JobConfig(
        "job", Framework.ORBAX, node_rank=1, nodes=4, peer_ranks=(3,), data_parallelism=2
    )
    assert config.equivalent_ranks(1) == (3,)
    assert expected_pushers(config) == {0, 2}


def test_one_node_job_takes_no_pushes() -> None:
    alone = Served(JobConfig("job", Framework.ORBAX, node_rank=0, nodes=1), 5)
    assert verdict(ItemId("job", 5, 0, 0), alone) is Verdict.NOT_A_PUSHER


def test_a_committed_copy_is_never_replaced() -> None:
    item = ItemId("job", 100, 2, 0)
    assert admit_copy(item, "a" * 64, None).verdict is Verdict.ACCEPT
    assert admit_copy(item, "a" * 64, "a" * 64).verdict is Verdict.ALREADY_HELD
    conflict = admit_copy(item, "a" * 64, "b" * 64)
    assert conflict.verdict is Verdict.CONFLICT
    assert "never replaced" in conflict.reason


@given(
    nodes=st.integers(2, 40),
    per_node=st.integers(1, 6),
    dp=st.sampled_from([None, 2]),
    data=st.data(),
)
def test_every_push_the_layout_makes_is_admitted_and_no_other(
    nodes: int, per_node: int, dp: int | None, data: st.DataObject
) -> None:
    """``expected_pushers`` is the exact inverse of every rank's replication targets."""
    if dp is not None and nodes % dp:
        dp = None
    receiver = data.draw(st.integers(0, nodes - 1))

    def config(rank: int) -> JobConfig:
        return JobConfig(
            "job", Framework.ORBAX, rank, nodes, peers_per_node=per_node, data_parallelism=dp
        )

    senders = {r for r in range(nodes) if receiver in replication_targets(config(r))}
    assert expected_pushers(config(receiver)) == senders


def test_inode_room_leaves_a_margin_and_counts_pushes_in_flight() -> None:
    # A 20,000-inode tmpfs: a sixteenth (1,250) stays free, under the 4,096 margin.
    assert inode_room(free=19_000, total=20_000, incoming=0) == 19_000 - 1_250
    assert inode_room(free=19_000, total=20_000, incoming=5_000) == 19_000 - 1_250 - 5_000
    # A large filesystem keeps the fixed margin.
    assert inode_room(free=10**7, total=10**8, incoming=0) == 10**7 - 4096
    # No fixed number of inodes (btrfs reports 0): no inode bound.
    assert inode_room(free=0, total=0, incoming=0) is None


def test_a_rank_bound_to_a_node_is_pushed_only_by_that_node() -> None:
    pushing = next(
        r for r in range(CONFIG.nodes) if verdict(ItemId("job", 5, r, 0)) is Verdict.ACCEPT
    )
    item = ItemId("job", 5, pushing, 0)
    bound = Served(CONFIG, 100, holders={pushing: "node-a"})
    assert admit_push(bound, item, pusher="node-a").accepted
    refused = admit_push(bound, item, pusher="mallory")
    assert refused.verdict is Verdict.NOT_A_PUSHER
    assert f"rank {pushing} is held by node 'node-a', not 'mallory'" in refused.reason
    # Not known (no report answered yet, TLS off, a shared certificate on either side):
    # the layout alone admits it, and the restore checks who produced it.
    assert admit_push(SERVED, item, pusher="mallory").accepted
    assert admit_push(bound, item, pusher=None).accepted
    assert admit_push(bound, item, pusher=LEGACY).accepted
    assert admit_push(Served(CONFIG, 100, holders={pushing: LEGACY}), item, pusher="x").accepted


def test_no_push_from_a_node_before_the_ranks_nodes_are_known() -> None:
    """A run's first seconds, no grant: the coordinator has not answered yet, so no node's
    push is taken (without TLS, or under a shared certificate, the layout alone admits)."""
    early = Served(CONFIG, 100, bound=False)
    item = ItemId("job", 101, min(expected_pushers(CONFIG)), 0)
    refused = admit_push(early, item, pusher="node-a")
    assert refused.verdict is Verdict.NOT_SERVED
    assert "does not know yet which node holds rank" in refused.reason
    assert admit_push(early, item, pusher=None).verdict is Verdict.ACCEPT
    assert admit_push(Served(CONFIG, 100), item, pusher="node-a").verdict is Verdict.ACCEPT
