"""What a daemon told to stop (SIGTERM: a node drain, an upgrade) does with the job's newest
step before it exits, and what it does with it when the job ends on the node (another job's
handshake, an empty one: its items are then another job's neighbours). Pure: no I/O.

A stopping node may be gone for good (a drain) and take its RAM disk with it, so the
newest step it holds must reach another tier first, within the pod's grace period:

- its replication targets, when they lack it: the peer tier then holds the step (a
  cluster job restores from it like after any node loss);
- the backup, when the bucket is older: this rank uploads its own items, then tries the
  COMMIT, which needs every uploader's items. A one-node job commits alone; in a cluster
  the COMMIT is written by the last uploader to drain (or later by the coordinator's own
  backup order), since one rank cannot vouch for the others' items.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.layout import backup_uploaders, replication_targets

DEFAULT_DRAIN_SECONDS = 20.0
"""``--drain-seconds``: Kubernetes' default ``terminationGracePeriodSeconds`` is 30; the
rest covers the gRPC server's grace for transfers in flight (5 s) and the exit itself."""


@dataclass(frozen=True)
class DrainPlan:
    step: int | None
    """The newest complete step of this rank held here; None: nothing to keep."""
    push: bool
    """Push it to the replication targets (some may lack it)."""
    upload: bool
    """Upload this rank's items of it and try its COMMIT."""
    why: str


@dataclass(frozen=True)
class Drained:
    """What a drain did with the newest step (``node.agent.Incarnation.drain``)."""

    plan: DrainPlan
    committed: bool
    """Whether the backup holds a ``COMMIT`` of ``plan.step`` now (before or by the drain)."""
    upload_failed: bool = False
    """The drain's upload (or its COMMIT) failed; False when uploaded but not committed yet
    (other uploaders' items missing) or when no upload was due."""


def plan_drain(
    config: JobConfig,
    *,
    newest: int | None,
    replicated: int | None,
    committed: bool,
    has_backup: bool,
) -> DrainPlan:
    """``replicated``: the newest step every target confirmed; ``committed``: whether the
    bucket holds a COMMIT of ``newest`` already."""
    if newest is None:
        return DrainPlan(None, False, False, "no complete step held")
    push = bool(replication_targets(config)) and (replicated is None or replicated < newest)
    uploader = config.node_rank in backup_uploaders(config)
    upload = has_backup and uploader and not committed
    why = []
    why.append("pushing it to peers that lack it" if push else "the peers hold it (or none)")
    if not has_backup:
        why.append("no backup is set")
    elif committed:
        why.append("the backup holds it")
    elif not uploader:
        why.append("another replica of this rank's data uploads it")
    else:
        why.append("uploading it")
    return DrainPlan(newest, push, upload, "; ".join(why))
