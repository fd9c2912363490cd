"""How this node's outgoing transfers share its link with the training job. Pure: the caller
passes the time.

Three rules, in this order:

1. **Priority.** Traffic has a class: bytes a restore waits on (serving a peer's pull) come
   first, then replication of the newest step, then backup uploads. While a transfer of a
   higher class is in flight, lower classes are *held*: they trickle at ``HELD_RATE``
   (connections stay alive, nothing starves) and resume where they were when it ends.
2. **Saves.** While the job writes a checkpoint to the RAM disk, replication and backups are
   held completely, for at most ``PaceRules.yield_to_saves`` seconds per save, so the
   daemon's reads of the previous step do not slow the job's writes. Restores are not held.
3. **The rate limit** (``PaceRules.rate``): replication and backups together send at most
   that many bytes per second, with bursts of at most ``burst_seconds`` worth: a token
   bucket of that capacity, booked in slices so that concurrent transfers share it fairly
   (each books one slice at a time, first come first served). Where several jobs send at
   once (job directories), each job's transfers book slices divided by how many it has in
   flight, so every job gets an even share whatever its number of transfers. Restores
   never book.

``PaceBook`` is the bookkeeping; ``mtc_replicator.local.pacer`` makes it thread- and
asyncio-safe and does the waiting.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum

import bitmath


class Traffic(IntEnum):
    """A transfer's class; a lower value goes first."""

    RESTORE = 0
    REPLICATION = 1
    BACKUP = 2


PACED = (Traffic.REPLICATION, Traffic.BACKUP)
"""The classes the rate limit and saves apply to: restores are idle GPUs, never throttled."""

MIN_SLICE = 64 << 10
MIN_RATE = MIN_SLICE
"""The lowest ``--max-transfer-rate``: one smallest slice per second."""
MAX_SLICE = 4 << 20
SLICE_SECONDS = 0.05
"""A slice is a twentieth of a second at the limit, within [MIN_SLICE, MAX_SLICE]: fine
enough to share fairly and to hand the link over quickly, coarse enough to cost nothing.
Never more than one second's worth, though, even below MIN_SLICE a second: a peer drops a
transfer that sends nothing for its idle timeout (30 s), and a save's hold comes on top."""

HELD_RATE = 1 << 20
"""Bytes per second a held class still sends: its peers' and the bucket's idle timeouts never
fire, and a backup behind an endless replication still ends."""
HELD_SLICE = 64 << 10

SAVE_POLL = 0.05
"""Seconds between looks at a save that holds transfers (its end is seen by a rescan)."""

DEFAULT_YIELD_TO_SAVES = 5.0
MAX_YIELD_TO_SAVES = 15.0
"""The longest hold a save may cause: under the idle timeouts of object stores (S3 drops a
connection idle for about 20 s) and of our peers (30 s)."""


@dataclass(frozen=True)
class PaceRules:
    rate: float | None = None
    """Bytes per second for replication and backups together; None: unlimited."""
    burst_seconds: float = 1.0
    yield_to_saves: float = DEFAULT_YIELD_TO_SAVES
    """Seconds a save may hold replication and backups; 0: never."""

    def __post_init__(self) -> None:
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"a transfer rate must be a positive number of bytes, got {self.rate}")
        if not 0 < self.burst_seconds <= 60:
            raise ValueError(f"burst seconds must be in (0, 60], got {self.burst_seconds}")
        if not 0 <= self.yield_to_saves <= MAX_YIELD_TO_SAVES:
            raise ValueError(
                f"yield-to-saves seconds must be in [0, {MAX_YIELD_TO_SAVES:g}] (peers and "
                f"object stores drop connections idle for longer), got {self.yield_to_saves}"
            )

    @property
    def slice(self) -> int:
        """Bytes booked at a time by every paced transfer."""
        if self.rate is None:
            return MAX_SLICE
        floor = min(MIN_SLICE, self.rate)
        return max(1, int(min(MAX_SLICE, max(floor, self.rate * SLICE_SECONDS))))


@dataclass(frozen=True)
class Booking:
    """The answer to a request for bytes: wait ``wait`` seconds, then send them (``booked``)
    or ask again (not booked: the class is held)."""

    wait: float
    booked: bool


GO = Booking(0.0, True)


class PaceBook:
    """The link's book: transfers in flight per class, the token bucket, the save hold."""

    def __init__(self, rules: PaceRules) -> None:
        self.rules = rules
        self._capacity = rules.rate * rules.burst_seconds if rules.rate is not None else 0.0
        self._tokens = self._capacity
        self._stamp: float | None = None
        self._active: Counter[Traffic] = Counter()
        self._jobs: Counter[str] = Counter()
        """Paced transfers in flight per job."""
        self._trickle_at: dict[Traffic, float] = {}
        self._save_since: float | None = None

    # --- what is going on -----------------------------------------------------------------

    def begin(self, traffic: Traffic, job: str = "") -> None:
        self._active[traffic] += 1
        if traffic in PACED:
            self._jobs[job] += 1

    def end(self, traffic: Traffic, job: str = "") -> None:
        self._active[traffic] -= 1
        if self._active[traffic] <= 0:
            del self._active[traffic]
        if traffic in PACED:
            self._jobs[job] -= 1
            if self._jobs[job] <= 0:
                del self._jobs[job]

    def active(self, traffic: Traffic) -> int:
        return self._active[traffic]

    def saving(self, now: float, in_progress: bool) -> None:
        """Whether the job is writing a checkpoint now; a save's hold starts when first seen."""
        if not in_progress:
            self._save_since = None
        elif self._save_since is None:
            self._save_since = now

    def save_hold(self, now: float) -> float:
        """Seconds the current save still holds replication and backups (0: none)."""
        if self._save_since is None:
            return 0.0
        return max(0.0, self._save_since + self.rules.yield_to_saves - now)

    def held_by(self, traffic: Traffic) -> Traffic | None:
        """The higher class in flight that holds ``traffic``, if any."""
        return next((t for t in Traffic if t < traffic and self._active[t] > 0), None)

    # --- asking for bytes -----------------------------------------------------------------

    def slice(self, traffic: Traffic, now: float, job: str = "") -> int:
        """The most bytes ``traffic`` of ``job`` should ask for at once now."""
        if traffic not in PACED:
            return MAX_SLICE
        if self.held_by(traffic) is not None:
            return min(HELD_SLICE, max(1, int(self._held_rate)))
        if len(self._jobs) > 1:
            # Jobs side by side: a job's share is one slice a turn, however many it sends.
            return max(1, self.rules.slice // max(1, self._jobs[job]))
        return self.rules.slice

    def book(self, traffic: Traffic, nbytes: int, now: float) -> Booking:
        """Book ``nbytes`` of ``traffic`` (at most one ``slice``), or say how long to wait."""
        if traffic not in PACED:
            return GO
        hold = self.save_hold(now)
        if hold > 0:
            return Booking(min(SAVE_POLL, hold), booked=False)
        wait = 0.0
        if self.held_by(traffic) is not None:
            at = self._trickle_at.get(traffic, now)
            if at > now:
                return Booking(at - now, booked=False)
            self._trickle_at[traffic] = max(at, now) + nbytes / self._held_rate
        if self.rules.rate is not None:
            wait = self._take_tokens(nbytes, now)
        return Booking(wait, True) if wait > 0 else GO

    @property
    def _held_rate(self) -> float:
        rate = self.rules.rate
        return float(HELD_RATE) if rate is None else min(float(HELD_RATE), rate / 16)

    def _take_tokens(self, nbytes: int, now: float) -> float:
        """Take from the bucket (into debt if need be); the seconds until the debt is paid."""
        rate = self.rules.rate
        assert rate is not None
        if self._stamp is not None and now > self._stamp:
            self._tokens = min(self._capacity, self._tokens + (now - self._stamp) * rate)
        self._stamp = now if self._stamp is None else max(self._stamp, now)
        self._tokens -= nbytes
        return -self._tokens / rate if self._tokens < 0 else 0.0


_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+?)(?:/s|ps)?\s*")


def parse_rate(text: str, minimum: float = MIN_RATE) -> float | None:
    """Bytes per second from ``400MiB``, ``1.5GB``, ``2Gbit`` or ``2Gb`` (bits), with an
    optional ``/s``; ``unlimited`` (or empty): None. ``ValueError`` says the rule."""
    if text.strip().lower() in ("", "unlimited", "none"):
        return None
    match = _RATE.fullmatch(text)
    unit = match.group(2) if match else ""
    if unit.endswith("bit"):
        unit = unit[: -len("bit")] + "b"
    try:
        if match is None:
            raise ValueError
        size = bitmath.parse_string(match.group(1) + unit)
    except ValueError:
        raise ValueError(
            f"cannot read transfer rate {text!r}: give a number and a unit of bytes (B, kB, "
            "KiB, MB, MiB, GB, GiB, ...) or bits (Mbit, Gbit, Mb, Gb, ...) per second, e.g. "
            "400MiB or 2Gbit, or 'unlimited'"
        ) from None
    rate = float(size.bytes)
    if rate < minimum:
        if minimum == MIN_RATE:
            raise ValueError(
                f"transfer rate {text!r} is under the minimum of 64KiB per second (slower "
                "would neither replicate a checkpoint nor keep a held transfer's connection "
                "alive)"
            )
        raise ValueError(f"transfer rate {text!r} is under the minimum of {format_rate(minimum)}")
    return rate


# --- the floor under a transfer a peer sends or takes -------------------------------------------

DEFAULT_MIN_TRANSFER_RATE = 256 << 10
"""The slowest average rate a peer's push or pull may keep, after a grace of one idle
timeout (``transfer_deadline``). Far under what an unpaced push gets (hundreds of MiB/s),
and under what a push paced at 4 MiB/s or more gets while it shares the limit with a
dozen others; a slower ``--max-transfer-rate`` lowers it (``default_floor``)."""
MIN_FLOOR_RATE = 1 << 10
"""The lowest ``--min-transfer-rate``: 1 KiB/s."""


def default_floor(max_rate: float | None) -> float:
    """The floor when ``--min-transfer-rate`` is not given: ``DEFAULT_MIN_TRANSFER_RATE``,
    or a sixteenth of this node's ``--max-transfer-rate`` when that is lower (the rate a
    held class trickles at): nodes of one cluster share their flags, so a peer pacing its
    pushes as this node does is not cut off."""
    if max_rate is None:
        return float(DEFAULT_MIN_TRANSFER_RATE)
    return max(float(MIN_FLOOR_RATE), min(float(DEFAULT_MIN_TRANSFER_RATE), max_rate / 16))


ENTRY_BYTES = 4096
"""What one file or directory of an item counts as in ``transfer_deadline``: a page, the
least tmpfs charges a non-empty file. Creating 30,000 small files takes seconds on a busy
node, which their bytes alone would not allow for."""


def transfer_deadline(
    nbytes: int, floor: float | None, grace: float, entries: int = 0
) -> float | None:
    """Seconds a transfer of ``nbytes`` in ``entries`` files and directories may take in
    all: ``grace`` plus its bytes, and ``ENTRY_BYTES`` per entry, at the ``floor`` rate;
    None when there is no floor.

    The idle timeout bounds each wait, not the whole: a sender dripping one byte a second
    would otherwise hold its reservation (up to the node's free space) for ever. The grace
    (the idle timeout) covers connection set-up and a save's hold (at most
    ``MAX_YIELD_TO_SAVES``).
    """
    if floor is None:
        return None
    return grace + (max(nbytes, 0) + ENTRY_BYTES * max(entries, 0)) / floor


def earned_seconds(moved: int, floor: float, grace: float) -> float:
    """Seconds a transfer that has moved ``moved`` (bytes, and ``ENTRY_BYTES`` per file and
    directory done) may have run so far: ``grace`` plus ``moved`` at the ``floor`` rate.

    A receiver holds a push's whole reservation from its header on, so the floor is kept
    all along, not only on average at the end (``transfer_deadline``): a sender dripping
    a byte a second into a 100 MiB item is dropped once the grace is spent, not after the
    7 minutes its size allows. A sender at or over the floor only ever gains on it; pauses
    (a save's hold) come out of the grace and of what it gained.
    """
    return grace + max(moved, 0) / floor


def format_rate(rate: float | None) -> str:
    if rate is None:
        return "unlimited"
    return str(bitmath.Byte(rate).best_prefix().format("{value:.4g}{unit}")) + "/s"
