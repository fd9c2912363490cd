"""The threads that move data-channel bytes, and how a transfer running on them is stopped.
I/O module.

A data-channel transfer blocks in ``recv``, ``sendfile`` and OpenSSL, so it runs on a
thread of its own, one per connection (``core.stripes``: a transfer may use several),
never on the daemon's I/O pool. ``TransferPool`` bounds how many run; ``Abort`` stops them
from the event loop: a flag, and the connections shut down so a blocked call returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from mtc_replicator.core.manifest import Cancelled
from mtc_replicator.core.stripes import MAX_STREAMS
from mtc_replicator.transport.streams import ChannelBroken
from mtc_replicator.transport.tls import TlsStream

T = TypeVar("T")

MAX_TRANSFERS = 16
"""Transfers on the data channel at once on one side (each holds a thread per connection
while it moves bytes); past it, or past ``MAX_TRANSFERS_PER_PEER`` for one peer, bytes go
in gRPC chunks."""
MAX_TRANSFERS_PER_PEER = 4

Conn = socket.socket | TlsStream
"""A data connection: a plain socket, or TLS over one."""


def raw_socket(conn: Conn) -> socket.socket:
    return conn.sock if isinstance(conn, TlsStream) else conn


class Abort:
    """Stops a blocking transfer from another thread: a flag, and its connections shut
    down so a blocked receive or ``sendfile`` returns at once."""

    def __init__(self, socks: Sequence[Conn] = ()) -> None:
        self.socks = tuple(socks)
        self.event = threading.Event()
        """Set once aborted: a wait on the pacer ends with it."""

    def __call__(self) -> bool:
        return self.event.is_set()

    def set(self) -> None:
        self.event.set()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                raw_socket(sock).shutdown(socket.SHUT_RDWR)


def _cause(first: list[BaseException], rest: list[BaseException]) -> BaseException:
    """What to report of a transfer whose connections failed: of the failures that came
    before the abort (``first``), one that is neither a cut nor a cancellation if there
    is one; the abort's echoes in the others (``rest``) only when nothing came before."""
    for exc in (*first, *rest):
        if not isinstance(exc, ChannelBroken | Cancelled):
            return exc
    # Only what came first: a ``Cancelled`` there (the pacer halted) must not turn into
    # the ``ChannelBroken`` its abort caused in the others.
    for exc in first or rest:
        if isinstance(exc, ChannelBroken):
            return exc
    return (first or rest)[0]


class TransferPool:
    """At most ``size`` transfers at once, at most ``per_peer`` with one peer address. A
    transfer ``claim``s a slot before it offers or asks for the channel, and goes in gRPC
    chunks when none is free, so no transfer ever waits here for a thread. Used from one
    event loop."""

    def __init__(self, size: int = MAX_TRANSFERS, per_peer: int = MAX_TRANSFERS_PER_PEER) -> None:
        self.size = size
        self.per_peer = per_peer
        # Threads are made as they are needed: most transfers use one connection.
        self._executor = ThreadPoolExecutor(
            max_workers=size * MAX_STREAMS, thread_name_prefix="mtc-data"
        )
        self._busy: Counter[str] = Counter()

    def claim(self, peer: str) -> bool:
        """Take a slot for a transfer with ``peer``; False when none is free."""
        if self._busy.total() >= self.size or self._busy[peer] >= self.per_peer:
            return False
        self._busy[peer] += 1
        return True

    def release(self, peer: str) -> None:
        self._busy[peer] -= 1
        if self._busy[peer] <= 0:
            del self._busy[peer]

    async def run(self, fn: Callable[[], T], abort: Abort) -> T:
        """``fn`` on a pool thread (see ``run_all``)."""
        (result,) = await self.run_all([fn], abort)
        return result

    async def run_all(self, fns: Sequence[Callable[[], T]], abort: Abort) -> list[T]:
        """Run blocking calls, one per connection of a transfer, each on a pool thread at
        once (a GiB must not hold a worker of the daemon's I/O pool); their results in
        order. When one fails, or the awaiting task is cancelled, abort the others; either
        way every thread has let go of what it uses before this returns or raises, so the
        caller may clean up. A failure raises the first one that is not the abort's echo."""
        futures = [self._executor.submit(fn) for fn in fns]
        waiting = [asyncio.wrap_future(future) for future in futures]
        try:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            abort.set()
            concurrent.futures.wait(futures)
            raise
        first = [exc for w in waiting if w in done and (exc := w.exception()) is not None]
        if first:
            abort.set()
            try:
                outcomes = await asyncio.gather(*waiting, return_exceptions=True)
            except asyncio.CancelledError:
                concurrent.futures.wait(futures)
                raise
            rest = [o for o in outcomes if isinstance(o, BaseException) and o not in first]
            raise _cause(first, rest)
        return [w.result() for w in waiting]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
