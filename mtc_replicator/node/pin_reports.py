"""Refused restore pins, told to the job they were meant for. No I/O of its own.

The coordinator reads a job's pin when a round lists the backups, often before rank 0's
new incarnation exists (the other ranks join first) or while its old one still runs, whose
``replicator.errors`` the next handshake clears. So the refusal is kept while the pin
stands, and each incarnation of the job on this node (rank 0's) is told once. The
coordinator's pins (``storage.restore_pins.StorePins``) report from worker threads: their
callbacks (``from_threads``) hand each report to the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from mtc_replicator.node.agent import Incarnation
from mtc_replicator.obs.metrics import ErrorKind, Metrics

MAX_TOLD = 1024
"""Incarnations remembered as told: far more than a node runs at once."""


class PinRefusals:
    """The refused pin of each job, while it stands, and whom it was told to."""

    def __init__(
        self, metrics: Metrics, running: Callable[[str], Incarnation | None] = lambda job: None
    ) -> None:
        self.metrics = metrics
        self.running = running
        """The incarnation that runs a job on this node, if any (``node.tenancy``)."""
        self._standing: dict[str, str] = {}
        """Per job, why its pin is refused."""
        self._told: dict[str, str] = {}
        """The incarnations told, each with its job (one job each; the newest kept)."""

    def from_threads(
        self, loop: asyncio.AbstractEventLoop
    ) -> tuple[Callable[[str, int, str], None], Callable[[str, str | None], None]]:
        """``StorePins``' ``on_failure`` and ``on_refused``, callable from any thread: each
        runs ``not_removed`` or ``refused`` in ``loop``."""

        def on_failure(job: str, step: int, message: str) -> None:
            loop.call_soon_threadsafe(self.not_removed, job, step, message)

        def on_refused(job: str, message: str | None) -> None:
            loop.call_soon_threadsafe(self.refused, job, message)

        return on_failure, on_refused

    def refused(self, job: str, message: str | None) -> None:
        """``job``'s pin was refused (``message``), or no refused pin stands (None); the
        incarnation running it here is told."""
        if message is None:
            self._standing.pop(job, None)
            return
        self.metrics.pin_refused(job)
        self._standing[job] = message
        self.tell(self.running(job))

    def not_removed(self, job: str, step: int, message: str) -> None:
        """A used restore pin stayed in the bucket: the metric, and the job's errors file
        when this node runs one of its ranks (the coordinator's node runs rank 0)."""
        self.metrics.pin_delete_failed(job)
        running = self.running(job)
        if running is not None:
            running.error(message, step, kind=ErrorKind.RESTORE)

    def tell(self, running: Incarnation | None) -> None:
        """Write a standing refusal to ``running``'s ``replicator.errors``, once."""
        if running is None:
            return
        job = running.config.job_name
        message = self._standing.get(job)
        if message is None or self._told.get(running.id) == job:
            return
        self._told[running.id] = job
        while len(self._told) > MAX_TOLD:
            del self._told[next(iter(self._told))]
        running.error(message, kind=ErrorKind.RESTORE)
