"""This node's outgoing transfers, paced by ``core.pacing``: a thread- and asyncio-safe book,
and a ``Meter`` per transfer that waits for its bytes. I/O only in the sense of sleeping.

One ``Pacer`` per daemon is shared by the peer plane (pushes on the data channel's threads
and in gRPC chunks on the event loop, pulls served) and the backup uploads (on storage
threads), so the limit and the priorities hold across all of them::

    with pacer.transfer(Traffic.REPLICATION) as meter:
        while left:
            n = min(meter.slice(), left)
            meter.take(n)            # or: await meter.take_async(n)
            ...send n bytes...
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mtc_replicator.core.manifest import CancelCheck, Cancelled
from mtc_replicator.core.pacing import Booking, PaceBook, PaceRules, Traffic

Clock = Callable[[], float]


class Pacer:
    """The daemon's one ``PaceBook`` behind a lock, with the waiting done by the caller's
    thread (``time.sleep``) or task (``asyncio.sleep``), never while holding the lock."""

    def __init__(
        self,
        rules: PaceRules | None = None,
        *,
        clock: Clock = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rules = rules or PaceRules()
        self._book = PaceBook(self.rules)
        self._lock = threading.Lock()
        self._savers: set[str] = set()
        """The jobs writing a checkpoint now, as their agents last looked."""
        self._clock = clock
        self._sleep = sleep
        self.sent: Counter[Traffic] = Counter()
        """Bytes booked per class since start (what the transfers asked to send)."""
        self.waited: dict[Traffic, float] = dict.fromkeys(Traffic, 0.0)
        """Seconds spent waiting per class: the limit's, the priorities' and saves' cost."""
        self.halted = threading.Event()
        """Set by ``halt``: every booking from then on raises ``Cancelled``."""

    def halt(self) -> None:
        """The daemon's shutdown is past its deadline: paced transfers end at their next
        slice (``Cancelled``), so no thread sends on for long after it."""
        self.halted.set()

    @contextmanager
    def transfer(
        self, traffic: Traffic, cancelled: CancelCheck | None = None, job: str = ""
    ) -> Iterator[Meter]:
        """One transfer of ``traffic`` for ``job`` in flight for the ``with`` block (it holds
        lower classes while it lasts; jobs side by side share the rate evenly);
        ``cancelled``: it ends at its next slice once true."""
        with self._lock:
            self._book.begin(traffic, job)
        try:
            yield Meter(self, traffic, cancelled, job)
        finally:
            with self._lock:
                self._book.end(traffic, job)

    def counts(self) -> tuple[dict[str, int], dict[str, float]]:
        """Bytes booked and seconds waited per class, by name (for metrics)."""
        with self._lock:
            return (
                {t.name.lower(): self.sent[t] for t in Traffic},
                {t.name.lower(): self.waited[t] for t in Traffic},
            )

    def saving(self, in_progress: bool, job: str = "") -> None:
        """An agent's latest look at its job directory: is ``job`` writing a checkpoint?
        The node's transfers hold while any job it serves is."""
        with self._lock:
            if in_progress:
                self._savers.add(job)
            else:
                self._savers.discard(job)
            self._book.saving(self._clock(), bool(self._savers))

    def active(self, traffic: Traffic) -> int:
        with self._lock:
            return self._book.active(traffic)

    def _slice(self, traffic: Traffic, job: str = "") -> int:
        with self._lock:
            return self._book.slice(traffic, self._clock(), job)

    def _book_bytes(self, traffic: Traffic, nbytes: int) -> Booking:
        with self._lock:
            booking = self._book.book(traffic, nbytes, self._clock())
            if booking.booked:
                self.sent[traffic] += nbytes
            self.waited[traffic] += booking.wait
            return booking


class Meter:
    """One transfer's account at the ``Pacer``: it books whole slices, so concurrent
    transfers share the link slice by slice, and spends what it booked before booking again."""

    def __init__(
        self, pacer: Pacer, traffic: Traffic, cancelled: CancelCheck | None = None, job: str = ""
    ) -> None:
        self.pacer = pacer
        self.traffic = traffic
        self.job = job
        self.cancelled = cancelled
        """The transfer's own cancellation (its job stopped), checked like ``halt``."""
        self._credit = 0

    def slice(self) -> int:
        """The most bytes worth sending at once now (smaller while the transfer is held)."""
        return max(1, self._credit) if self._credit else self.pacer._slice(self.traffic, self.job)

    def take(self, nbytes: int, stop: threading.Event | None = None) -> None:
        """Block until ``nbytes`` may be sent. With ``stop``, a wait ends as soon as it is set
        (the transfer was cancelled) and ``Cancelled`` is raised: a held transfer may wait
        for seconds at a time, its thread must not outlive its cancellation that long."""
        while nbytes > 0:
            if self._credit <= 0:
                self._credit += self._book_blocking(stop)
            used = min(nbytes, self._credit)
            self._credit -= used
            nbytes -= used

    async def take_async(self, nbytes: int) -> None:
        """``take`` for the event loop."""
        while nbytes > 0:
            if self._credit <= 0:
                self._credit += await self._book_async()
            used = min(nbytes, self._credit)
            self._credit -= used
            nbytes -= used

    def paced(self, data: bytes | memoryview) -> Iterator[memoryview]:
        """``data`` in slices, each yielded once the meter allows it to be sent."""
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            n = min(self.slice(), len(view) - pos)
            self.take(n)
            yield view[pos : pos + n]
            pos += n

    def refund(self, nbytes: int) -> None:
        """``nbytes`` taken were not sent after all (a short send): keep them for the next."""
        self._credit += nbytes

    def _book_blocking(self, stop: threading.Event | None) -> int:
        while True:
            if (
                (stop is not None and stop.is_set())
                or self.pacer.halted.is_set()
                or (self.cancelled is not None and self.cancelled())
            ):
                raise Cancelled(f"{self.traffic.name.lower()} transfer")
            size = self.pacer._slice(self.traffic, self.job)
            booking = self.pacer._book_bytes(self.traffic, size)
            if booking.wait > 0:
                if stop is None:
                    self.pacer._sleep(booking.wait)
                elif stop.wait(booking.wait):
                    raise Cancelled(f"{self.traffic.name.lower()} transfer")
            if booking.booked:
                return size

    async def _book_async(self) -> int:
        while True:
            if self.pacer.halted.is_set():
                raise Cancelled(f"{self.traffic.name.lower()} transfer")
            size = self.pacer._slice(self.traffic, self.job)
            booking = self.pacer._book_bytes(self.traffic, size)
            if booking.wait > 0:
                await asyncio.sleep(booking.wait)
            if booking.booked:
                return size


class SharedMeter(Meter):
    """A ``Meter`` that several threads send through at once (an upload's parallel parts,
    a transfer's data connections): still one transfer, booking one slice at a time, so it
    gets no more than its share."""

    def __init__(self, meter: Meter) -> None:
        super().__init__(meter.pacer, meter.traffic, meter.cancelled, meter.job)
        self._taking = threading.Lock()

    def take(self, nbytes: int, *args: Any, **kwargs: Any) -> None:
        with self._taking:
            super().take(nbytes, *args, **kwargs)

    def refund(self, nbytes: int) -> None:
        with self._taking:
            super().refund(nbytes)


class PacedReader:
    """A read-only file object over ``data`` whose reads wait for the ``Meter``: what an
    SDK sends from it goes out at the pace of the link (boto3 and google-cloud-storage read
    a body in small blocks while they send it). Seeking back (an SDK's retry) re-reads, and
    re-sent bytes are paid for again."""

    def __init__(self, data: bytes | memoryview, meter: Meter) -> None:
        self._view = memoryview(data)
        self._meter = meter
        self._pos = 0

    def read(self, size: int = -1) -> bytes:
        left = len(self._view) - self._pos
        n = left if size is None or size < 0 else min(size, left)
        if n <= 0:
            return b""
        self._meter.take(n)
        start, self._pos = self._pos, self._pos + n
        return bytes(self._view[start : self._pos])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False
