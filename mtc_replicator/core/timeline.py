"""A restore's timeline on one node: which phase took how long. Pure (the clock is given).

A restore runs through phases one after another, from the first sight of
``replicator.yaml`` to the markers; the node's side of the round marks each change
(``enter``), so every moment belongs to exactly one phase and the phases add up to the
restore's wall time. A phase may recur (a second plan, a rejoin, a fetch per item): the
totals add its spans. The daemon logs the totals (``summary``) and every span (``spans``)
and exports the totals per phase (``obs.metrics``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class RestorePhase(StrEnum):
    """One phase of a restore on this node (a bounded metric label)."""

    SETTLE = "settle"
    """From the first read of ``replicator.yaml`` until it is accepted: waiting for it to
    settle, then the handshake's cleanup and hosting the coordinator."""
    INGEST = "ingest"
    """Taking in any save the job finished before the restart, before the round."""
    JOIN = "join"
    """Finding the coordinator (again after a rejoin)."""
    PLAN = "plan"
    """Joining its round and waiting for every rank to join and for the coordinator's plan
    (one long-polled call)."""
    LOCAL = "local"
    """Verifying every byte of copies this node holds."""
    PEER = "peer"
    """Pulling items from peers (verified as they arrive)."""
    BACKUP = "backup"
    """Downloading items from the backup (verified as they arrive)."""
    RELEASE = "release"
    """Reporting the fetches and waiting for the coordinator to release the round."""
    MARKERS = "markers"
    """Dropping abandoned items, publishing the views and the markers."""


@dataclass(frozen=True)
class Span:
    """One stay in a phase, in seconds since the timeline's origin."""

    phase: RestorePhase
    start: float
    end: float
    detail: str = ""
    """What the span was about (an item and its source), for the debug log."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class RestoreTimeline:
    """Records phase changes against ``clock`` (monotonic seconds) from ``origin``."""

    def __init__(
        self,
        clock: Callable[[], float],
        origin: float | None = None,
        opening: RestorePhase | None = None,
    ) -> None:
        """``origin``: when the restore began (default: now); ``opening``: the phase it
        has been in since then (the daemon settles the yaml before the timeline exists)."""
        self._clock = clock
        self.origin = clock() if origin is None else origin
        self._spans: list[Span] = []
        self._open: tuple[RestorePhase, float, str] | None = (
            None if opening is None else (opening, 0.0, "")
        )
        self._end: float | None = None

    def enter(self, phase: RestorePhase, detail: str = "") -> None:
        """The restore is in ``phase`` from now on (the previous phase ends now)."""
        now = self._close()
        if self._end is None:
            self._open = (phase, now, detail)

    def finish(self) -> None:
        """The restore ended (markers published, or failed): close the open phase."""
        if self._end is None:
            now = self._close()
            self._end = max(now, self._spans[-1].end) if self._spans else max(now, 0.0)

    def _close(self) -> float:
        now = self._clock() - self.origin
        if self._open is not None:
            phase, start, detail = self._open
            self._spans.append(Span(phase, start, max(now, start), detail))
            self._open = None
        return now

    @property
    def phase(self) -> RestorePhase | None:
        """The phase the restore is in now (None: not started, or finished)."""
        return None if self._open is None else self._open[0]

    def spans(self) -> list[Span]:
        """Every closed span, in order."""
        return list(self._spans)

    def totals(self) -> dict[RestorePhase, float]:
        """Seconds per phase the restore went through (closed spans), in phase order."""
        seen: dict[RestorePhase, float] = {}
        for span in self._spans:
            seen[span.phase] = seen.get(span.phase, 0.0) + span.seconds
        return {p: seen[p] for p in RestorePhase if p in seen}

    @property
    def elapsed(self) -> float:
        """Seconds from the origin to the end (or to the last closed span)."""
        if self._end is not None:
            return self._end
        return self._spans[-1].end if self._spans else 0.0

    def summary(self) -> str:
        """``total=0.95 settle=0.10 ...``: every phase, 0 for those not gone through."""
        totals = self.totals()
        parts = [f"total={self.elapsed:.3f}"]
        parts += [f"{p.value}={totals.get(p, 0.0):.3f}" for p in RestorePhase]
        return " ".join(parts)

    def lines(self) -> list[str]:
        """One line per span: start offset, duration, phase, what about."""
        return [
            f"+{s.start:.3f}s {s.seconds:.3f}s {s.phase.value}{' ' + s.detail if s.detail else ''}"
            for s in self._spans
        ]
