"""Cluster-wide facts of one job: the peer layout and steady-state progress (the
restorable step, who uploads backups, who has not joined the restore round).

Pure: no I/O, no clocks, no randomness, so every node computes the same layout from the
same config without talking to the others (docs/architecture.md, "Steady state across nodes"). The
restore round's plan lives in ``mtc_replicator.core.restore_plan``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import worker_slots

# --- the peer layout -----------------------------------------------------------------------


def _spread(n: int, count: int) -> list[int]:
    """``count`` indices into a sequence of ``n``, at the ends of ``count + 1`` equal parts.

    Index ``j * (n + 1) // (count + 1) - 1`` grows by at least one per ``j`` (the step is at
    least 1 because ``count <= n``), so the indices are distinct and in ``[0, n)``. Evenly
    spaced offsets send copies far along the ring: ranks close in number tend to be close in
    hardware (same rack, same slice), so far offsets are likelier to cross a failure domain.
    """
    assert 0 <= count <= n
    return [j * (n + 1) // (count + 1) - 1 for j in range(1, count + 1)]


def peer_offsets(config: JobConfig) -> tuple[int, ...]:
    """Ring offsets of the computed layout: rank ``r`` picks ``(r + o) % nodes`` for each ``o``.

    The same offsets for every rank make the layout a circulant graph, so each rank receives
    exactly as many copies as it sends (memory stays even across nodes), and no offset is 0
    or a multiple of ``nodes`` (never self). Equivalent ranks sit at multiples of
    ``nodes_per_replica``; with data parallelism they come first (docs/protocol.md,
    "Peer choice"), the rest are spread over the non-equivalent offsets. Without data parallelism
    ``nodes_per_replica == nodes``, so there are no equivalent offsets.
    """
    count = min(config.peers_per_node, config.nodes - 1)
    if count <= 0:
        return ()
    stride = config.nodes_per_replica
    replicas = config.nodes // stride
    # Equivalent offsets are stride, 2*stride, ...; index i -> (i + 1) * stride.
    if count <= replicas - 1:
        return tuple((i + 1) * stride for i in _spread(replicas - 1, count))
    equivalents = [(i + 1) * stride for i in range(replicas - 1)]
    # The i-th offset in [1, nodes) that is not a multiple of stride (stride >= 2 here,
    # since count > replicas - 1 means some non-equivalent offset exists).
    others = config.nodes - replicas
    rest = [
        (i // (stride - 1)) * stride + i % (stride - 1) + 1
        for i in _spread(others, count - len(equivalents))
    ]
    return (*equivalents, *rest)


def choose_peers(config: JobConfig) -> tuple[int, ...]:
    """The ranks this node's layout names as its peers, in order of preference.

    ``peer-ranks`` wins when given (Orbax writes the equivalent ranks there). Otherwise
    ``min(peers-per-node, nodes - 1)`` ranks from ``peer_offsets``: deterministic, never
    self, unique, and balanced so that every rank is chosen by exactly as many others.
    """
    if config.peer_ranks:
        return config.peer_ranks
    n, r = config.nodes, config.node_rank
    return tuple((r + o) % n for o in peer_offsets(config))


def replication_targets(config: JobConfig) -> tuple[int, ...]:
    """The peers this node pushes byte-for-byte copies of its items to.

    With data parallelism a peer that is an equivalent rank already holds an equivalent
    checkpoint of its own, which restores this rank as well as a copy would and fails with
    the same node; copying to it costs memory and bandwidth for nothing (docs/protocol.md,
    "Data parallelism"). So equivalents stay in the layout (they are where a lost rank restores
    from) but receive no pushes.
    """
    equivalent = set(config.equivalent_ranks(config.node_rank))
    return tuple(p for p in choose_peers(config) if p not in equivalent)


def _push_offsets(config: JobConfig) -> tuple[int, ...]:
    return tuple(o for o in peer_offsets(config) if o % config.nodes_per_replica != 0)


@dataclass(frozen=True)
class Holders:
    """Who keeps a copy of one rank's checkpoint besides the rank itself."""

    copies: tuple[int, ...]
    """Ranks that receive a byte-for-byte copy of the rank's items (its replication targets)."""
    equivalents: tuple[int, ...]
    """Ranks whose own items are data-parallel equivalents (empty without parallelism)."""


def holders(config: JobConfig, rank: int) -> Holders:
    """Where copies of ``rank``'s items live in steady state, by the layout.

    Explicit ``peer-ranks`` are per node and only this node's list is in ``config``, so for
    another rank they are unknown here: the coordinator plans restores from inventories,
    never from this. Raises ``ValueError`` in that case.
    """
    _check_rank(config, rank)
    if config.peer_ranks:
        if rank != config.node_rank:
            raise ValueError(
                f"job {config.job_name}: rank {rank}'s peer-ranks are in its own "
                "replicator.yaml, not this one"
            )
        copies = replication_targets(config)
    else:
        copies = tuple((rank + o) % config.nodes for o in _push_offsets(config))
    return Holders(copies, config.equivalent_ranks(rank))


def off_node_copies(config: JobConfig) -> int:
    """How many other nodes hold this node's rank's steps in steady state: its replication
    targets and its data-parallel equivalents. 0: a lost node loses every step not yet in the
    backup."""
    own = holders(config, config.node_rank)
    return len(own.copies) + len(own.equivalents)


def no_copy_note(config: JobConfig) -> str | None:
    """What a multi-node job is told, once per incarnation, when no other node holds its
    steps; None when one does, or when the job has one node (nothing to choose)."""
    if config.nodes == 1 or off_node_copies(config) > 0:
        return None
    return (
        f"job {config.job_name} rank {config.node_rank}: no other node holds a copy of this "
        "rank's steps (no peer-ranks, peers-per-node: 0, no data-parallel replica): if this "
        "node is lost, every rank of the job restores the backup's newest step and the steps "
        "saved since are lost; set peers-per-node: 1 to keep a copy on a peer"
    )


def pushers(config: JobConfig, rank: int) -> tuple[int, ...]:
    """Ranks that push copies of their items to ``rank`` (the inverse of ``holders``).

    A receiver uses it to tell an expected push from a stray one. Only defined for the
    computed layout; explicit ``peer-ranks`` raise ``ValueError`` as in ``holders``.
    """
    _check_rank(config, rank)
    if config.peer_ranks:
        raise ValueError(
            f"job {config.job_name}: with explicit peer-ranks each node knows only its own peers"
        )
    return tuple((rank - o) % config.nodes for o in _push_offsets(config))


def _check_rank(config: JobConfig, rank: int) -> None:
    if not 0 <= rank < config.nodes:
        raise ValueError(f"job {config.job_name}: rank {rank} is not in [0, {config.nodes})")


# --- steady state ----------------------------------------------------------------------------


def restorable_step(
    config: JobConfig,
    reported: Mapping[int, int | None],
    held: Mapping[int, frozenset[int]] | None = None,
) -> int | None:
    """The cluster's restorable step: the newest step complete on every rank.

    ``reported`` maps each rank to its newest step committed locally and on its replication
    targets. Every rank saves the same steps, so the oldest of those newest steps is
    complete everywhere, provided ranks keep it: agents must pass this step to
    ``planner.retention`` as protected. ``held`` maps ranks to the steps they promised to
    keep (a rank missing from it keeps every step): the answer is then the newest step at
    most that oldest one which every rank promised. None while any rank has none or has
    not reported, or no step qualifies.
    """
    newest = [reported.get(r) for r in range(config.nodes)]
    if any(s is None for s in newest):
        return None
    bound = min(s for s in newest if s is not None)
    promises = [held[r] for r in range(config.nodes) if held is not None and r in held]
    if not promises:
        return bound
    common = frozenset.intersection(*promises)
    return max((s for s in common if s <= bound), default=None)


def backup_uploaders(config: JobConfig) -> frozenset[int]:
    """Ranks that upload their items for a backup: one per equivalence class.

    Equivalent items restore each other, so one replica's upload backs up every replica
    (docs/protocol.md, "Data parallelism"): replica 0, the ranks below ``nodes_per_replica``,
    always the same so that a restore from backup knows where to look. Without data
    parallelism that is every rank.
    """
    return frozenset(range(config.nodes_per_replica))


def backup_items(config: JobConfig, step: int) -> list[ItemId]:
    """The items a COMMIT of ``step`` must list (``BackupStore.try_commit``'s keys)."""
    return [
        ItemId(config.job_name, step, r, w)
        for r in sorted(backup_uploaders(config))
        for w in worker_slots(config)
    ]


# --- who is missing --------------------------------------------------------------------------

_MAX_RANGES_SHOWN = 16


def missing_ranks(config: JobConfig, joined: Collection[int]) -> list[int]:
    """Ranks of the job that have not joined, ascending."""
    have = set(joined)
    return [r for r in range(config.nodes) if r not in have]


def format_ranks(ranks: Iterable[int]) -> str:
    """``3, 5-9, 12``: runs collapsed, bounded so that a line stays readable at any scale."""
    ordered = sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    for r in ordered:
        if runs and runs[-1][1] == r - 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    shown = [str(a) if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    text = ", ".join(shown[:_MAX_RANGES_SHOWN])
    if len(shown) > _MAX_RANGES_SHOWN:
        text += f" and {len(ordered) - sum(b - a + 1 for a, b in runs[:_MAX_RANGES_SHOWN])} more"
    return text


def waiting_message(config: JobConfig, missing: Collection[int]) -> str:
    """One ``replicator.errors`` line naming the ranks a restore round is waiting for."""
    word = "rank" if len(missing) == 1 else "ranks"
    joined = config.nodes - len(missing)
    return (
        f"waiting for {word} {format_ranks(missing)} of job {config.job_name} to join the "
        f"restore round ({joined} of {config.nodes} joined)"
    )
