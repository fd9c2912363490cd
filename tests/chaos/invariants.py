"""The chaos harness's verdicts, as pure functions of what it observed: no I/O.

- ``floor``: the newest step that was durable just before a job restart: a step with a
  backup ``COMMIT``, or one of which every rank's item was committed in some node's store.
  Faults destroy copies only before the harness looks, so a restore below the floor lost a
  step that still existed: the daemons' fault, not the faults'.
- ``restored_step``: the one step every rank's single marker names.
- ``spinning``: the daemons that used too much CPU or logged too much while idle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

_MARKER = re.compile(r"-s(\d+)-n(\d+)-w(\d+)\.restore$")


class Violation(Exception):
    """An invariant broke; the message says which, with the evidence."""


def floor(
    held: Mapping[int, Iterable[tuple[int, str]]], backups: Iterable[int], nodes: int
) -> tuple[int, str]:
    """The newest durable step (0: none) and why; ``held``: node -> (step, ``rank-worker``)
    of every committed item in its store."""
    ranks: dict[int, set[int]] = {}
    for items in held.values():
        for step, item in items:
            ranks.setdefault(step, set()).add(int(item.split("-")[0]))
    stored = max((s for s, r in ranks.items() if len(r) == nodes), default=0)
    backed = max(backups, default=0)
    if stored >= backed:
        return stored, f"step {stored}: every rank's item committed in some store"
    return backed, f"step {backed}: backup COMMIT"


def restored_step(markers: Mapping[int, list[str]]) -> int:
    """The step of the restore: one marker per rank, its own, all of one step."""
    steps = {}
    for rank, names in markers.items():
        if len(names) != 1:
            raise Violation(f"rank {rank} has {len(names)} markers: {names}")
        m = _MARKER.search(names[0])
        if m is None or int(m[2]) != rank:
            raise Violation(f"rank {rank}'s marker {names[0]!r} is not its own")
        steps[rank] = int(m[1])
    if len(set(steps.values())) != 1:
        raise Violation(f"ranks restored different steps: {steps}")
    return next(iter(steps.values()))


def check_floor(step: int, floor_step: int, why: str, newest: int) -> None:
    if step < floor_step:
        raise Violation(f"restored step {step}, below the floor {why} (newest save {newest})")


def spinning(
    readings: Mapping[int, tuple[float, int]], cpu_bound: float, log_bound: int
) -> list[int]:
    """Ranks whose daemon used more than ``cpu_bound`` of a core (NaN: restarted, unknown)
    or wrote more than ``log_bound`` log bytes."""
    return [
        r
        for r, (cpu, grown) in sorted(readings.items())
        if (not math.isnan(cpu) and cpu > cpu_bound) or grown > log_bound
    ]
