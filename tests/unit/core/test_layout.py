"""Tests for ``mtc_replicator.core.layout``: the peer layout and steady-state decisions (pure)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.layout import (
    Holders,
    backup_items,
    backup_uploaders,
    choose_peers,
    format_ranks,
    holders,
    missing_ranks,
    no_copy_note,
    off_node_copies,
    peer_offsets,
    pushers,
    replication_targets,
    restorable_step,
    waiting_message,
)
from mtc_replicator.core.manifest import ItemId


def cfg(
    nodes: int,
    ppn: int = 1,
    rank: int = 0,
    dp: int | None = None,
    peer_ranks: tuple[int, ...] = (),
    framework: Framework = Framework.ORBAX,
    workers: int = 1,
) -> JobConfig:
    return JobConfig(
        "job",
        framework,
        node_rank=rank,
        nodes=nodes,
        peer_ranks=peer_ranks,
        peers_per_node=ppn,
        data_parallelism=dp,
        workers_per_node=workers,
    )


def at(config: JobConfig, rank: int) -> JobConfig:
    return dataclasses.replace(config, node_rank=rank)


@st.composite
def layouts(draw: st.DrawFn, max_nodes: int = 40) -> JobConfig:
    """Any valid config without explicit peer-ranks (the layout is ours to compute)."""
    nodes = draw(st.integers(1, max_nodes))
    divisors = [d for d in range(1, nodes + 1) if nodes % d == 0]
    dp = draw(st.sampled_from([None, *divisors]))
    ppn = draw(st.integers(0, nodes - 1))
    return cfg(nodes, ppn, rank=draw(st.integers(0, nodes - 1)), dp=dp)


# --- choose_peers ----------------------------------------------------------------------------


def test_peers_spread_far_over_the_ring() -> None:
    # One peer: the opposite side of the ring, the likeliest to be in another rack.
    assert [choose_peers(cfg(8, 1, rank=r)) for r in range(8)] == [
        (4,),
        (5,),
        (6,),
        (7,),
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    assert choose_peers(cfg(8, 3, rank=0)) == (2, 4, 6)
    assert choose_peers(cfg(8, 3, rank=7)) == (1, 3, 5)
    assert choose_peers(cfg(5, 4, rank=2)) == (3, 4, 0, 1)
    assert choose_peers(cfg(1, 0)) == ()
    assert choose_peers(cfg(4, 0, rank=2)) == ()


def test_peers_with_data_parallelism_are_equivalents_first() -> None:
    # 8 nodes as 4 replicas of 2: rank 5's equivalents are 1, 3 and 7 (what Orbax writes).
    assert set(choose_peers(cfg(8, 3, rank=5, dp=4))) == {1, 3, 7}
    # Fewer peers than equivalents: the farthest replica first.
    assert choose_peers(cfg(8, 1, rank=5, dp=4)) == (1,)
    # More peers than equivalents: every equivalent, then non-equivalent ranks.
    peers = choose_peers(cfg(8, 5, rank=5, dp=4))
    assert set(peers[:3]) == {1, 3, 7}
    assert all(p % 2 != 5 % 2 for p in peers[3:])


def test_explicit_peer_ranks_win() -> None:
    assert choose_peers(cfg(8, 3, rank=5, dp=4, peer_ranks=(7, 1, 3))) == (7, 1, 3)
    assert choose_peers(cfg(4, 1, rank=0, peer_ranks=(1,))) == (1,)


@settings(max_examples=300, deadline=None)
@given(config=layouts())
def test_choose_peers_properties(config: JobConfig) -> None:
    """Every rank computes its part of one layout: valid, and balanced in-degree."""
    count = min(config.peers_per_node, config.nodes - 1)
    indegree: Counter[int] = Counter()
    for r in range(config.nodes):
        peers = choose_peers(at(config, r))
        assert len(peers) == count
        assert len(set(peers)) == count
        assert r not in peers
        assert all(0 <= p < config.nodes for p in peers)
        indegree.update(peers)
        # With data parallelism the equivalent ranks come first.
        equivalents = set(config.equivalent_ranks(r))
        first = peers[: min(count, len(equivalents))]
        assert set(first) <= equivalents
        if count >= len(equivalents):
            assert equivalents <= set(peers)
    degrees = [indegree[r] for r in range(config.nodes)]
    assert max(degrees) - min(degrees) <= 1
    assert set(degrees) <= {count}  # a circulant layout: exactly as many in as out


@settings(max_examples=200, deadline=None)
@given(config=layouts(max_nodes=24))
def test_holders_and_pushers_invert_the_layout(config: JobConfig) -> None:
    for r in range(config.nodes):
        targets = replication_targets(at(config, r))
        equivalents = config.equivalent_ranks(r)
        assert holders(config, r) == Holders(targets, equivalents)
        # Never a byte copy to an equivalent: it holds an equivalent checkpoint already.
        assert not set(targets) & set(equivalents)
        assert set(targets) == set(choose_peers(at(config, r))) - set(equivalents)
        for p in range(config.nodes):
            assert (p in pushers(config, r)) == (r in replication_targets(at(config, p)))


def test_replication_targets_skip_equivalents() -> None:
    assert replication_targets(cfg(4, 1, rank=1)) == (3,)
    assert replication_targets(cfg(4, 1, rank=1, dp=2)) == ()  # the peer is rank 1's twin
    assert replication_targets(cfg(4, 2, rank=1, dp=2)) == (2,)
    assert replication_targets(cfg(8, 3, rank=5, dp=4, peer_ranks=(1, 3, 7))) == ()
    assert replication_targets(cfg(8, 2, rank=5, peer_ranks=(1, 3))) == (1, 3)


def test_holders_need_the_computed_layout_for_other_ranks() -> None:
    explicit = cfg(4, 1, rank=0, peer_ranks=(1,))
    assert holders(explicit, 0) == Holders((1,), ())
    with pytest.raises(ValueError, match="rank 2's peer-ranks"):
        holders(explicit, 2)
    with pytest.raises(ValueError, match="explicit peer-ranks"):
        pushers(explicit, 1)
    with pytest.raises(ValueError, match="not in"):
        holders(cfg(4), 4)


def test_layout_scales_to_huge_clusters() -> None:
    # No per-rank lists: a million-node job plans its peers in microseconds.
    config = cfg(1 << 20, 3, rank=12345, dp=4)
    start = time.perf_counter()
    peers = choose_peers(config)
    holders(config, 999_999)
    pushers(config, 7)
    assert time.perf_counter() - start < 0.1
    assert len(peers) == 3
    assert peer_offsets(config) == (1 << 18, 2 << 18, 3 << 18)


# --- steady state ----------------------------------------------------------------------------


def test_restorable_step_is_the_newest_step_complete_everywhere() -> None:
    config = cfg(3)
    assert restorable_step(config, {0: 30, 1: 20, 2: 40}) == 20
    assert restorable_step(config, {0: 30, 1: 30, 2: 30}) == 30
    assert restorable_step(config, {0: 30, 1: None, 2: 40}) is None
    assert restorable_step(config, {0: 30, 2: 40}) is None  # rank 1 has not reported
    assert restorable_step(config, {0: 30, 1: 50, 2: 40, 7: 1}) == 30  # not a rank: ignored


def test_restorable_step_is_one_every_rank_promised_to_keep() -> None:
    config = cfg(3)
    reported = {0: 30, 1: 20, 2: 40}
    everything = frozenset(range(0, 50, 10))
    assert restorable_step(config, reported, {0: everything, 1: everything}) == 20
    # Rank 0 dropped 20: the newest step all still keep, below the oldest newest one.
    assert restorable_step(config, reported, {0: frozenset({10, 30}), 1: everything}) == 10
    # Nothing in common at or below 20: no restorable step (ranks keep the last one named).
    assert restorable_step(config, reported, {0: frozenset({30}), 2: frozenset({40})}) is None
    # A rank missing from ``held`` keeps everything; an empty promise keeps nothing.
    assert restorable_step(config, reported, {2: frozenset()}) is None


def test_backup_uploaders_one_per_equivalence_class() -> None:
    assert backup_uploaders(cfg(4)) == {0, 1, 2, 3}
    assert backup_uploaders(cfg(4, dp=1)) == {0, 1, 2, 3}
    assert backup_uploaders(cfg(4, dp=2)) == {0, 1}
    assert backup_uploaders(cfg(8, dp=8)) == {0}
    for dp in (1, 2, 3, 4, 6, 12):
        config = cfg(12, dp=dp)
        classes = Counter(r % config.nodes_per_replica for r in backup_uploaders(config))
        assert classes == dict.fromkeys(range(config.nodes_per_replica), 1)


def test_backup_items_are_the_uploaders_items() -> None:
    save = cfg(4, dp=2, framework=Framework.PYTORCH, workers=2)
    assert backup_items(save, 7) == [
        ItemId("job", 7, 0, 0),
        ItemId("job", 7, 0, 1),
        ItemId("job", 7, 1, 0),
        ItemId("job", 7, 1, 1),
    ]
    # A step-directory job has one item per node, whatever the workers.
    assert backup_items(cfg(2, workers=4), 3) == [ItemId("job", 3, 0, 0), ItemId("job", 3, 1, 0)]


# --- who is missing ------------------------------------------------------------------------------


def test_missing_ranks_and_message() -> None:
    config = cfg(8)
    assert missing_ranks(config, [0, 1, 2, 4, 5, 6]) == [3, 7]
    assert missing_ranks(config, range(8)) == []
    assert missing_ranks(config, [0, 0, 9]) == [1, 2, 3, 4, 5, 6, 7]
    assert waiting_message(config, [3, 7]) == (
        "waiting for ranks 3, 7 of job job to join the restore round (6 of 8 joined)"
    )
    assert waiting_message(config, [5]).startswith("waiting for rank 5 of job job ")


def test_format_ranks_collapses_runs_and_stays_short() -> None:
    assert format_ranks([7, 3]) == "3, 7"
    assert format_ranks([0, 1, 2, 5, 9, 10]) == "0-2, 5, 9, 10"
    assert format_ranks([]) == ""
    every_other = format_ranks(range(0, 10_000, 2))
    assert len(every_other) < 120
    assert every_other.endswith("and 4984 more")
    assert format_ranks(range(100_000)) == "0-99999"


# --- copies off the node ---------------------------------------------------------------------


def test_off_node_copies_count_targets_and_equivalents() -> None:
    assert off_node_copies(cfg(4, ppn=1)) == 1
    assert off_node_copies(cfg(4, ppn=2)) == 2
    assert off_node_copies(cfg(4, ppn=0)) == 0
    # Two replicas of two nodes: the equivalent holds this rank's state, with no push.
    assert off_node_copies(cfg(4, ppn=0, dp=2)) == 1
    assert off_node_copies(cfg(4, ppn=1, dp=2)) == 1
    assert off_node_copies(cfg(4, rank=0, peer_ranks=(2, 3), ppn=2)) == 2
    assert off_node_copies(cfg(1, ppn=0)) == 0


def test_only_a_multi_node_job_with_no_copy_off_its_node_gets_the_note() -> None:
    note = no_copy_note(cfg(4, ppn=0, rank=2))
    assert note is not None
    assert "job job rank 2" in note
    assert "peers-per-node: 1" in note
    assert no_copy_note(cfg(4, ppn=1)) is None
    assert no_copy_note(cfg(4, ppn=0, dp=4)) is None
    assert no_copy_note(cfg(1, ppn=0)) is None


@given(layouts())
@settings(max_examples=200, deadline=None)
def test_the_note_is_said_exactly_when_no_other_node_holds_the_rank(config: JobConfig) -> None:
    held = holders(config, config.node_rank)
    alone = config.nodes > 1 and not held.copies and not held.equivalents
    assert (no_copy_note(config) is not None) == alone
