"""core.ranks: a restarted job's pods, placed on its nodes in a random order, each given a
rank its node holds, on jobs laid out as the daemons lay them out (core.layout)."""

from __future__ import annotations

import random
import time

import pytest

from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.layout import pushers
from mtc_replicator.core.ranks import Holdings, NoAssignment, Pod, assign, target_step


def holdings(
    nodes: int, steps: tuple[int, ...] = (40, 50), peers: int = 1
) -> dict[str, dict[int, set[int]]]:
    """What each node's store holds after a run: its own rank's steps and the steps of the
    ranks that push to it (``peers-per-node``), node ``node-r`` having run rank r."""
    config = JobConfig("j", Framework.PYTORCH, 0, nodes, peers_per_node=peers)
    out: dict[str, dict[int, set[int]]] = {}
    for r in range(nodes):
        held = {r, *(pushers(config, r) if nodes > 1 else ())}
        out[f"node-{r}"] = {h: set(steps) for h in held}
    return out


def placed(nodes: int, seed: int) -> list[Pod]:
    """The restarted job's pods: pod i (index i) on a node chosen by a random permutation."""
    order = [f"node-{r}" for r in range(nodes)]
    random.Random(seed).shuffle(order)
    return [Pod(f"pod-{i}", i, order[i]) for i in range(nodes)]


@pytest.mark.parametrize("nodes", [2, 8, 64, 512])
def test_a_permuted_restart_puts_every_rank_where_its_bytes_are(nodes: int) -> None:
    pods = placed(nodes, seed=nodes)
    a = assign(pods, holdings(nodes), nodes)
    assert a.step == 50
    assert a.local == nodes
    assert sorted(a.ranks.values()) == list(range(nodes))
    # Each pod's node holds the rank it got.
    held = holdings(nodes)
    assert all(a.ranks[p.name] in held[p.node] for p in pods)
    # Without it, a pod restores locally only where the permutation put it next to its
    # own bytes or a copy: about 2 in N with one peer.
    if nodes >= 64:
        assert a.by_index < nodes // 4


@pytest.mark.parametrize("nodes", [8, 64])
def test_with_one_node_replaced_every_rank_but_one_is_local(nodes: int) -> None:
    held = holdings(nodes)
    lost = "node-3"
    held[f"new-{lost}"] = {}
    del held[lost]
    pods = [
        Pod(p.name, p.index, f"new-{lost}" if p.node == lost else p.node) for p in placed(nodes, 7)
    ]
    a = assign(pods, held, nodes)
    assert a.step == 50  # rank 3's copy survives on the node it pushed to
    assert a.local == nodes - 1
    (newcomer,) = [p for p in pods if p.node == f"new-{lost}"]
    # The replaced node takes the rank no surviving node needs: one whose bytes are
    # elsewhere, pulled from its peer.
    assert a.ranks[newcomer.name] not in {a.ranks[p.name] for p in pods if p is not newcomer}


def test_a_pod_back_on_its_node_keeps_its_rank() -> None:
    pods = [Pod(f"pod-{i}", i, f"node-{i}") for i in range(16)]
    a = assign(pods, holdings(16), 16)
    assert a.ranks == {f"pod-{i}": i for i in range(16)}
    assert a.moved == 0
    assert (a.local, a.by_index) == (16, 16)


def test_a_fresh_job_keeps_the_indexes() -> None:
    pods = placed(8, 1)
    a = assign(pods, {}, 8)
    assert a.step is None
    assert a.ranks == {p.name: p.index for p in pods}
    assert (a.local, a.moved) == (0, 0)


def test_the_step_aimed_at_is_the_newest_whole_one() -> None:
    held: Holdings = {
        "a": {0: {10, 20}, 1: {10}},
        "b": {1: {10, 20, 30}},  # rank 0 has no step 30 anywhere
    }
    pods = [Pod("p0", 0, "b"), Pod("p1", 1, "a")]
    assert target_step(pods, held, 2) == 20
    a = assign(pods, held, 2)
    assert a.ranks == {"p0": 1, "p1": 0}
    assert a.local == 2
    # No step whole: the one most ranks are held at.
    assert target_step(pods, {"a": {0: {5}}, "b": {1: {9}, 2: {9}}}, 3) == 9
    # Holdings of other jobs' ranks (out of range) count for nothing.
    assert target_step(pods, {"a": {7: {99}}}, 2) is None


def test_an_augmenting_path_frees_a_rank_the_greedy_pass_took() -> None:
    # Pod 0 (index 0) can take 0 or 1, pod 1 only 0: greedy gives pod 0 rank 0, then an
    # augmenting path moves pod 0 to 1.
    held: Holdings = {"x": {0: {1}, 1: {1}}, "y": {0: {1}}}
    a = assign([Pod("p0", 0, "x"), Pod("p1", 1, "y")], held, 2)
    assert a.ranks == {"p0": 1, "p1": 0}
    assert a.local == 2


@pytest.mark.parametrize(
    ("pods", "why"),
    [
        ([Pod("a", 0, "n")], "1 pods for 2 ranks"),
        ([Pod("a", 0, "n"), Pod("b", 0, "m")], "both have index 0"),
        ([Pod("a", 0, "n"), Pod("b", 5, "m")], "outside 0..1"),
        ([Pod("a", 0, "n"), Pod("b", 1, "")], "on no node yet"),
    ],
)
def test_anything_but_one_pod_per_index_is_refused(pods: list[Pod], why: str) -> None:
    with pytest.raises(NoAssignment, match=why):
        assign(pods, holdings(2), 2)


def test_a_large_job_is_assigned_quickly() -> None:
    nodes = 4096
    pods = placed(nodes, 3)
    held = holdings(nodes, steps=(7,), peers=2)
    t0 = time.perf_counter()
    a = assign(pods, held, nodes)
    took = time.perf_counter() - t0
    assert a.local == nodes
    assert took < 5, took


def test_running_pods_keep_their_ranks_and_a_replacement_takes_the_rest() -> None:
    # A StatefulSet's pod 2 was replaced and landed on node-5, which holds rank 5 (kept by
    # the running pod there) and rank 4's copy: it takes the rank left free, whatever it holds.
    nodes = 8
    pods = [Pod(f"pod-{i}", i, f"node-{i}") for i in range(nodes)]
    pods[2] = Pod("pod-2b", 2, "node-9")
    fixed = {p.name: p.index for p in pods if p.name != "pod-2b"}
    held = holdings(nodes)
    a = assign(pods, held, nodes, fixed=fixed)
    assert {n: a.ranks[n] for n in fixed} == fixed
    assert a.ranks["pod-2b"] == 2
    assert a.local == nodes - 1
