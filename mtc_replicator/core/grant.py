"""A rank grant: which node holds each rank of a job, as mtc-controller assigned them. Pure.

Without one, a rank is bound to the first node whose certificate joins as it
(``core.rank_holders``): trust on first use, which leaves a new job's first seconds to
whoever holds a node certificate. With sticky ranks the controller knows every binding
before a pod starts, and hands it to each node of the job with the pod's rank
(``Node/AssignRank``, which only the controller's certificate may call). A node's daemon
keeps the grant and, while the job it serves matches it (the same node count, this node at
its own rank), takes it as the authority:

- the coordinator (rank 0's node) admits a join or report of rank r from ``holders[r]``
  alone, before any other work (``RankHolders.granted``);
- a push of rank r's item is admitted from ``holders[r]`` alone, from the first second
  (``Served.holders``);
- ``ListItems`` and ``PullItem`` of the job answer the grant's nodes alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mtc_replicator.core.identity import DEFAULT_NODE_NAME_PATTERN, IdentityRule
from mtc_replicator.core.jobname import is_job_name

MAX_GRANT_BYTES = 1 << 20
"""A grant of 4,096 ranks with 63-character names is about 270 KiB."""


class BadGrant(ValueError):
    """A grant that is not one the controller makes; the message says why."""


@dataclass(frozen=True)
class Grant:
    job: str
    assignment: str
    holders: tuple[str, ...]
    """The node of each rank, in rank order."""

    @property
    def nodes(self) -> int:
        return len(self.holders)

    def bindings(self) -> dict[int, str]:
        return dict(enumerate(self.holders))

    def names(self, node: str) -> bool:
        return node in self.holders

    def in_force(self, nodes: int, rank: int, own: str | None) -> bool:
        """Whether it speaks for a run of ``nodes`` ranks in which this node (``own``) is
        ``rank``: a grant of another run (resized, or ranks moved since) is not."""
        return own is not None and len(self.holders) == nodes and self.holders[rank] == own


def check_holders(
    holders: Sequence[str], nodes: int, rank: int, own: str | None, rule: IdentityRule | None = None
) -> None:
    """``BadGrant`` unless ``holders`` names one distinct node per rank, this node (``own``,
    when known) at ``rank``."""
    rule = rule or IdentityRule(DEFAULT_NODE_NAME_PATTERN)
    if len(holders) != nodes:
        raise BadGrant(f"{len(holders)} holders for {nodes} ranks")
    for r, name in enumerate(holders):
        if not isinstance(name, str) or not rule.matches(name):
            raise BadGrant(f"rank {r}'s holder {name!r:.80} is not a node name")
    if len(set(holders)) != len(holders):
        raise BadGrant("a node holds two ranks: one rank per node")
    if own is not None and holders[rank] != own:
        raise BadGrant(
            f"it names node {holders[rank][:100]!r} for rank {rank}, but this node is "
            f"{own[:100]!r}: the controller saw another replicator on this node"
        )


def grant_json(grant: Grant) -> bytes:
    return json.dumps(
        {"job": grant.job, "assignment": grant.assignment, "holders": list(grant.holders)},
        separators=(",", ":"),
    ).encode()


def grant_from_json(raw: bytes) -> Grant:
    """A grant this daemon wrote; ``BadGrant`` for anything else."""
    if len(raw) > MAX_GRANT_BYTES:
        raise BadGrant(f"larger than {MAX_GRANT_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise BadGrant(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"job", "assignment", "holders"}:
        raise BadGrant("not a grant (keys must be job, assignment, holders)")
    job, holders = data["job"], data["holders"]
    if not isinstance(job, str) or not is_job_name(job) or not isinstance(holders, list):
        raise BadGrant("not a grant: bad job or holders")
    check_holders(holders, len(holders), 0, None)
    return Grant(job, str(data["assignment"]), tuple(holders))


def granted_holders(
    grants: Mapping[str, Grant], job: str, nodes: int, rank: int, own: str | None
) -> dict[int, str] | None:
    """The bindings of ``job``'s grant when it is in force for this node at ``rank``."""
    grant = grants.get(job)
    if grant is None or not grant.in_force(nodes, rank, own):
        return None
    return grant.bindings()
