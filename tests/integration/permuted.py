"""A job's restart with its pods placed on the nodes in a random order, on a cluster of real
daemons (``tests.integration.cluster``): each node's daemon is handed the rank its pod takes,
and the restore round says where each rank's bytes came from.

Two ways to choose a pod's rank: its index (what a JobSet or Indexed Job does on its own),
or sticky ranks: the controller's code (``controller.sticky.Replicators.holdings`` asks each
node's daemon what it holds over ``mtc.v1.Node/Status``; ``core.ranks.assign`` matches pods
to the ranks their nodes hold). Shared by ``tests/integration/test_sticky_ranks.py`` and
``scripts/bench_ranks.py``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mtc_replicator.controller.sticky import Replicators
from mtc_replicator.core.ranks import Pod, assign
from mtc_replicator.transport.tls import TlsMaterial
from tests.integration.cluster import Cluster
from tests.integration.helpers import config_text, read_prerestore, wait_until, write_yaml_atomic


@dataclass(frozen=True)
class Restart:
    ranks: Mapping[int, int]
    """Node -> the rank its pod took."""
    sources: Mapping[int, str]
    """Node -> where its rank's step came from: local, peer or backup."""
    seconds: float
    """From the first ``replicator.yaml`` to the last marker."""

    @property
    def local(self) -> int:
        return sum(1 for s in self.sources.values() if s == "local")


def placement(nodes: int, seed: int) -> list[int]:
    """Pod ``i`` (index ``i``) lands on node ``placement[i]``: a random permutation."""
    order = list(range(nodes))
    random.Random(seed).shuffle(order)
    return order


def by_index(placed: list[int]) -> dict[int, int]:
    """Node -> rank when each pod keeps its index."""
    return {node: i for i, node in enumerate(placed)}


def sticky(cluster: Cluster, placed: list[int], tls: TlsMaterial | None = None) -> dict[int, int]:
    """Node -> rank as the controller assigns them: from what each node's daemon holds."""
    replicators = Replicators(tls)
    held = {
        f"node{n}": replicators.holdings(cluster.daemon(n).address, cluster.job)
        for n in range(cluster.nodes)
    }
    pods = [Pod(f"pod-{i}", i, f"node{node}") for i, node in enumerate(placed)]
    a = assign(pods, held, cluster.nodes)
    return {node: a.ranks[f"pod-{i}"] for i, node in enumerate(placed)}


def restart(cluster: Cluster, ranks: Mapping[int, int], step: int) -> Restart:
    """Every node's daemon gets the handshake of its pod's rank; the round's outcome."""
    job = cluster.job
    t0 = time.monotonic()
    for node, rank in ranks.items():
        text = config_text(job, rank=rank, nodes=cluster.nodes, **cluster.keys)
        write_yaml_atomic(cluster.dirs[node], text)
    for node, rank in ranks.items():
        want = [f"{job}-s{step}-n{rank}-w0.restore"]
        wait_until(
            lambda node=node, want=want: cluster.markers(node) == want,
            f"node {node}'s marker {want}",
            daemon=cluster.daemon(node),
            timeout=90,
        )
    seconds = time.monotonic() - t0
    sources = {n: str(read_prerestore(cluster.dirs[n])["restore-source"]) for n in ranks}
    return Restart(dict(ranks), sources, seconds)
