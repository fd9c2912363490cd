"""The pool copies this node holds for one-node jobs that run elsewhere. I/O: the store.

``core.pool`` says which pushes are pool copies; this module keeps them: the job's newest
steps only (``core.pool.POOL_KEEP_STEPS``), and a note per job (``pool-copies/<job>`` in the
store) that its items here came as pool copies. The note matters when the job comes here:
run as a one-node job, its copies are its own newest steps (a local restore), and the note
goes; run as a job of several nodes (a name reused, or a pod that lied about its job), the
copies are dropped before its first round plans, so that no node's push counts as a copy
of a rank it never held (SECURITY.md, "Pool copies"). Blocking: run on the daemon's pool.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.pool import steps_past_keep
from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore

log = logging.getLogger(__name__)

NOTES = "pool-copies"


class PoolHeld:
    """The store's pool copies, by job."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def _note(self, job: str) -> Path:
        if not is_job_name(job):
            raise ValueError(f"bad job name {job!r:.80}")
        return self.store.root / NOTES / job

    def newest(self, job: str) -> int | None:
        """The newest step of ``job``'s rank 0 held here."""
        return max((i.step for i in self.store.manifests(job) if i.rank == 0), default=None)

    def committed(self, item: ItemId) -> list[int]:
        """``item`` came as a pool copy: note its job, and drop the job's steps past the
        newest kept; the steps dropped."""
        note = self._note(item.job)
        if not note.exists():
            note.parent.mkdir(exist_ok=True)
            fsutil.atomic_write_bytes(note, b"")
        held = [i for i in self.store.manifests(item.job) if i.rank == 0]
        old = set(steps_past_keep({i.step for i in held}))
        for gone in (i for i in held if i.step in old):
            self.store.delete(gone)
        return sorted(old)

    def held(self, job: str) -> bool:
        """Whether ``job``'s items here came as pool copies."""
        return self._note(job).exists()

    def of_several_nodes(self, job: str) -> bool:
        """Whether this node holds items of ``job`` as a job of several nodes (a rank other
        than 0: pool copies are rank 0 only): a pool copy must never be taken beside them,
        or keeping the newest pool copies would delete the job's real rank-0 items."""
        return any(i.rank != 0 for i in self.store.manifests(job))

    def settle(self, job: str, nodes: int) -> list[ItemId]:
        """``job`` starts here with ``nodes`` nodes: its pool copies become its own (one
        node), or are dropped (several); the items dropped."""
        note = self._note(job)
        if not note.exists():
            return []
        dropped = []
        if nodes > 1:
            dropped = [i for i in self.store.manifests(job) if i.rank == 0]
            for item in dropped:
                self.store.delete(item)
            log.warning(
                "job %s starts here with %d nodes: dropped the %d pool copies of its rank 0 "
                "held here (a one-node job's, pushed by another node)",
                job,
                nodes,
                len(dropped),
                extra={"job": job},
            )
        note.unlink(missing_ok=True)
        return dropped
