"""Tests for ``mtc_replicator.core.restore_plan``: the restore round's plan, pure in joins."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.layout import backup_items, holders
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source, worker_slots
from mtc_replicator.core.restore_plan import (
    FAN_OUT,
    Fetch,
    NodeInventory,
    PassedOver,
    RoundPlan,
    SourceKey,
    balance,
    passed_over_by_reports,
    plan_round,
    restorable_steps,
)

JOB = "job"
TIER = {
    (Source.LOCAL, False): 0,
    (Source.PEER, False): 1,
    (Source.LOCAL, True): 2,
    (Source.PEER, True): 3,
    (Source.BACKUP, False): 4,
    (Source.BACKUP, True): 5,
}


def cfg(
    nodes: int = 4,
    ppn: int = 1,
    dp: int | None = None,
    framework: Framework = Framework.ORBAX,
    workers: int = 1,
) -> JobConfig:
    return JobConfig(
        JOB,
        framework,
        node_rank=0,
        nodes=nodes,
        peers_per_node=ppn,
        data_parallelism=dp,
        workers_per_node=workers,
    )


def digest(item: ItemId, timeline: str = "") -> str:
    """A stand-in manifest digest: one per item (and per timeline that saved it)."""
    return hashlib.sha256(f"{item}{timeline}".encode()).hexdigest()


def items_of(config: JobConfig, step: int, rank: int) -> list[ItemId]:
    return [ItemId(JOB, step, rank, w) for w in worker_slots(config)]


def inventory(rank: int, items: Iterable[ItemId], timeline: str = "") -> NodeInventory:
    return NodeInventory(rank, f"10.0.0.{rank}:7000", {i: digest(i, timeline) for i in items})


def healthy(
    config: JobConfig,
    steps: Collection[int],
    *,
    wiped: Collection[int] = (),
    lost: Collection[int] = (),
) -> dict[int, NodeInventory]:
    """Joins of a cluster in steady state: own items plus the layout's peer copies.

    ``wiped`` ranks re-joined with an empty store; ``lost`` ranks did not join at all.
    """
    held: dict[int, set[ItemId]] = {r: set() for r in range(config.nodes)}
    for r in range(config.nodes):
        for s in steps:
            mine = items_of(config, s, r)
            held[r].update(mine)
            for p in holders(config, r).copies:
                held[p].update(mine)
    return {
        r: inventory(r, () if r in wiped else held[r]) for r in range(config.nodes) if r not in lost
    }


def backup(config: JobConfig, step: int, ranks: Iterable[int] | None = None) -> CommitRecord:
    if ranks is None:
        listed = backup_items(config, step)
    else:
        listed = [i for r in ranks for i in items_of(config, step, r)]
    return CommitRecord(JOB, step, {i.key: digest(i) for i in listed}, created=0.0)


def firsts(plan: RoundPlan) -> dict[int, tuple[Source, int | None, int, bool]]:
    """rank -> (source, holder, rank of the fetched item, equivalent) of its first choice."""
    out = {}
    for target, sources in plan.sources.items():
        f = sources[0]
        out.setdefault(target.rank, (f.source, f.holder, f.item.rank, f.equivalent))
    return out


# --- the scenarios of the test list ------------------------------------------------------

L, P, B = Source.LOCAL, Source.PEER, Source.BACKUP


@dataclass
class Scenario:
    config: JobConfig
    wiped: tuple[int, ...] = ()
    backups: dict[int, tuple[int, ...] | None] = field(default_factory=dict)
    """Committed backup steps -> the ranks uploaded (None: ``backup_items``)."""
    step: int | None = 20
    first: dict[int, tuple[Source, int | None, int, bool]] = field(default_factory=dict)


# 4 nodes, one peer each: the layout pairs 0 <-> 2 and 1 <-> 3 (offset 2).
FOUR = cfg()
DP2 = cfg(dp=2)  # 2 replicas of 2 nodes: 0 ~ 2 and 1 ~ 3 are equivalent

SCENARIOS = {
    "all local": Scenario(FOUR, first={r: (L, r, r, False) for r in range(4)}, backups={10: None}),
    "one node wiped -> its peer": Scenario(
        FOUR,
        wiped=(1,),
        first={0: (L, 0, 0, False), 1: (P, 3, 1, False), 2: (L, 2, 2, False), 3: (L, 3, 3, False)},
    ),
    "two wiped, covered by the layout": Scenario(
        FOUR,
        wiped=(0, 1),
        first={0: (P, 2, 0, False), 1: (P, 3, 1, False), 2: (L, 2, 2, False), 3: (L, 3, 3, False)},
    ),
    "two wiped, not covered -> backup": Scenario(
        FOUR,
        wiped=(0, 2),
        backups={10: None, 20: None},
        first={
            0: (B, None, 0, False),
            1: (L, 1, 1, False),
            2: (B, None, 2, False),
            3: (L, 3, 3, False),
        },
    ),
    "two wiped, not covered -> older backed-up step": Scenario(
        FOUR,
        wiped=(0, 2),
        backups={10: None},
        step=10,
        first={
            0: (B, None, 0, False),
            1: (L, 1, 1, False),
            2: (B, None, 2, False),
            3: (L, 3, 3, False),
        },
    ),
    "two wiped, not covered, no backup -> start fresh": Scenario(FOUR, wiped=(0, 2), step=None),
    "every node wiped -> backup": Scenario(
        FOUR,
        wiped=(0, 1, 2, 3),
        backups={10: None, 20: None},
        first={r: (B, None, r, False) for r in range(4)},
    ),
    "every node wiped, only an old backup": Scenario(
        FOUR,
        wiped=(0, 1, 2, 3),
        backups={10: None},
        step=10,
        first={r: (B, None, r, False) for r in range(4)},
    ),
    "DP=2, wiped rank -> its equivalent": Scenario(
        DP2,
        wiped=(1,),
        first={0: (L, 0, 0, False), 1: (P, 3, 3, True), 2: (L, 2, 2, False), 3: (L, 3, 3, False)},
    ),
    "DP=2, every node wiped -> one replica's backup, fanned out": Scenario(
        DP2,
        wiped=(0, 1, 2, 3),
        backups={20: None},  # backup_items: replica 0 (ranks 0 and 1) uploaded
        first={
            0: (B, None, 0, False),
            1: (B, None, 1, False),
            2: (P, 0, 0, True),  # pending: rank 0 downloads it, rank 2 pulls it from there
            3: (P, 1, 1, True),
        },
    ),
    "DP=2, a whole equivalence class wiped -> backup, fanned out": Scenario(
        DP2,
        wiped=(1, 3),
        backups={20: None},
        first={
            0: (L, 0, 0, False),
            1: (B, None, 1, False),
            2: (L, 2, 2, False),
            3: (P, 1, 1, True),
        },
    ),
    ".save files, one node wiped -> every worker from its peer": Scenario(
        cfg(framework=Framework.PYTORCH, workers=2),
        wiped=(3,),
        first={0: (L, 0, 0, False), 1: (L, 1, 1, False), 2: (L, 2, 2, False), 3: (P, 1, 3, False)},
    ),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(name: str) -> None:
    sc = SCENARIOS[name]
    joins = healthy(sc.config, (10, 20), wiped=sc.wiped)
    backups = {s: backup(sc.config, s, ranks) for s, ranks in sc.backups.items()}
    plan = plan_round(sc.config, joins, backups)
    if sc.step is None:
        assert plan is None
        return
    assert plan is not None
    assert plan.step == sc.step
    assert firsts(plan) == sc.first
    # Every rank restores the same step: every item of that step, and nothing else.
    expected = {i for r in range(sc.config.nodes) for i in items_of(sc.config, sc.step, r)}
    assert set(plan.sources) == expected


def test_restore_source_is_the_slowest_first_choice() -> None:
    save = cfg(framework=Framework.PYTORCH, workers=2)
    joins = healthy(save, (20,), wiped=(0, 2))
    # Worker 0 of rank 0 is in the backup, worker 1 nowhere else: step 20 needs the backup.
    joins[1] = inventory(1, [*joins[1].items, ItemId(JOB, 20, 0, 1)])
    plan = plan_round(save, joins, {20: backup(save, 20, (0, 2))})
    assert plan is not None
    assert [f[0].source for f in plan.for_rank(0).values()] == [B, P]
    assert plan.restore_source(0) is B
    assert plan.restore_source(1) is L
    assert plan.restore_source(2) is B


def test_lost_rank_is_planned_from_its_copies() -> None:
    # A rank that never joined still has its items planned; the coordinator waits for it.
    plan = plan_round(FOUR, healthy(FOUR, (20,), lost=(1,)), {})
    assert plan is not None
    assert firsts(plan)[1] == (P, 3, 1, False)


# --- newest step, exclusions and fallbacks -------------------------------------------------------


def test_newest_complete_step_wins_and_candidates_are_listed() -> None:
    joins = healthy(FOUR, (10, 20, 30))
    # Step 30 of rank 2 exists nowhere: its node and its peer (rank 0) lost it.
    joins[2] = inventory(2, [i for i in joins[2].items if i.step != 30])
    joins[0] = inventory(0, [i for i in joins[0].items if not (i.step == 30 and i.rank == 2)])
    plan = plan_round(FOUR, joins, {5: backup(FOUR, 5)})
    assert plan is not None
    assert plan.step == 20
    assert plan.candidates == (20, 10, 5)
    assert restorable_steps(FOUR, joins, {5: backup(FOUR, 5)}) == [20, 10, 5]


def test_exclude_falls_back_to_the_next_source_then_an_older_step() -> None:
    joins = healthy(FOUR, (10, 20), wiped=(1,))
    backups = {10: backup(FOUR, 10)}
    plan = plan_round(FOUR, joins, backups)
    assert plan is not None
    assert (plan.step, firsts(plan)[1]) == (20, (P, 3, 1, False))
    # The only copy of rank 1's step 20 is corrupt: step 10, from rank 1's peer again.
    bad = {SourceKey(3, ItemId(JOB, 20, 1, 0))}
    plan = plan_round(FOUR, joins, backups, exclude=bad)
    assert plan is not None
    assert (plan.step, firsts(plan)[1]) == (10, (P, 3, 1, False))
    assert [f.source for f in plan.sources[ItemId(JOB, 10, 1, 0)]] == [P, B]
    # ...and that copy fails too: the backup of step 10.
    bad.add(SourceKey(3, ItemId(JOB, 10, 1, 0)))
    plan = plan_round(FOUR, joins, backups, exclude=bad)
    assert plan is not None
    assert (plan.step, firsts(plan)[1]) == (10, (B, None, 1, False))
    # A failed local copy moves that rank to its peer; the others stay local.
    plan = plan_round(FOUR, healthy(FOUR, (20,)), {}, exclude={SourceKey(0, ItemId(JOB, 20, 0, 0))})
    assert plan is not None
    assert firsts(plan) == {
        0: (P, 2, 0, False),
        1: (L, 1, 1, False),
        2: (L, 2, 2, False),
        3: (L, 3, 3, False),
    }
    bad.add(SourceKey(None, ItemId(JOB, 10, 1, 0)))
    assert plan_round(FOUR, joins, backups, exclude=bad) is None


def test_equivalents_are_used_only_with_data_parallelism() -> None:
    for config in (FOUR, DP2):
        # Rank 1 and its peer copy are gone; its equivalent rank 3 still holds its own.
        joins = healthy(FOUR, (20,), wiped=(1,))
        joins[3] = inventory(3, [ItemId(JOB, 20, 3, 0)])
        plan = plan_round(config, joins, {})
        if config.data_parallelism is None:
            assert plan is None
        else:
            assert plan is not None
            assert plan.sources[ItemId(JOB, 20, 1, 0)] == (
                Fetch(P, ItemId(JOB, 20, 3, 0), 3, digest(ItemId(JOB, 20, 3, 0)), equivalent=True),
            )


def test_inventory_noise_is_ignored_and_misfiled_inventories_refused() -> None:
    joins = healthy(FOUR, (20,), wiped=(1,))
    # Another job's item, a rank this job does not have, a worker it does not have.
    noise = [ItemId("other", 30, 1, 0), ItemId(JOB, 30, 9, 0), ItemId(JOB, 30, 1, 3)]
    joins[1] = inventory(1, noise)
    plan = plan_round(FOUR, joins, {})
    assert plan is not None
    assert plan.step == 20
    with pytest.raises(ValueError, match="filed under rank 2"):
        plan_round(FOUR, {2: inventory(0, [])}, {})


def test_backup_of_another_job_or_step_is_ignored() -> None:
    joins = healthy(FOUR, (), wiped=range(4))
    other = CommitRecord("other", 20, {f"{r}-0": "0" * 64 for r in range(4)}, created=0.0)
    misfiled = dataclasses.replace(backup(FOUR, 10), step=10)
    assert plan_round(FOUR, joins, {20: other, 30: misfiled}) is None


# --- digests: which copy is the item -------------------------------------------------------------


def _rank0_item() -> ItemId:
    return ItemId(JOB, 20, 0, 0)


def test_owner_digest_wins_over_a_stale_peer_copy() -> None:
    item = _rank0_item()
    joins = healthy(FOUR, (20,))
    joins[2] = inventory(2, joins[2].items, timeline="abandoned")  # its copy of rank 0 differs
    plan = plan_round(FOUR, joins, {})
    assert plan is not None
    assert plan.sources[item] == (Fetch(L, item, 0, digest(item)),)
    # The owner's copy fails to verify: the stale copy is still not rank 0's step 20.
    assert plan_round(FOUR, joins, {}, exclude={SourceKey(0, item)}) is None


def test_backup_digest_wins_when_the_owner_is_gone() -> None:
    item = _rank0_item()
    joins = healthy(FOUR, (20,), wiped=(0,))
    joins[2] = NodeInventory(2, joins[2].address, {**joins[2].items, item: digest(item, "x")})
    plan = plan_round(FOUR, joins, {20: backup(FOUR, 20)})
    assert plan is not None
    assert [(f.source, f.digest) for f in plan.sources[item]] == [(B, digest(item))]


def test_an_owner_that_contradicts_the_committed_backup_serves_nobody() -> None:
    # Rank 2's join claims its own step 20 with a digest the committed backup does not have
    # (a forged joiner posing as rank 2): the backup decides, the claimed bytes are never
    # anybody's source, and the step is still restored (one claim must not void it).
    mine = ItemId(JOB, 20, 2, 0)
    for config in (FOUR, DP2):  # with DP2, rank 0's item is an equivalent of rank 2's
        joins = healthy(config, (10, 20))
        forged = {**joins[2].items, mine: digest(mine, "forged")}
        joins[2] = NodeInventory(2, joins[2].address, forged)
        backups = {20: backup(config, 20, ranks=range(4))}
        plan = plan_round(config, joins, backups)
        assert plan is not None
        assert plan.step == 20
        for fetches in plan.sources.values():
            assert all(f.digest == digest(f.item) for f in fetches)
        assert all(f.holder != 2 for f in plan.sources[mine])
        # The same claim with no backup to contradict it: the owner is the authority.
        plan = plan_round(config, joins, {})
        assert plan is not None
        assert (plan.step, plan.sources[mine][0]) == (20, Fetch(L, mine, 2, forged[mine]))


def test_peers_must_agree_when_nothing_else_tells() -> None:
    item = _rank0_item()
    config = cfg(ppn=2)
    joins = healthy(config, (10, 20), wiped=(0,))
    copies = holders(config, 0).copies
    assert len(copies) == 2
    plan = plan_round(config, joins, {})
    assert plan is not None
    assert plan.step == 20
    assert {f.holder for f in plan.sources[item]} == set(copies)
    # Two different copies of rank 0's step 20, no owner or backup to say which: refused.
    h = copies[0]
    stale = {**joins[h].items, item: digest(item, "abandoned")}
    joins[h] = NodeInventory(h, joins[h].address, stale)
    plan = plan_round(config, joins, {})
    assert plan is not None
    assert plan.step == 10
    # A committed backup settles it: the agreeing copy and the backup are used.
    plan = plan_round(config, joins, {20: backup(config, 20, [0])})
    assert plan is not None
    assert plan.step == 20
    assert {(f.source, f.holder) for f in plan.sources[item]} == {(P, copies[1]), (B, None)}


# --- load spreading ------------------------------------------------------------------------------


def brute_force_max_load(
    requests: Mapping[ItemId, list[int]], base: Mapping[int, int] | None = None
) -> int:
    keys = sorted(requests)
    best = math.inf
    for choice in itertools.product(*(requests[k] for k in keys)):
        best = min(best, max((Counter(choice) + Counter(base or {})).values(), default=0))
    return int(best)


def req(n: int) -> ItemId:
    return ItemId(JOB, 1, n, 0)


def test_balance_avoids_the_greedy_trap() -> None:
    # Naive greedy in item order gives both to rank 2 (ties by rank); the optimum splits.
    assert balance({req(0): [2, 3], req(1): [2]}) == {req(0): 3, req(1): 2}
    # A chain only an alternating path fixes: 2 serves a and b, 3 is free via b -> c.
    got = balance({req(0): [2], req(1): [2, 4], req(2): [4, 3], req(3): [2]})
    assert max(Counter(got.values()).values()) == 2
    assert all(got[r] in h for r, h in {req(1): [2, 4], req(2): [4, 3]}.items())


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 6).map(req),
        st.sets(st.integers(0, 3), min_size=1).map(sorted),
        max_size=7,
    )
)
def test_balance_is_optimal(requests: dict[ItemId, list[int]]) -> None:
    got = balance(requests)
    assert set(got) == set(requests)
    assert all(got[r] in requests[r] for r in requests)
    loads = Counter(got.values())
    assert max(loads.values(), default=0) == brute_force_max_load(requests)
    # Symmetric demand: nobody serves more than its share.
    holder_sets = {tuple(h) for h in requests.values()}
    if len(holder_sets) == 1:
        (shared,) = holder_sets
        assert max(loads.values()) <= math.ceil(len(requests) / len(shared))
    assert balance(dict(reversed(list(requests.items())))) == got  # order does not matter


def test_plan_spreads_peer_fetches_over_holders() -> None:
    # 6 nodes, ranks 0-2 wiped; every other rank holds copies of all three.
    config = cfg(nodes=6, ppn=0)
    joins = {r: inventory(r, []) for r in range(3)}
    for r in range(3, 6):
        joins[r] = inventory(
            r, [i for x in range(6) for i in items_of(config, 20, x) if x == r or x < 3]
        )
    plan = plan_round(config, joins, {})
    assert plan is not None
    assert plan.load() == {3: 1, 4: 1, 5: 1}
    for r in range(3):
        (sources,) = plan.for_rank(r).values()
        assert [f.source for f in sources] == [P, P, P]
        # Fallbacks are the other holders, least loaded then lowest rank.
        assert sorted(f.holder for f in sources[1:]) == sorted({3, 4, 5} - {sources[0].holder})


# --- fan-out: one download per backup object, the other ranks pull it ----------------------------


def assert_fanned_out(plan: RoundPlan) -> None:
    """Each backup object that is some ranks' first choice is downloaded by exactly one of
    them (its owner when among them, else the lowest); the others' first choices lead up a
    tree to that rank, and no holder serves one object to more than ``FAN_OUT`` of them."""
    groups: dict[Fetch, dict[int, Fetch]] = {}
    for target, sources in plan.sources.items():
        own = next(f for f in sources if not f.pending)
        if own.source is B and (sources[0].pending or sources[0] == own):
            obj = dataclasses.replace(own, equivalent=False)
            groups.setdefault(obj, {})[target.rank] = sources[0]
    for obj, firsts_ in groups.items():
        downloaders = [r for r, f in firsts_.items() if not f.pending]
        assert len(downloaders) == 1, (obj, firsts_)
        (root,) = downloaders
        assert root == (obj.item.rank if obj.item.rank in firsts_ else min(firsts_))
        served = Counter(f.holder for f in firsts_.values() if f.pending)
        assert max(served.values(), default=0) <= FAN_OUT
        for start in firsts_:
            rank, seen = start, {start}
            while firsts_[rank].pending:
                rank = firsts_[rank].holder or 0
                assert rank in firsts_
                assert rank not in seen  # up the tree, never round
                seen.add(rank)
            assert rank == root


def wiped_dp(nodes: int, dp: int, workers: int = 1) -> tuple[JobConfig, RoundPlan]:
    config = cfg(nodes, ppn=0, dp=dp, framework=Framework.PYTORCH, workers=workers)
    joins = healthy(config, (20,), wiped=range(nodes))
    plan = plan_round(config, joins, {20: backup(config, 20)})
    assert plan is not None
    assert plan.step == 20
    return config, plan


@pytest.mark.parametrize(("nodes", "workers"), [(4, 1), (8, 1), (8, 2)])
def test_fan_out_downloads_each_backup_object_once_with_four_replicas(
    nodes: int, workers: int
) -> None:
    config, plan = wiped_dp(nodes, dp=4, workers=workers)
    stride = config.nodes_per_replica
    downloads = [s[0] for s in plan.sources.values() if s[0].source is B]
    # Replica 0 uploaded: one download per item it holds, by its owner, not four.
    assert sorted(f.item for f in downloads) == sorted(
        i for r in range(stride) for i in items_of(config, 20, r)
    )
    assert all(not f.equivalent for f in downloads)
    for target, sources in plan.sources.items():
        obj = dataclasses.replace(target, rank=target.rank % stride)
        if target.rank < stride:
            # The downloader: the backup, then (should it fail) the first puller's copy.
            assert [(f.source, f.holder, f.pending) for f in sources] == [
                (B, None, False),
                (P, target.rank + stride, True),
            ]
        else:
            # A puller: the downloader (pending), then the backup object itself.
            assert sources == (
                Fetch(P, obj, obj.rank, digest(obj), equivalent=True, pending=True),
                Fetch(B, obj, None, digest(obj), equivalent=True),
            )
        assert plan.restore_source(target.rank) is B  # the bytes come from the bucket
    # replicas - 1 pulls per item it downloads
    assert plan.load() == {r: 3 * len(worker_slots(config)) for r in range(stride)}
    assert_fanned_out(plan)


def test_fan_out_beyond_fan_out_ranks_is_a_tree_with_ancestors_as_fallbacks() -> None:
    _, plan = wiped_dp(10, dp=10)
    chains = {t.rank: [f.holder for f in s if f.pending] for t, s in plan.sources.items()}
    # Heap order with FAN_OUT children: 0 serves 1-4, 1 serves 5-8, 2 serves 9.
    assert FAN_OUT == 4
    assert chains == {
        0: [1],
        **{r: [0] for r in range(1, 5)},
        **{r: [1, 0] for r in range(5, 9)},
        9: [2, 0],
    }
    assert max(plan.load().values()) == FAN_OUT
    assert_fanned_out(plan)


def test_fan_out_downloader_is_the_lowest_rank_when_the_owner_needs_another_object() -> None:
    config = cfg(4, ppn=0, dp=4)
    joins = healthy(config, (20,), wiped=range(4))
    item = {r: ItemId(JOB, 20, r, 0) for r in range(4)}
    exclude = {
        SourceKey(None, item[0], 0),
        SourceKey(None, item[2], 2),
        SourceKey(None, item[3], 3),
    }
    plan = plan_round(config, joins, {20: backup(config, 20, range(4))}, exclude=exclude)
    assert plan is not None
    assert firsts(plan) == {
        0: (P, 1, 1, True),  # object 1: its owner 1 downloads, 0 pulls
        1: (B, None, 1, False),
        2: (B, None, 0, True),  # object 0: its owner wants object 1, so the lowest, 2
        3: (P, 2, 0, True),
    }
    assert_fanned_out(plan)


def test_fan_out_leaves_partial_loss_and_single_downloads_alone() -> None:
    # One replica wiped: its ranks pull live equivalents, nothing is pending.
    config = cfg(8, ppn=0, dp=4)
    plan = plan_round(config, healthy(config, (20,), wiped=(2, 3)), {20: backup(config, 20)})
    assert plan is not None
    assert not any(f.pending for s in plan.sources.values() for f in s)
    assert firsts(plan)[2] == (P, 0, 0, True)
    assert firsts(plan)[3] == (P, 1, 1, True)
    # Every rank's own item in the backup: four objects, four downloads, no pulls.
    plan = plan_round(
        config, healthy(config, (20,), wiped=range(8)), {20: backup(config, 20, range(8))}
    )
    assert plan is not None
    assert all(s[0].source is B and not s[0].equivalent for s in plan.sources.values())
    assert not any(f.pending for s in plan.sources.values() for f in s)


def test_balance_counts_fixed_load() -> None:
    # Holder 2 already relays two pulls: the free request goes to 3 although 2 is lower.
    assert balance({req(0): [2, 3]}, {2: 2}) == {req(0): 3}
    assert balance({req(0): [2, 3], req(1): [3]}, {2: 1}) == {req(0): 2, req(1): 3}


# --- the property: every plan is sound, complete and newest ---------------------------------------


@st.composite
def rounds(
    draw: st.DrawFn,
) -> tuple[JobConfig, dict[int, NodeInventory], dict[int, CommitRecord], set[SourceKey]]:
    nodes = draw(st.integers(1, 5))
    dp = draw(st.sampled_from([None] + [d for d in range(1, nodes + 1) if nodes % d == 0]))
    framework = draw(st.sampled_from(list(Framework)))
    config = cfg(nodes, ppn=0, dp=dp, framework=framework, workers=draw(st.integers(1, 2)))
    any_item = st.builds(
        ItemId,
        job=st.sampled_from([JOB, JOB, "other"]),
        step=st.integers(1, 3),
        rank=st.integers(0, nodes),
        worker=st.integers(0, 2),
    )
    live = draw(st.sets(st.integers(0, nodes - 1)))
    joins = {r: inventory(r, draw(st.sets(any_item, max_size=12))) for r in sorted(live)}
    backups = {}
    for step in draw(st.sets(st.integers(1, 3))):
        ranks = draw(st.sets(st.integers(0, nodes - 1)))
        backups[step] = backup(config, step, ranks)
    backed_up = {
        SourceKey(None, ItemId(JOB, s, int(r), int(w)))
        for s, b in backups.items()
        for r, _, w in (k.partition("-") for k in b.items)
    }
    pool = sorted(
        {SourceKey(h, i) for h, inv in joins.items() for i in inv.items} | backed_up,
        key=lambda k: (k.holder is not None, k.holder or 0, k.item),
    )
    exclude = set(draw(st.lists(st.sampled_from(pool), max_size=4))) if pool else set()
    return config, joins, backups, exclude


def oracle_sources(
    config: JobConfig,
    joins: Mapping[int, NodeInventory],
    backups: Mapping[int, CommitRecord],
    exclude: Collection[SourceKey],
    target: ItemId,
) -> set[Fetch]:
    """Every valid source of ``target``, straight from the definitions (digests all agree)."""
    found = set()
    for e in [target.rank, *config.equivalent_ranks(target.rank)]:
        item = dataclasses.replace(target, rank=e)
        equivalent = e != target.rank
        for h, inv in joins.items():
            if item in inv.items and SourceKey(h, item) not in exclude:
                source = L if h == target.rank else P
                found.add(Fetch(source, item, h, inv.items[item], equivalent))
        record = backups.get(target.step)
        if record is not None and record.has(item) and SourceKey(None, item) not in exclude:
            found.add(Fetch(B, item, None, record.items[item.key], equivalent))
    return found


@settings(max_examples=400, deadline=None)
@given(rounds())
def test_plan_round_property(
    case: tuple[JobConfig, dict[int, NodeInventory], dict[int, CommitRecord], set[SourceKey]],
) -> None:
    config, joins, backups, exclude = case
    plan = plan_round(config, joins, backups, exclude=exclude)

    def targets(step: int) -> list[ItemId]:
        return [i for r in range(config.nodes) for i in items_of(config, step, r)]

    steps = {i.step for inv in joins.values() for i in inv.items if i.job == JOB} | set(backups)
    restorable = sorted(
        (
            s
            for s in steps
            if all(oracle_sources(config, joins, backups, exclude, t) for t in targets(s))
        ),
        reverse=True,
    )
    assert restorable_steps(config, joins, backups, exclude=exclude) == restorable
    if not restorable:
        assert plan is None
        return
    assert plan is not None
    assert plan.step == restorable[0]  # the newest restorable step, never a newer one
    assert plan.candidates == tuple(restorable)
    assert set(plan.sources) == set(targets(plan.step))
    requests: dict[ItemId, list[int]] = {}
    relayed: Counter[int] = Counter()
    for target, all_sources in plan.sources.items():
        # Pending pulls (fan-out) come first, or last for the downloader; the rest are
        # exactly the copies that hold the item, none excluded (sound and complete).
        sources = tuple(f for f in all_sources if not f.pending)
        pulls = [f for f in all_sources if f.pending]
        assert list(all_sources) in (
            [*pulls, *sources],
            [*sources, *pulls],
        )
        assert all(f.source is P and f.holder not in (None, target.rank) for f in pulls)
        if pulls and all_sources[0].pending:
            assert sources[0].source is B
            assert {f.item for f in pulls} == {sources[0].item}
            relayed[pulls[0].holder or 0] += 1
        assert len(set(sources)) == len(sources)
        assert set(sources) == oracle_sources(config, joins, backups, exclude, target)
        tiers = [TIER[f.source, f.equivalent] for f in sources]
        assert tiers == sorted(tiers)
        if config.data_parallelism is None:
            assert not any(f.equivalent for f in sources)
        own = joins.get(target.rank)
        if (
            own is not None
            and target in own.items
            and SourceKey(target.rank, target) not in exclude
        ):
            assert sources[0] == Fetch(L, target, target.rank, digest(target))
        if tiers[0] in (1, 3):
            requests[target] = sorted(
                {
                    f.holder
                    for f in sources
                    if TIER[f.source, f.equivalent] == tiers[0] and f.holder is not None
                }
            )
    # First choices among peers are spread as evenly as the copies allow.
    if requests and math.prod(len(h) for h in requests.values()) <= 4096:
        assert max(plan.load().values()) == brute_force_max_load(requests, relayed)
    assert_fanned_out(plan)


# --- a one-node job: the same round plans its restore ------------------------------------------
# (These replace the tests of the one-node planner that restore used to have besides rounds.)

ONE = cfg(nodes=1)


def one(step: int, worker: int = 0) -> ItemId:
    return ItemId(JOB, step, 0, worker)


def commit_of(step: int, *items: ItemId) -> CommitRecord:
    return CommitRecord(JOB, step, {i.key: digest(i) for i in items}, created=0.0)


def test_one_node_newest_step_first_and_local_before_backup() -> None:
    local = {0: inventory(0, [one(10), one(30), one(20)])}
    backups = {20: commit_of(20, one(20)), 40: commit_of(40, one(40))}
    plan = plan_round(ONE, local, backups)
    assert plan is not None
    assert plan.step == 40
    assert plan.candidates == (40, 30, 20, 10)
    assert [f.source for f in plan.sources[one(40)]] == [Source.BACKUP]
    both = plan_round(ONE, local, backups, only_step=20)
    assert both is not None
    assert [f.source for f in both.sources[one(20)]] == [Source.LOCAL, Source.BACKUP]
    # A failed source costs that source, then the step: never a wrong restore.
    older = plan_round(ONE, local, backups, exclude={SourceKey(None, one(40))})
    assert older is not None
    assert older.step == 30
    assert [f.source for f in older.sources[one(30)]] == [Source.LOCAL]


def test_one_node_nothing_to_restore() -> None:
    assert plan_round(ONE, {0: inventory(0, [])}, {}) is None
    # Another job's items are not this job's checkpoint.
    other = NodeInventory(0, "x:1", {ItemId("other", 6, 0, 0): digest(one(6))})
    assert plan_round(ONE, {0: other}, {}) is None


def test_one_node_backup_without_this_rank_is_skipped() -> None:
    backups = {
        7: CommitRecord(JOB, 7, {"1-0": digest(one(7))}, created=0.0),
        8: commit_of(8, one(8)),
    }
    plan = plan_round(ONE, {0: inventory(0, [])}, backups)
    assert plan is not None
    assert plan.candidates == (8,)


def test_one_node_save_job_needs_every_worker() -> None:
    save = cfg(nodes=1, framework=Framework.PYTORCH, workers=2)
    local = {0: inventory(0, [one(10, 0), one(10, 1), one(20, 0), one(30, 1)])}
    backups = {
        30: commit_of(30, one(30, 0)),  # covers worker 0 of step 30; worker 1 is local
        40: commit_of(40, one(40, 0)),  # worker 1 of step 40 is nowhere
        50: commit_of(50, one(50, 0), one(50, 1)),
    }
    plan = plan_round(save, local, backups)
    assert plan is not None
    assert plan.candidates == (50, 30, 10)
    assert set(plan.sources) == {one(50, 0), one(50, 1)}
    at30 = plan_round(save, local, backups, only_step=30)
    assert at30 is not None
    assert [f.source for f in at30.sources[one(30, 0)]] == [Source.BACKUP]
    assert [f.source for f in at30.sources[one(30, 1)]] == [Source.LOCAL]
    at10 = plan_round(save, local, backups, only_step=10)
    assert at10 is not None
    assert {t: [f.source for f in s] for t, s in at10.sources.items()} == {
        one(10, 0): [Source.LOCAL],
        one(10, 1): [Source.LOCAL],
    }


def test_one_node_step_dir_job_with_several_workers_needs_one_item() -> None:
    plan = plan_round(cfg(nodes=1, workers=4), {0: inventory(0, [one(3)])}, {})
    assert plan is not None
    assert plan.step == 3
    assert {t: [f.source for f in s] for t, s in plan.sources.items()} == {one(3): [Source.LOCAL]}


# --- steps passed over only by members' reports (issue 25, item 5) ------------------------------


def test_a_step_passed_over_only_by_a_members_reports_is_named_with_its_reporters() -> None:
    c = cfg()
    joins = healthy(c, (5, 10))
    target = ItemId(JOB, 10, 1, 0)
    plan = plan_round(c, joins, {})
    assert plan is not None
    # Rank 1 says every source of its step-10 item failed it: its word, for its restore.
    mine = [SourceKey(f.holder, f.item, restorer=1) for f in plan.sources[target]]
    older = plan_round(c, joins, {}, exclude=mine)
    assert older is not None
    assert older.step == 5
    assert passed_over_by_reports(c, joins, {}, mine, older.step) == PassedOver(10, (1,))
    # Copies ruled out for everyone (a corrupt copy, verified so) are not a report's doing.
    shared = [SourceKey(k.holder, k.item) for k in mine]
    assert plan_round(c, joins, {}, exclude=shared) == older
    assert passed_over_by_reports(c, joins, {}, shared, older.step) is None
    assert passed_over_by_reports(c, joins, {}, (), plan.step) is None
    # On a fresh start, the newest such step is named.
    step5 = [SourceKey(f.holder, f.item, restorer=1) for f in older.sources[ItemId(JOB, 5, 1, 0)]]
    assert plan_round(c, joins, {}, exclude=[*mine, *step5]) is None
    assert passed_over_by_reports(c, joins, {}, [*mine, *step5], None) == PassedOver(10, (1,))
