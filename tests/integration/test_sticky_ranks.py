"""Sticky ranks on 8 real daemons (mutual TLS, per-node certificates): a job saved step 5,
then restarts with its pods on the nodes in a random order, three times in one run.

- Pods keep their index (what a JobSet does on its own): only the ranks whose node happens
  to hold their bytes (their own or a peer's copy) restore locally, the rest pull.
- Ranks chosen where the bytes are (the controller's code: each daemon asked what it holds,
  ``core.ranks``): every rank restores from its own node.
- One node replaced (its RAM disk and store gone): every rank but one restores locally; the
  one left pulls from a peer.

Each restore hands every rank the bytes it saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, running
from tests.integration.helpers import read_tree
from tests.integration.permuted import by_index, placement, restart, sticky

pytestmark = pytest.mark.integration
NODES = 8


@pytest.fixture
def cluster8(tmp_path: Path, job: str) -> Iterator[Cluster]:
    with running(Cluster(tmp_path, job, nodes=NODES)) as c:
        yield c


def _check_bytes(
    cluster: Cluster, ranks: dict[int, int], files: dict[int, dict[str, bytes]]
) -> None:
    for node, rank in ranks.items():
        marker = cluster.dirs[node] / f"{cluster.job}-s5-n{rank}-w0.restore"
        assert read_tree(marker) == files[rank], f"node {node} (rank {rank}) restored other bytes"


def test_a_permuted_restart_restores_every_rank_from_its_own_node(cluster8: Cluster) -> None:
    c = cluster8
    c.fresh_start()
    files = c.save(5)

    # Without sticky ranks: a placement where few pods sit next to their bytes.
    placed = placement(NODES, seed=11)
    plain = restart(c, by_index(placed), 5)
    _check_bytes(c, dict(plain.ranks), files)
    print(f"by index: {plain.local}/{NODES} local in {plain.seconds:.2f}s {dict(plain.sources)}")
    assert plain.local < NODES // 2

    # With them: another random placement, every rank local.
    placed = placement(NODES, seed=12)
    ranks = sticky(c, placed, c.tls[0].material() if c.tls[0] else None)
    assert sorted(ranks.values()) == list(range(NODES))
    kept = restart(c, ranks, 5)
    _check_bytes(c, ranks, files)
    print(f"sticky: {kept.local}/{NODES} local in {kept.seconds:.2f}s {dict(kept.sources)}")
    assert kept.local == NODES, kept.sources

    # One node replaced: its RAM disk and store are gone; all but its pod restore locally.
    c.wipe(3)
    placed = placement(NODES, seed=13)
    ranks = sticky(c, placed, c.tls[0].material() if c.tls[0] else None)
    again = restart(c, ranks, 5)
    _check_bytes(c, ranks, files)
    print(f"one replaced: {again.local}/{NODES} local {dict(again.sources)}")
    assert again.local == NODES - 1, again.sources
    assert again.sources[3] == "peer"
