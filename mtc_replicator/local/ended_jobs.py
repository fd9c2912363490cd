"""The accepted ``replicator.yaml`` of each job that ran on this node and ended, kept in the
store while its items are. I/O.

A job that no longer runs here leaves items whose layout (its ranks, workers, data
parallelism) only its config tells: which items a backup ``COMMIT`` of a step lists, and
which of them this node holds. ``mtc upload`` needs exactly that to upload a kept job's
newest step (``node.kept_upload``). One file per job (``ended-jobs/<job>.yaml``, beside
CHECKPOINT_DIR, out of the pods' reach), written when its incarnation ends, removed with its
items (a drop, a node handoff); the RAM disk keeps it across a daemon restart.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtc_replicator.core.contract import MAX_CONFIG_BYTES
from mtc_replicator.local import fsutil

log = logging.getLogger(__name__)

DIR_NAME = "ended-jobs"


class EndedJobs:
    """``store_root/ended-jobs/<job>.yaml``; safe from any thread (each call one file op)."""

    def __init__(self, store_root: Path) -> None:
        self.root = store_root / DIR_NAME

    def _path(self, job: str) -> Path:
        # Job names are checked at the handshake and at every RPC: no separators.
        return self.root / f"{job}.yaml"

    def save(self, job: str, config_text: str) -> None:
        """Record the config ``job`` last ran with here; a failure is logged, never raised
        (only ``mtc upload`` of that job needs it, and says so when it is missing)."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            fsutil.atomic_write_bytes(self._path(job), config_text.encode())
        except OSError as exc:
            log.warning("cannot record job %s's config: %s", job, exc, extra={"job": job})

    def load(self, job: str) -> str | None:
        """The recorded config's text; None when there is none (or it cannot be read)."""
        try:
            raw = fsutil.read_regular(self._path(job), MAX_CONFIG_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read job %s's recorded config: %s", job, exc, extra={"job": job})
            return None
        return raw.decode("utf-8", errors="replace")

    def forget(self, job: str) -> None:
        try:
            self._path(job).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove %s: %s", self._path(job), exc, extra={"job": job})

    def forget_all(self) -> None:
        """A node handoff: nothing of the previous owner's jobs is kept."""
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return
        for name in names:
            try:
                (self.root / name).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove %s: %s", self.root / name, exc)
