"""The rank grants this node was handed (``core.grant``), kept beside the store. I/O module.

``store_root/grants/<job>.json``, one per job, the newest assignment's: on the RAM disk, so
a daemon restart keeps it and a node loss forgets it (the controller hands it again with
the next assignment). Read into memory at start; each ``AssignRank`` with holders replaces
its job's. The daemon's event loop reads the in-memory map only.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.grant import (
    MAX_GRANT_BYTES,
    BadGrant,
    Grant,
    grant_from_json,
    grant_json,
    granted_holders,
)
from mtc_replicator.local import fsutil

log = logging.getLogger(__name__)

DIR_NAME = "grants"
GRANT_REMEDY = (
    "Label the job's pods checkpointing.mtc.dev/nodes and start them with `python -m "
    'mtc_replicator.client.rank` (docs/deploy.md, "Ranks that follow the bytes"), which waits '
    "for the grant, then restart the job"
)


class GrantsFile:
    """Every job's grant, in memory and in ``store_root/grants/``; ``required``
    (``--require-rank-grant``): a job without one is served to nobody."""

    def __init__(self, store_root: Path, *, required: bool = False) -> None:
        self.root = store_root / DIR_NAME
        self.grants: dict[str, Grant] = {}
        self.required = required

    @classmethod
    def opened(cls, store_root: Path, *, required: bool = False) -> GrantsFile:
        """The grants kept under ``store_root``, read."""
        grants = cls(store_root, required=required)
        grants.load()
        return grants

    def missing(self, config: JobConfig, own: str | None) -> tuple[str, str] | None:
        """Why this node may not run ``config`` (a grant is required and none in force for
        it names this node at its rank), and the remedy; None: it may."""
        job, nodes, rank = config.job_name, config.nodes, config.node_rank
        if not self.required or self.holders(job, nodes, rank, own) is not None:
            return None
        grant = self.grants.get(job)
        held = (
            "none"
            if grant is None
            else f"one of assignment {grant.assignment!r} for {len(grant.holders)} ranks"
        )
        why = (
            f"this node serves only jobs whose ranks mtc-controller assigned "
            f"(--require-rank-grant), and holds no grant of job {job} with {nodes} ranks that "
            f"gives it rank {rank} ({held})"
        )
        return why, GRANT_REMEDY

    def load(self) -> None:
        """Read what a previous run of this daemon kept; an unreadable file is ignored
        (said in the log): that job's next assignment brings it back."""
        try:
            paths = sorted(self.root.iterdir())
        except FileNotFoundError:
            return
        for path in paths:
            try:
                grant = grant_from_json(fsutil.read_regular(path, MAX_GRANT_BYTES + 1))
            except (OSError, BadGrant) as exc:
                log.warning("ignoring unreadable rank grant %s: %s", path, exc)
                continue
            if path.name == f"{grant.job}.json":
                self.grants[grant.job] = grant

    def save(self, grant: Grant) -> None:
        """Keep ``grant`` as its job's (raises ``OSError``)."""
        if self.grants.get(grant.job) == grant:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsutil.atomic_write_bytes(self.root / f"{grant.job}.json", grant_json(grant))
        self.grants[grant.job] = grant

    def holders(self, job: str, nodes: int, rank: int, own: str | None) -> dict[int, str] | None:
        """The ranks' nodes by ``job``'s grant, when it is in force for this node at ``rank``."""
        return granted_holders(self.grants, job, nodes, rank, own)

    def readers(
        self, job: str, serving: JobConfig | None, own: str | None
    ) -> frozenset[str] | None:
        """The nodes that may read ``job``'s items here: its grant's, while this node serves
        the granted run (``serving``); None: anyone of the CA (no grant, or one of another
        run, which must not keep a later run's nodes out). Where a grant is ``required``:
        the newest grant's nodes whatever this node serves, and nobody without one."""
        grant = self.grants.get(job)
        if self.required:
            return frozenset() if grant is None else frozenset(grant.holders)
        if grant is None or serving is None or serving.job_name != job:
            return None
        return (
            frozenset(grant.holders)
            if grant.in_force(serving.nodes, serving.node_rank, own)
            else None
        )
