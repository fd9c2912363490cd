"""Refused restore pins, told to the job they were meant for. No I/O of its own.

The coordinator reads a job's pin when a round lists the backups, often before rank 0's
new incarnation exists (the other ranks join first) or while its old one still runs, whose
``replicator.errors`` the next handshake clears. So the refusal is kept while the pin
stands, and each incarnation of the job on this node (rank 0's) is told once.
"""

from __future__ import annotations

from mtc_replicator.node.agent import Incarnation
from mtc_replicator.obs.metrics import ErrorKind, Metrics


class PinRefusals:
    """The refused pin of each job, while it stands, and whom it was told to."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._standing: dict[str, str] = {}
        """Per job, why its pin is refused."""
        self._told: tuple[str, set[str]] = ("", set())
        """The incarnation told last, and the jobs it was told of."""

    def refused(self, job: str, message: str | None) -> None:
        """``job``'s pin was refused (``message``), or no refused pin stands (None)."""
        if message is None:
            self._standing.pop(job, None)
            return
        self.metrics.pin_refused(job)
        self._standing[job] = message

    def tell(self, running: Incarnation | None) -> None:
        """Write a standing refusal to ``running``'s ``replicator.errors``, once."""
        if running is None:
            return
        job = running.config.job_name
        message = self._standing.get(job)
        if message is None:
            return
        if self._told[0] != running.id:
            self._told = (running.id, set())
        if job not in self._told[1]:
            self._told[1].add(job)
            running.error(message, kind=ErrorKind.RESTORE)
