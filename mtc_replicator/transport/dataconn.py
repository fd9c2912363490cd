"""A transfer's data-channel connections (one or more) as ``receiving`` and ``sending`` take
them, whichever side opens them: the side that asked for the channel dials the other's offer
(``dialled``), the side that offered it accepts a connection for each of its tickets
(``accepted``). I/O module.

The RPC modules (``peer_client``, ``peer_servicer``) reach the data channel only through
this face (an import-linter contract): they decide whether to use it and what to tell the
other side; ``datachannel`` moves the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from mtc_replicator.transport import datachannel
from mtc_replicator.transport.datachannel import DataListener, Ticket
from mtc_replicator.transport.datapool import Conn, TransferPool
from mtc_replicator.transport.tls import TlsMaterial

__all__ = [
    "DataConn",
    "DataListener",
    "Offer",
    "Ticket",
    "TransferPool",
    "accepted",
    "connections",
    "dialled",
]

Offer = tuple[int, tuple[bytes, ...]]
"""A data channel offered by the other daemon: its port, and one token per connection."""


@dataclass(frozen=True)
class DataConn:
    """The data connections of one transfer, still to be opened (one or more: the item's
    files are split between them, ``core.stripes``), the thread pool its transfer runs
    on, and the idle timeout of every send and receive on them."""

    open: Callable[[], Awaitable[list[Conn]]]
    pool: TransferPool
    idle: float


@contextlib.asynccontextmanager
async def connections(conn: DataConn) -> AsyncIterator[list[Conn]]:
    """``conn``'s connections, open while the body runs, closed after it."""
    socks = await conn.open()
    try:
        yield socks
    finally:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


def dialled(
    address: str, offer: Offer, *, timeout: float, tls: TlsMaterial | None, pool: TransferPool
) -> DataConn:
    """The connections to the data channel ``address``'s daemon offered, one per token,
    each token presented on its own."""
    port, tokens = offer

    async def dial() -> list[Conn]:
        # In turn, not at once: the other side bounds the handshakes one peer may have in
        # flight, and each takes a few milliseconds.
        loop = asyncio.get_running_loop()
        socks: list[Conn] = []
        try:
            for token in tokens:
                # Through the module: a test stands in for the network by replacing connect.
                socks.append(
                    await loop.run_in_executor(
                        None, datachannel.connect, address, port, token, timeout, tls
                    )
                )
        except BaseException:
            for sock in socks:
                sock.close()
            raise
        return socks

    return DataConn(dial, pool, timeout)


def accepted(listener: DataListener, tickets: Sequence[Ticket], idle: float) -> DataConn:
    """The connections the other daemon opens to ``listener``, one per ticket's token
    (``listener.withdraw`` closes any that came when the transfer fails)."""

    async def arrive() -> list[Conn]:
        return [await listener.connection(ticket, idle) for ticket in tickets]

    return DataConn(arrive, listener.pool, idle)
