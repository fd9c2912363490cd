"""Pool copies: a one-node job's steps on another node of the pool. Pure: no I/O.

A one-node job (a Ray Tune trial of one worker) has no peer ranks, so before pool copies
its steps lived on its node's RAM disk and in the bucket only, and a trial that Tune
restarted on another node waited for the bucket. Now every daemon with a registry
announces itself in it (``cluster.pool``), and a one-node job in a job directory pushes
each item it saves to one other node of the pool, chosen here by rendezvous hashing of
the job's name over the nodes of the job's owner: the choice spreads jobs evenly over the
pool, and a node that joins or leaves moves only the jobs it wins or held. A restart on
any node asks the first ``CANDIDATES`` nodes of the same ranking (one of them is the
holder, whichever node produced the steps) before the round plans, so the newest step
comes from a RAM disk when one still holds it (docs/architecture.md, "Pool copies").

The holder takes such a push only as a pool copy (``admit_pool_copy``): rank 0, of a job
that does not run on it, from the node that produced it, within the step bound; it keeps
the job's newest ``POOL_KEEP_STEPS`` steps, and the copies give way as any other job's
items that do not run here (``core.foreign``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from mtc_replicator.core.admission import (
    ACCEPT,
    MAX_STEP_LEAD,
    Admission,
    Verdict,
    step_limit,
)
from mtc_replicator.core.manifest import ItemId

POOL_KEEP_STEPS = 2
"""Steps of a job a holder keeps: the newest, and the one before while the newest may
still be arriving worker by worker."""
CANDIDATES = 2
"""Nodes a restart asks for a job's pool copies: the holder is the first of the ranking
that is not the producer, so one of the first two whoever produced the steps."""
ANNOUNCE_SECONDS = 120.0
"""How often a daemon renews its pool entry."""
MEMBER_TTL_SECONDS = 600.0
"""An entry older than this is a node that left the pool (stopped, or lost)."""


@dataclass(frozen=True)
class PoolMember:
    """One node of the pool, as its signed entry says."""

    node: str
    """Its name (its certificate's; its address without TLS)."""
    address: str
    """Where its peer service listens."""
    owner: str
    """The namespace its RAM disk serves now (``core.ownership``; "" unowned): a job's
    copies go only to nodes of the job's owner."""
    announced_at: float


def _weight(job: str, node: str) -> bytes:
    return hashlib.blake2b(f"{job}\0{node}".encode(), digest_size=16).digest()


def ranking(job: str, nodes: Iterable[str]) -> list[str]:
    """``nodes`` in ``job``'s rendezvous order: highest weight first, the same on every
    node that sees the same nodes."""
    return sorted(set(nodes), key=lambda n: _weight(job, n), reverse=True)


def holder_for(job: str, producer: str, nodes: Iterable[str]) -> str | None:
    """The node that holds ``job``'s pool copies while ``producer`` runs it: the first of
    the ranking of the job's owner's ``nodes`` other than the producer; None: none."""
    ranked = ranking(job, (n for n in nodes if n != producer))
    return ranked[0] if ranked else None


def candidates(job: str, me: str, nodes: Iterable[str], count: int = CANDIDATES) -> list[str]:
    """The nodes to ask for ``job``'s pool copies from ``me``: the first ``count`` of the
    ranking of the owner's ``nodes``, less this node (which holds what it holds locally)."""
    return [n for n in ranking(job, nodes)[:count] if n != me]


def admit_pool_copy(
    item: ItemId,
    *,
    runs_here: bool,
    newest_held: int | None,
    max_lead: int = MAX_STEP_LEAD,
) -> Admission:
    """May this node keep ``item`` as a pool copy? (The owner and producer are the
    manifest's attestation's, checked after: ``ManifestTrust.check``.)"""
    if runs_here:
        return Admission(
            Verdict.NOT_SERVED,
            f"{item}: job {item.job} runs on this node; its items come from its own trainer, "
            "not as pool copies",
        )
    if item.rank != 0:
        return Admission(
            Verdict.NOT_IN_JOB,
            f"{item}: a pool copy is an item of a one-node job, rank 0, not rank {item.rank}",
        )
    limit = step_limit(newest_held, max_lead)
    if item.step > limit:
        return Admission(
            Verdict.TOO_FAR_AHEAD,
            f"{item}: step {item.step} is more than {max_lead} steps ahead of the newest pool "
            f"copy of job {item.job} held here ({newest_held}); at most {limit} now",
        )
    return ACCEPT


def steps_past_keep(steps: Collection[int], keep: int = POOL_KEEP_STEPS) -> list[int]:
    """The steps of a job's pool copies to drop: all but the newest ``keep``."""
    return sorted(set(steps))[:-keep] if keep > 0 else sorted(set(steps))


def newest_complete(items: Iterable[ItemId], workers: Sequence[int]) -> int | None:
    """The newest step for which every one of ``workers`` has its rank-0 item in
    ``items``; None when no step is whole."""
    by_step: dict[int, set[int]] = {}
    for item in items:
        if item.rank == 0:
            by_step.setdefault(item.step, set()).add(item.worker)
    whole = [step for step, got in by_step.items() if set(workers) <= got]
    return max(whole, default=None)
