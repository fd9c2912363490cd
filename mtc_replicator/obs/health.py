"""What ``/healthz`` and ``/readyz`` answer: liveness and readiness as lists of problems.

A check is a function that returns None when all is well, else one line saying what is
wrong; the HTTP endpoint (``obs.metrics_endpoint.serve``) calls them at each probe, from its own
thread. ``Heartbeat`` is the liveness of an event loop: a task in the loop beats, and a
probe that finds no beat for ``limit`` seconds calls the process stalled (a stalled loop
cannot answer for itself, which is why the probe runs on another thread). No I/O here except
what ``directory_check`` does at each probe: a ``stat`` and an ``access``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Check = Callable[[], str | None]
"""None: fine; else what is wrong, one line."""

HEARTBEAT_LIMIT = 60.0
"""Seconds without a beat before the loop counts as stalled: long enough for a slow GC
pause or a busy node, short against kubelet's restart cadence."""


class Heartbeat:
    """Beaten by the event loop; ``check`` is stale ``limit`` seconds after the last beat
    (or after its creation, before the first)."""

    def __init__(self, limit: float = HEARTBEAT_LIMIT, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self._clock = clock
        self._last = clock()

    def beat(self) -> None:
        self._last = self._clock()

    def check(self) -> str | None:
        silent = self._clock() - self._last
        if silent > self.limit:
            return f"the event loop has not answered for {silent:.0f}s (limit {self.limit:g}s)"
        return None


@dataclass
class Readiness:
    """Readiness by stages: ``stage`` says what startup is doing (None once it is done),
    ``stopping`` once the process shuts down."""

    stage: str | None = "starting"
    stopping: bool = False

    def check(self) -> str | None:
        if self.stopping:
            return "stopping"
        if self.stage is not None:
            return f"not started yet: {self.stage}"
        return None


def directory_check(path: Path, what: str) -> Check:
    """``path`` exists, is a directory and this process may write into it."""

    def check() -> str | None:
        if not path.is_dir():
            return f"{what} {path} is missing or not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{what} {path} is not writable"
        return None

    return check


@dataclass
class Health:
    """The checks behind ``/healthz`` (``live``) and ``/readyz`` (``live`` and ``ready``)."""

    live: Sequence[Check] = ()
    ready: Sequence[Check] = ()

    def liveness(self) -> list[str]:
        return _problems(self.live)

    def readiness(self) -> list[str]:
        return _problems([*self.live, *self.ready])


def _problems(checks: Sequence[Check]) -> list[str]:
    found = []
    for check in checks:
        try:
            problem = check()
        except Exception as exc:
            problem = f"check failed: {exc!r}"
        if problem is not None:
            found.append(problem)
    return found
