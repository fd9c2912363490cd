"""What can go wrong with a transfer's byte stream, and the idle bound on every wait for one.

The base of the transport's data path: ``transfer``, ``datachannel``, ``receiving``,
``sending`` and the RPC modules (``peer_client``, ``peer_servicer``) all speak these, so
the RPC modules can name a stream's failures (and map them to statuses) without importing
the code that moves the bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

T = TypeVar("T")


class TransferError(ValueError):
    """A byte stream breaks the protocol: out of order, out of range, or oversize."""


class StreamIdle(Exception):
    """The other side of a transfer sent (or took) nothing for the idle timeout."""


class TooSlow(StreamIdle):
    """The other side of a transfer kept it under the minimum rate: it is dropped as a
    stalled one is (``core.pacing.transfer_deadline``)."""


class ChannelBroken(Exception):
    """The data connection failed (closed early, idle too long, never opened): retryable."""


class ChannelUnreachable(ChannelBroken):
    """The data connection could not be opened at all (a firewall, another network): the
    caller falls back to gRPC chunks for this peer for a while."""


class ChannelProtocolError(ValueError):
    """The other side broke the data channel's protocol (for example, extra bytes)."""


async def within(step: Awaitable[T], idle: float, what: str) -> T:
    """``step``, or ``StreamIdle`` when it makes no progress for ``idle`` seconds: whoever
    is on the other side must not hold a transfer's reservation, staging and descriptors
    for as long as it likes."""
    try:
        # A timeout scope, not wait_for: the step runs in the calling task, so cancelling
        # that task (a stopping server) still reaches it first, as without a timeout.
        async with asyncio.timeout(idle):
            return await step
    except TimeoutError:
        raise StreamIdle(f"{what}: nothing for {idle:g}s") from None


async def idle_bounded(messages: AsyncIterator[T], idle: float, what: str) -> AsyncIterator[T]:
    """``messages``, each within ``idle`` seconds of the one before (see ``within``)."""
    while True:
        try:
            message = await within(anext(messages), idle, what)
        except StopAsyncIteration:
            return
        yield message
