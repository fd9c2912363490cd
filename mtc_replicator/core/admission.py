"""Which pushed items a node takes: the pure admission check behind ``PushItem``.

Any node certificate of the CA can call any method and name any item, so a push is judged
by its item alone, against the job config this node serves now: only items of a rank that
the layout has push here (``layout.pushers``), never this node's own rank (a stray own
item would pass for a save and make retention drop the real ones), never a rank outside
the job, never a step far ahead of this rank's own newest step (retention keeps each
rank's newest copy, so a far-future copy would make it drop the real ones), and never in
place of a committed item. Pure: no I/O; ``transport.peer_servicer`` performs the verdicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.layout import pushers
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.policy import worker_slots

MAX_STEP_LEAD = 1_000_000
"""Default bound of how far a pushed step may be ahead of this rank's newest own step
(``--max-step-lead``). Every rank saves the same steps, so a legitimate push is ahead only
by the saves this node lags behind; the bound is that lag in steps, generously. A rank
with no step of its own yet counts from 0."""


INODE_RESERVE = 4096
"""Inodes an incoming item must leave free on the store's filesystem (or a sixteenth of
them when that is fewer): the job's next save needs some, and tmpfs counts them apart
from bytes (``nr_inodes``), so a push of many empty files passes every byte check."""


def inode_room(free: int, total: int, incoming: int, reserve: int = INODE_RESERVE) -> int | None:
    """Inodes one more incoming item may take: ``free`` (statvfs ``f_favail``) less the
    margin and less what pushes in flight (``incoming``) will still create; None when the
    filesystem has no fixed number of inodes (``total`` 0: btrfs, some overlays)."""
    if total <= 0:
        return None
    return free - min(reserve, total // 16) - incoming


class Verdict(StrEnum):
    """What to do with a push; the service maps each to its gRPC answer."""

    ACCEPT = "accept"
    ALREADY_HELD = "already-held"
    """The same item with the same digest is committed here: answered at once, no effect."""
    NOT_SERVED = "not-served"
    """This node serves no config of the item's job now (FAILED_PRECONDITION)."""
    NOT_IN_JOB = "not-in-job"
    """The job has no such item: rank >= nodes, or a worker without an item (INVALID_ARGUMENT)."""
    NOT_A_PUSHER = "not-a-pusher"
    """The item's rank does not push to this node: its own rank, or one the layout sends
    elsewhere (PERMISSION_DENIED)."""
    TOO_FAR_AHEAD = "too-far-ahead"
    """The step is beyond the bound of this rank's newest step (FAILED_PRECONDITION: a
    node that catches up takes it)."""
    CONFLICT = "conflict"
    """Another item with this id is committed here; it is never replaced (ALREADY_EXISTS)."""


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    reason: str = ""
    """For a refusal: the message the pusher gets."""

    @property
    def accepted(self) -> bool:
        return self.verdict is Verdict.ACCEPT


ACCEPT = Admission(Verdict.ACCEPT)


@dataclass(frozen=True)
class Served:
    """What the receiving node serves now, as far as admission needs it."""

    config: JobConfig
    newest_step: int | None
    """This rank's newest committed step of its own, None before its first. Never a pushed
    copy's step: pushes could then raise the bound step by step without limit."""
    owner: str = UNOWNED
    """The job's owner (``core.ownership``): a pushed item must be attested for it."""
    holders: Mapping[int, str] = field(default_factory=dict)
    """The node each pushing rank is bound to, as the coordinator last said
    (``core.rank_holders``); a rank not in it is admitted by the layout alone."""
    bound: bool = True
    """Whether those nodes are known here: a grant in force, or the coordinator answered
    once. False in a run's first seconds, when a push from a node is not taken yet."""


def expected_pushers(config: JobConfig) -> frozenset[int]:
    """Ranks whose copies this node (``config.node_rank``) receives.

    With explicit ``peer-ranks`` each node knows only its own peers, so any rank of the job
    may push here except this one and its data-parallel equivalents (which never push to
    each other: ``layout.replication_targets``).
    """
    own = config.node_rank
    if config.peer_ranks:
        skip = {own, *config.equivalent_ranks(own)}
        return frozenset(r for r in range(config.nodes) if r not in skip)
    return frozenset(pushers(config, own))


def step_limit(newest_step: int | None, max_lead: int = MAX_STEP_LEAD) -> int:
    """The newest step a push may carry, given this rank's newest own step."""
    return (newest_step or 0) + max_lead


def admit_push(
    served: Served | None,
    item: ItemId,
    *,
    max_lead: int = MAX_STEP_LEAD,
    pusher: str | None = None,
) -> Admission:
    """May this node take a push of ``item`` from ``pusher`` (the node its certificate
    names; None: not known, without TLS), before its manifest is read?"""
    if served is None or served.config.job_name != item.job:
        return Admission(
            Verdict.NOT_SERVED, f"this node does not take items of job {item.job!r} now"
        )
    config = served.config
    if not 0 <= item.rank < config.nodes:
        return Admission(
            Verdict.NOT_IN_JOB,
            f"{item}: rank {item.rank} is not in job {config.job_name} of {config.nodes} nodes",
        )
    if item.worker not in worker_slots(config):
        return Admission(
            Verdict.NOT_IN_JOB, f"{item}: worker {item.worker} has no item in job {config.job_name}"
        )
    if item.rank == config.node_rank:
        return Admission(
            Verdict.NOT_A_PUSHER,
            f"{item}: rank {item.rank} is this node's own rank; its items come only from its "
            "own trainer",
        )
    if item.rank not in expected_pushers(config):
        return Admission(
            Verdict.NOT_A_PUSHER,
            f"{item}: rank {item.rank} does not replicate to rank {config.node_rank} in the "
            "job's layout",
        )
    if pusher not in (None, LEGACY) and not served.bound:
        # No rank's items before its node is known: a node's plant in a run's first
        # seconds would otherwise count as a copy, and its step as held by every rank.
        return Admission(
            Verdict.NOT_SERVED,
            f"{item}: this node does not know yet which node holds rank {item.rank} (the "
            "job's coordinator has not answered it since the job started here); try again "
            "in a moment",
        )
    held_by = served.holders.get(item.rank)
    if pusher not in (None, LEGACY) and held_by not in (None, LEGACY, pusher):
        return Admission(
            Verdict.NOT_A_PUSHER,
            f"{item}: rank {item.rank} is held by node {held_by[:100]!r}, not "
            f"{str(pusher)[:100]!r}: a node pushes only the items of the rank it holds",
        )
    limit = step_limit(served.newest_step, max_lead)
    if item.step > limit:
        return Admission(
            Verdict.TOO_FAR_AHEAD,
            f"{item}: step {item.step} is more than {max_lead} steps ahead of rank "
            f"{config.node_rank}'s newest step ({served.newest_step}); at most {limit} now",
        )
    return ACCEPT


def admit_copy(item: ItemId, digest: str, held_digest: str | None) -> Admission:
    """After the manifest checked out: what a committed item with the same id means.

    The same digest is nothing to do. Another digest is refused rather than answered "held":
    the pusher would count the step as replicated while this node holds other bytes, and the
    committed copy, maybe a restore round's only source, is never replaced by a push.
    """
    if held_digest is None:
        return ACCEPT
    if held_digest == digest:
        return Admission(Verdict.ALREADY_HELD)
    return Admission(
        Verdict.CONFLICT,
        f"{item}: another copy (digest {held_digest[:16]}...) is committed here and is never "
        "replaced by a push",
    )
