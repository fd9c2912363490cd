"""Rank 0 moves to another node and back: the items made meanwhile are restored.

Ray Train renumbers nodes at every restart, so rank 0 (and with it the coordinator and its
record of which node held each rank, ``rank-holders/<job>.json``) can move to another node
and later come back. Four real daemons with per-node certificates: the job starts fresh
with node i as rank i and saves step 1; a restart rotates the ranks (node 3 runs rank 0,
node 0 rank 1, ...) and the job saves step 2, each item attested by the node that made it;
a restart rotates them back. Node 0's coordinator must not judge step 2 by the record it
kept from its own first tenure, which never saw node 3 hold rank 0: that refused every item
of step 2 ("produced by node 'node3', which never held rank 0 by step 2") and the job went
back to step 1. A node that stops running rank 0 forgets its record, so the coordinator
that comes back knows it does not know who made step 2, and every rank restores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.integration.cluster import NODES, Cluster, running
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_prerestore,
    store_root,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration

IDENTITY = {n: n for n in range(NODES)}
ROTATED = {n: (n + 1) % NODES for n in range(NODES)}
"""Node n runs rank n + 1: node 3 runs rank 0."""


def _start_incarnation(cluster: Cluster, placement: Mapping[int, int]) -> None:
    for node, rank in placement.items():
        for marker in cluster.dirs[node].glob("*.restore"):
            marker.unlink()
        text = config_text(cluster.job, rank=rank, nodes=NODES, **cluster.keys)
        write_yaml_atomic(cluster.dirs[node], text)


def _wait_markers(cluster: Cluster, placement: Mapping[int, int], step: int) -> None:
    for node, rank in placement.items():
        want = f"{cluster.job}-s{step}-n{rank}-w0.restore"
        wait_until(
            lambda node=node, want=want: (cluster.dirs[node] / want).exists(),
            f"node {node}'s marker {want}",
            daemon=cluster.daemon(node),
            timeout=60,
        )


def _save(cluster: Cluster, placement: Mapping[int, int], step: int) -> None:
    for node, rank in placement.items():
        make_step(cluster.dirs[node], step, payload(step, seed=f"rank{rank}"))
    for node, rank in placement.items():
        wait_until(
            lambda node=node, rank=rank: (step, f"{rank}-0") in cluster.held(node),
            f"node {node} committed rank {rank}'s step {step}",
            daemon=cluster.daemon(node),
        )
    wait_until(
        lambda: all(
            sum((step, f"{r}-0") in cluster.held(n) for n in range(NODES)) >= 2
            for r in range(NODES)
        ),
        f"a peer copy of every rank's step {step}",
        daemon=cluster.daemon(0),
    )


def test_items_made_while_rank0_was_elsewhere_are_restored_when_it_returns(
    tmp_path: Path,
) -> None:
    cluster = Cluster(tmp_path, "moves")
    with running(cluster):
        cluster.fresh_start()
        _save(cluster, IDENTITY, 1)
        assert (store_root(cluster.dirs[0]) / "rank-holders" / "moves.json").exists()

        _start_incarnation(cluster, ROTATED)
        _wait_markers(cluster, ROTATED, 1)
        _save(cluster, ROTATED, 2)

        _start_incarnation(cluster, IDENTITY)
        _wait_markers(cluster, IDENTITY, 2)
        for node in range(NODES):
            assert read_prerestore(cluster.dirs[node])["restore-step"] == 2
            assert "never held" not in cluster.errors(node)
