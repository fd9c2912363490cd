"""The peer data plane's client on gRPC, ``PeerClient``. I/O module.

``PeerClient`` pushes a committed item to another daemon, pulls one and lists what a daemon
holds, over one grpc.aio channel per address with explicit message limits, keepalives and
a deadline on every call. The bytes themselves go out through ``transport.sending`` and
come in through ``transport.receiving`` (checked, with room reserved, staged, verified and
committed as a push taken here is), so this module is RPC plumbing: a push streams its
chunks only after the receiver accepted its header (``GO_AHEAD``), so answers never race
the chunks; when the other daemon offers its data channel, the bytes go there instead of
into chunks, and gRPC carries only the header and the verdict; a data channel that failed
is tried again in chunks (``_fallback``). A peer's status code is translated into our
exceptions in one place, ``_rpc_error``. The service itself is ``transport.peer_servicer``; the wire
conventions both speak are ``transport.peerwire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.contacts import Contacts
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest, ManifestError
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local.pacer import Meter, Pacer
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.transport import sending
from mtc_replicator.transport.dataconn import TransferPool, dialled
from mtc_replicator.transport.peerwire import (
    CHANNEL_OPTIONS,
    GO_AHEAD,
    channel_offer,
    check_streams,
    chunks_of,
    fill_chunk,
    item_id,
    item_ref,
    push_offer,
)
from mtc_replicator.transport.receiving import Receiving, Source
from mtc_replicator.transport.streams import (
    ChannelBroken,
    ChannelProtocolError,
    ChannelUnreachable,
    StreamIdle,
    TransferError,
    idle_bounded,
    within,
)
from mtc_replicator.transport.tls import TlsMaterial, open_channel

log = logging.getLogger(__name__)

CHUNKS_AFTER_UNREACHABLE = 300.0
"""Seconds a peer whose data channel could not be reached gets gRPC chunks instead."""
VERDICT_SECONDS = 5.0
"""After the data connection broke, how long to wait for the other side's status."""
BUSY_RETRIES = 4
"""Tries of a push in chunks after its data channel failed, while the other side still
counts the failed attempt as in flight (ABORTED), ``BUSY_SECONDS`` apart."""
BUSY_SECONDS = 0.5
PACED_SHARE = 4
"""A paced push's deadline assumes it gets at least 1/PACED_SHARE of the rate limit: a node
pushes to each of its peer ranks at once (usually one or two) beside a backup upload."""


# --- errors ------------------------------------------------------------------------------------


class PeerError(Exception):
    """A call to a peer failed; ``retryable`` says whether trying again later may work."""

    retryable = False

    def __init__(self, address: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.code = code


class PeerUnavailable(PeerError):
    """The peer is unreachable, too slow, full or busy."""

    retryable = True


class ItemNotFound(PeerError):
    """The peer holds no such committed item."""


class ItemBusy(PeerUnavailable):
    """The peer is moving this item now (another push of it, or its restore round is
    obtaining it for a pull): try again shortly."""


class ChannelFailed(PeerUnavailable):
    """A transfer over the data channel failed there (refused, cut, idle, never connected):
    ``PeerClient`` tries it again in gRPC chunks."""


_RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)


_UNREACHED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""Statuses that mean the peer did not answer (any other status is its answer)."""
PROBE_SECONDS = 3.0
"""How long a health probe waits for a peer's answer."""


def _rpc_error(exc: grpc.aio.AioRpcError, address: str, what: str) -> Exception:
    """The one place that turns a peer's gRPC status into our exception types."""
    code = exc.code()
    message = f"{what} at {address}: {code.name}: {exc.details() or ''}"
    if code is grpc.StatusCode.DATA_LOSS:
        return CorruptItem(message)
    if code is grpc.StatusCode.NOT_FOUND:
        return ItemNotFound(address, message, code)
    if code is grpc.StatusCode.ABORTED:
        return ItemBusy(address, message, code)
    if code in _RETRYABLE:
        return PeerUnavailable(address, message, code)
    return PeerError(address, message, code)


# --- the client --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Send:
    """What one push sends (its tries share it): the item, where its files are, its meter."""

    manifest: Manifest
    data: Path
    root: Path | None
    meter: Meter
    pool_copy: bool = False


@dataclass(frozen=True)
class ItemInfo:
    """One committed item a peer holds."""

    item: ItemId
    digest: str
    total_bytes: int


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _noting_contact(
    call: Callable[Concatenate[PeerClient, str, _P], Awaitable[_R]],
) -> Callable[Concatenate[PeerClient, str, _P], Coroutine[Any, Any, _R]]:
    """A ``PeerClient`` call to the peer at its first argument, noting in ``contacts``
    whether the peer answered (``PeerClient._contact``)."""

    @functools.wraps(call)
    async def noted(self: PeerClient, address: str, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._contact(address):
            return await call(self, address, *args, **kwargs)

    return noted


class PeerClient:
    """Calls other daemons' ``mtc.v1.Peer``; one channel per address, a deadline on every call.

    Transfers get ``timeout`` plus the time the item takes at ``min_rate`` bytes per second
    (a push: or at its share of the pacer's limit, see ``_push_deadline``); a pull whose
    size is not known in advance gets ``timeout + max_transfer_seconds``. Pushes book their
    bytes with ``pacer`` as replication; pulls are incoming bytes, never paced here.
    A pull's checks and disk writes run in ``executor`` (the daemon passes its own pool;
    without one the client makes a small pool and shuts it down in ``close``). With
    ``data_channel``, transfers ask for the other daemon's data channel and use it when it
    is offered, with up to ``data_streams`` connections at once (``core.stripes``).
    """

    def __init__(
        self,
        *,
        timeout: float = 30.0,
        min_rate: float = 25e6,
        max_transfer_seconds: float = 3600.0,
        executor: Executor | None = None,
        metrics: Metrics = NO_METRICS,
        data_channel: bool = True,
        data_streams: int = 1,
        tls: TlsMaterial | None = None,
        pacer: Pacer | None = None,
        receiving: Receiving | None = None,
    ) -> None:
        self.timeout = timeout
        self.receiving = receiving
        """How this node takes incoming items into its store, shared with the pushes its
        service takes (one room rule for both); a pull into another store gets its own."""
        self.pacer = pacer or Pacer()
        """The node's outgoing transfers: pushes are replication, paced by it."""
        self.tls = tls
        """Mutual TLS for every call and data connection; None: plaintext."""
        self.data_channel = data_channel
        self.data_streams = data_streams
        self.metrics = metrics
        self.min_rate = min_rate
        self.max_transfer_seconds = max_transfer_seconds
        self.pool = TransferPool()
        """Threads of this client's data-channel transfers, bounded per peer; a transfer
        that finds no free slot goes in gRPC chunks."""
        self._own_executor = executor is None
        self.executor: Executor = executor or ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="mtc-peer"
        )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, peer_pb2_grpc.PeerAsyncStub] = {}
        self._no_channel: dict[str, float] = {}
        """Peers whose data channel could not be reached, until when (monotonic)."""
        self._generation = tls.generation if tls is not None else 0
        self._retired: list[grpc.aio.Channel] = []
        """Channels opened with certificates since rotated: calls in flight finish on them."""
        self.contacts = Contacts()
        """Whether each peer answered this client's last call to it (``mtc status``)."""

    @contextlib.contextmanager
    def _contact(self, address: str) -> Iterator[None]:
        """Note whether ``address`` answered the call made inside: any status but
        UNAVAILABLE or DEADLINE_EXCEEDED is an answer."""
        try:
            yield
        except PeerError as exc:
            if exc.code in _UNREACHED:
                self.contacts.unreachable(address, time.time(), str(exc))
            else:
                self.contacts.answered(address, time.time())
            raise
        except CorruptItem:
            self.contacts.answered(address, time.time())
            raise
        self.contacts.answered(address, time.time())

    async def probe(self, address: str, timeout: float = PROBE_SECONDS) -> bool:
        """Ask ``address``'s health service whether it serves (cheap, no data); the answer,
        also noted in ``contacts``. A peer that answers NOT_SERVING is starting or stopping:
        noted as not reachable, with that reason."""
        self._stub(address)  # the address's channel, made with this node's TLS
        health = health_pb2_grpc.HealthStub(self._channels[address])
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            reason = f"health check at {address}: {exc.code().name}: {exc.details() or ''}"
            if exc.code() in _UNREACHED:
                self.contacts.unreachable(address, time.time(), reason)
            else:
                self.contacts.answered(address, time.time())
            return False
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            self.contacts.unreachable(address, time.time(), f"{address} is {status}")
            return False
        self.contacts.answered(address, time.time())
        return True

    def _stub(self, address: str) -> peer_pb2_grpc.PeerAsyncStub:
        if self.tls is not None:
            self.tls.refresh()
            if self.tls.generation != self._generation:
                # New calls get the new certificate; old channels are closed with the client.
                self._generation = self.tls.generation
                self._retired.extend(self._channels.values())
                self._channels, self._stubs = {}, {}
        stub = self._stubs.get(address)
        if stub is None:
            channel = open_channel(address, CHANNEL_OPTIONS, self.tls)
            self._channels[address] = channel
            stub = self._stubs[address] = peer_pb2_grpc.PeerStub(channel)
        return stub

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        channels, self._retired = [*channels, *self._retired], []
        for channel in channels:
            await channel.close()
        self.pool.shutdown()
        if self._own_executor:
            self.executor.shutdown(wait=True)

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _deadline(self, nbytes: int | None) -> float:
        if nbytes is None:
            return self.timeout + self.max_transfer_seconds
        return self.timeout + nbytes / self.min_rate

    def _channel_ok(self, address: str) -> bool:
        return self.data_channel and self._no_channel.get(address, 0.0) <= time.monotonic()

    @contextlib.contextmanager
    def _channel_slot(self, address: str) -> Iterator[bool]:
        """Whether to ask ``address`` for its data channel: it is reachable and a thread
        slot is free (held until the attempt ends)."""
        host = address.rpartition(":")[0]
        claimed = self._channel_ok(address) and self.pool.claim(host)
        try:
            yield claimed
        finally:
            if claimed:
                self.pool.release(host)

    def _channel_unreachable(self, address: str, exc: ChannelUnreachable) -> None:
        self._no_channel[address] = time.monotonic() + CHUNKS_AFTER_UNREACHABLE
        log.warning(
            "data channel of %s unreachable (%s): gRPC chunks for the next %.0f s",
            address,
            exc,
            CHUNKS_AFTER_UNREACHABLE,
        )

    async def _fallback(
        self, address: str, attempt: Callable[[bool], Awaitable[_R]], what: str
    ) -> _R:
        """``attempt(channel)`` on the data channel when ``address`` can have it, else (or
        once the channel failed there) in gRPC chunks: the one verdict on a data channel
        that failed, for pushes and pulls alike. An unreachable one is not tried again for
        ``CHUNKS_AFTER_UNREACHABLE`` seconds."""
        try:
            with self._channel_slot(address) as channel:
                return await attempt(channel)
        except ChannelUnreachable as exc:
            self._channel_unreachable(address, exc)
        except ChannelFailed as exc:
            log.warning("%s: %s again in gRPC chunks", exc, what)
        return await attempt(False)

    @_noting_contact
    async def push_item(
        self,
        address: str,
        manifest: Manifest,
        data_path: Path,
        root: Path | None = None,
        *,
        pool_copy: bool = False,
    ) -> bool:
        """Send a committed item; True when the peer already held it (nothing was sent).
        Its files are read from ``root`` (the store) down through no symlink. ``pool_copy``:
        a one-node job's item for a node that does not run the job (``core.pool``).

        Raises ``CorruptItem`` when the bytes sent do not match the manifest (the peer
        answered DATA_LOSS, or the local copy is short), ``PeerUnavailable`` when trying
        again later may work (unreachable, deadline, busy, full), ``PeerError`` otherwise
        (for example, the peer does not take this job now: FAILED_PRECONDITION). A data
        channel that cannot be reached is not an error: the item goes in chunks.
        """
        # Replication: every byte sent is booked with the node's pacer (the rate limit,
        # restores first, saves), on the data channel and in chunks alike.
        with self.pacer.transfer(Traffic.REPLICATION, job=manifest.item.job) as meter:
            send = _Send(manifest, data_path, root, meter, pool_copy)

            async def attempt(channel: bool) -> bool:
                if channel:
                    return await self._push(address, send, True)
                for _ in range(BUSY_RETRIES):
                    try:
                        return await self._push(address, send, False)
                    except PeerUnavailable as exc:
                        # The failed attempt's cancel may not have reached the other side yet.
                        if exc.code is not grpc.StatusCode.ABORTED:
                            raise
                        await asyncio.sleep(BUSY_SECONDS)
                return await self._push(address, send, False)

            return await self._fallback(address, attempt, "sending it")

    def _push_deadline(self, nbytes: int) -> float:
        """The deadline of a push, honest about pacing.

        A paced push may legitimately be much slower than ``min_rate``: the limit is shared
        by every push and backup upload in flight, and a save holds it for up to
        ``yield_to_saves`` seconds. So it assumes at least ``1 / PACED_SHARE`` of the limit
        plus one save's hold. A push held by a restore this node serves is slower still
        (a trickle, for as long as the restore lasts): such a push may run out of time and
        is then retried (DEADLINE_EXCEEDED is a retryable ``PeerUnavailable``), which is
        cheaper than a deadline that never catches a peer that hangs. A dead peer is caught
        long before either: the idle timeouts on each chunk and on the data connection, and
        gRPC's keepalives.
        """
        rules = self.pacer.rules
        floor = self.min_rate
        if rules.rate is not None:
            floor = min(floor, rules.rate / PACED_SHARE)
        return self.timeout + rules.yield_to_saves + nbytes / floor

    async def _push(self, address: str, send: _Send, channel: bool) -> bool:
        manifest = send.manifest
        header = pb.PushHeader(
            item=item_ref(manifest.item),
            manifest=manifest.to_json(),
            manifest_digest=manifest.digest,
            data_channel=channel,
            data_streams=self.data_streams if channel else 0,
            pool_copy=send.pool_copy,
        )
        watch = Stopwatch()
        call = self._stub(address).PushItem(timeout=self._push_deadline(manifest.total_bytes))
        cut_short = False
        offered = False
        broken: ChannelBroken | None = None
        what = f"push of {manifest.item}"
        try:
            try:
                await call.write(pb.PushItemRequest(header=header))
                metadata = tuple(await call.initial_metadata() or ())
                if GO_AHEAD in metadata:
                    try:
                        offer = push_offer(metadata)
                        if offer is not None:
                            check_streams(offer, manifest, self.data_streams)
                    except TransferError as exc:
                        raise PeerError(address, f"{what}: {exc}") from None
                    sink: sending.Sink = self._chunk_writer(call, what)
                    if offer is not None:
                        offered = True
                        sink = dialled(
                            address, offer, timeout=self.timeout, tls=self.tls, pool=self.pool
                        )
                    try:
                        await sending.send(
                            manifest, send.data, sink, send.meter, root=send.root, what=what
                        )
                    except ChannelUnreachable:
                        raise  # _fallback tries again in chunks; this call is cancelled
                    except ChannelBroken as exc:
                        broken = exc  # the peer's status, if it has one, says more
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                cut_short = True  # the peer ended the call mid-stream; its status says why
            if broken is None:
                response = await call
            else:
                try:
                    response = await asyncio.wait_for(asyncio.shield(call), VERDICT_SECONDS)
                except TimeoutError:
                    raise ChannelFailed(address, f"{what} to {address}: {broken}") from None
        except grpc.aio.AioRpcError as exc:
            if cut_short and exc.code() is grpc.StatusCode.INTERNAL:
                # A peer drains the stream before it answers, so this is rare: a write was
                # in flight when the call ended, and grpc.aio replaced the peer's status.
                raise PeerUnavailable(
                    address,
                    f"{what} at {address}: the peer ended it mid-stream (its reason is in its log)",
                    exc.code(),
                ) from None
            error = _rpc_error(exc, address, what)
            if offered and exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise ChannelFailed(address, str(error), exc.code()) from None
            raise error from None
        finally:
            call.cancel()  # a no-op once answered; after a local read error, stop the peer
        JobLog(log, manifest.item.job, manifest.item.rank).info(
            "pushed %s to %s: %s",
            manifest.item,
            address,
            "already held" if response.already_had else watch.summary(response.bytes_received),
            step=manifest.item.step,
        )
        if not response.already_had:
            self.metrics.transfer(
                TransferKind.REPLICATE_OUT, response.bytes_received, watch.seconds()
            )
        return response.already_had

    def _chunk_writer(
        self,
        call: grpc.aio.StreamUnaryCall[pb.PushItemRequest, pb.PushItemResponse],
        what: str,
    ) -> sending.ChunkWrite:
        """A push's chunks as the call's next messages, each written within the timeout."""

        async def write(index: int, offset: int, buf: bytes, crc: int) -> None:
            request = pb.PushItemRequest()
            fill_chunk(request.chunk, index, offset, buf, crc)
            await within(call.write(request), self.timeout, what)

        return write

    @_noting_contact
    async def pull_item(
        self,
        address: str,
        item: ItemId,
        store: LocalStore,
        expected_digest: str | None = None,
        *,
        total_bytes: int | None = None,
        vet: Callable[[Manifest], object] | None = None,
    ) -> Manifest:
        """Fetch ``item`` into ``store``, verified chunk by chunk and file by file, committed
        with its manifest last; its manifest. ``total_bytes`` (from a listing) tightens the
        deadline. ``vet`` judges the manifest before any byte of data comes (it raises to
        refuse the item: the caller's own error, unchanged).

        Raises ``CorruptItem`` on any checksum or size mismatch (nothing is committed),
        ``ItemNotFound`` when the peer does not hold it, ``PeerError`` for another digest or
        a malformed stream, ``PeerUnavailable`` when trying again later may work, and
        ``StoreError`` when the local store cannot take it (``receiving.TooLarge`` when it
        has no room, by the rule a push here meets). A data channel that cannot be reached
        is not an error: the item comes in chunks. The caller logs and counts the transfer
        (``cluster.sources``, with the restore's other transfers).
        """
        receiving = self.receiving
        if receiving is None or receiving.store is not store:
            receiving = Receiving(store, self.executor)

        async def attempt(channel: bool) -> Manifest:
            request = pb.PullItemRequest(
                item=item_ref(item),
                manifest_digest=expected_digest or "",
                data_channel=channel,
                data_streams=self.data_streams if channel else 0,
            )
            stream = self._stub(address).PullItem(request, timeout=self._deadline(total_bytes))
            try:
                return await self._pull(
                    address, stream, receiving, item, expected_digest=expected_digest, vet=vet
                )
            finally:
                stream.cancel()  # a no-op once the stream ended; stops the sender otherwise

        return await self._fallback(address, attempt, "fetching it")

    async def _pull(
        self,
        address: str,
        stream: grpc.aio.UnaryStreamCall[pb.PullItemRequest, pb.PullItemResponse],
        receiving: Receiving,
        item: ItemId,
        *,
        expected_digest: str | None,
        vet: Callable[[Manifest], object] | None,
    ) -> Manifest:
        what = f"pull of {item} at {address}"
        offered = False
        try:
            responses = idle_bounded(aiter(stream), self.timeout, what)
            first = await anext(responses, None)
            if first is None or first.WhichOneof("body") != "header":
                raise PeerError(address, f"{what}: no header came first")
            header = first.header
            if expected_digest and header.manifest_digest != expected_digest:
                raise PeerError(address, f"{what}: another digest came")
            try:
                manifest = await receiving.check(header.manifest, header.manifest_digest, item, vet)
                offer = channel_offer(header.data_port, header.data_token, header.more_tokens)
                if offer is not None:
                    check_streams(offer, manifest, self.data_streams)
            except (ManifestError, TransferError) as exc:
                raise PeerError(address, f"{what}: {exc}") from None
            source: Source = chunks_of(responses)
            if offer is not None:
                offered = True
                source = dialled(address, offer, timeout=self.timeout, tls=self.tls, pool=self.pool)
            try:
                async with receiving.reserved(manifest):
                    await receiving.take(
                        manifest, source, what=what, kind=TransferKind.RESTORE_PEER
                    )
                if offered and await anext(responses, None) is not None:
                    raise TransferError("a message came after the data channel's bytes")
            except (TransferError, ChannelProtocolError) as exc:
                raise PeerError(address, f"{what}: {exc}") from None
            except ChannelUnreachable:
                raise  # _fallback tries again in chunks; this call is cancelled
            except ChannelBroken as exc:
                # The sender's status, if it failed, says more than the broken connection.
                with contextlib.suppress(TimeoutError, StopAsyncIteration, StreamIdle):
                    await asyncio.wait_for(anext(responses), VERDICT_SECONDS)
                raise ChannelFailed(address, f"{what}: {exc}") from None
        except StreamIdle as exc:
            raise PeerUnavailable(address, f"{what}: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            error = _rpc_error(exc, address, f"pull of {item}")
            if offered and exc.code() is grpc.StatusCode.UNAVAILABLE:
                raise ChannelFailed(address, str(error), exc.code()) from None
            raise error from None
        return manifest

    @_noting_contact
    async def list_items(self, address: str, job: str | None = None) -> list[ItemInfo]:
        """The committed items ``address`` holds (of ``job`` only, when given)."""
        request = pb.ListItemsRequest(job=job or "")
        try:
            response = await self._stub(address).ListItems(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, address, "list of items") from None
        infos = []
        for info in response.items:
            try:
                infos.append(ItemInfo(item_id(info.item), info.manifest_digest, info.total_bytes))
            except TransferError as exc:
                raise PeerError(address, f"list of items at {address}: {exc}") from None
        return infos
