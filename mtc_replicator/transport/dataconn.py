"""A data-channel connection as ``receiving`` and ``sending`` take it, whichever side opens
it: the side that asked for the channel dials the other's offer (``dialled``), the side that
offered it accepts the connection for its ticket (``accepted``). I/O module.

The RPC modules (``peer_client``, ``peer_servicer``) reach the data channel only through
this face (an import-linter contract): they decide whether to use it and what to tell the
other side; ``datachannel`` moves the bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mtc_replicator.transport import datachannel
from mtc_replicator.transport.datachannel import Conn, DataListener, Ticket, TransferPool
from mtc_replicator.transport.tls import TlsMaterial

__all__ = ["DataConn", "DataListener", "Ticket", "TransferPool", "accepted", "dialled"]


@dataclass(frozen=True)
class DataConn:
    """A data connection still to be opened, the thread pool its transfer runs on, and the
    idle timeout of every send and receive on it."""

    open: Callable[[], Awaitable[Conn]]
    pool: TransferPool
    idle: float


def dialled(
    address: str,
    offer: tuple[int, bytes],
    *,
    timeout: float,
    tls: TlsMaterial | None,
    pool: TransferPool,
) -> DataConn:
    """The connection to the data channel ``address``'s daemon offered, its token presented."""
    port, token = offer

    async def dial() -> Conn:
        # Through the module: a test stands in for the network by replacing connect.
        return await asyncio.get_running_loop().run_in_executor(
            None, datachannel.connect, address, port, token, timeout, tls
        )

    return DataConn(dial, pool, timeout)


def accepted(listener: DataListener, ticket: Ticket, idle: float) -> DataConn:
    """The connection the other daemon opens to ``listener`` with ``ticket``'s token."""
    return DataConn(lambda: listener.connection(ticket, idle), listener.pool, idle)
