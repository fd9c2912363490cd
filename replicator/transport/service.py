"""The ``mtc.v1.Peer`` service: what a daemon answers to other daemons. I/O module.

Handlers run in the daemon's asyncio loop (grpc.aio). A push is hostile input: its header is
checked completely (job name, manifest safety, digest, item, size, whether this node takes
the job) before anything touches the disk; its chunks then go through
``transfer.receive_item`` into a staging directory, and the item is committed with its
manifest last. A push of an item already held with the same digest is answered at once.
Our exceptions become status codes in one place, ``status_for``; every transfer is logged
with its bytes, seconds and MB/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from typing import Any, NoReturn

import grpc
import grpc.aio

from replicator._pb.mtc.v1 import peer_pb2 as pb
from replicator._pb.mtc.v1 import peer_pb2_grpc
from replicator.core.contract import JOB_NAME_RE
from replicator.core.manifest import Cancelled, CorruptItem, ItemId, Manifest, ManifestError
from replicator.local.store import LocalStore, StoreError
from replicator.obs.logs import JobLog
from replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from replicator.transport.datachannel import (
    ChannelBroken,
    ChannelProtocolError,
    DataListener,
    receive_staged,
    send_staged,
)
from replicator.transport.peer import (
    DATA_CHANNEL_KEY,
    GO_AHEAD,
    chunks_of,
    fill_chunk,
    item_id,
    item_ref,
    rate,
)
from replicator.transport.transfer import (
    RESERVE_BYTES,
    TransferError,
    check_manifest,
    iter_chunks,
    receive_item,
    room_on,
)

log = logging.getLogger(__name__)


class Refused(Exception):
    """The request is well formed but this node will not serve it (wrong job, other digest)."""


class NotHeld(Exception):
    """This node holds no such committed item."""


class TooLarge(Exception):
    """The item does not fit in what this node may take."""


class Busy(Exception):
    """Another transfer of the same item is in flight here; try again later."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that turns a servicer-side exception into a gRPC status."""
    cause = exc.__cause__ if isinstance(exc, StoreError) else exc
    if isinstance(exc, (ManifestError, TransferError, ChannelProtocolError)):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, CorruptItem):
        code = grpc.StatusCode.DATA_LOSS
    elif isinstance(exc, Refused):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, NotHeld):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, TooLarge):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif isinstance(exc, Busy):
        code = grpc.StatusCode.ABORTED
    elif isinstance(exc, (Cancelled, ChannelBroken)):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        code = grpc.StatusCode.INTERNAL
    return code, str(exc) or type(exc).__name__


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], method: str, exc: Exception
) -> NoReturn:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s from %s failed: %s", method, context.peer(), message, exc_info=exc)
    else:
        log.warning("%s from %s refused: %s: %s", method, context.peer(), code.name, message)
    await context.abort(code, message)


async def _drain(requests: AsyncIterator[pb.PushItemRequest], budget: int) -> None:
    """Read and drop what the sender still has in flight, up to about ``budget`` bytes.

    Answering while the sender's writes are in flight can make grpc.aio on its side report
    "Internal error from Core" instead of our status; a sender that stops in time gets the
    real one. A stream that goes on past the budget (a whole item) gets the answer anyway.
    """
    with contextlib.suppress(Exception):
        async for message in requests:
            budget -= message.ByteSize()
            if budget < 0:
                return


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """``mtc.v1.Peer`` over this node's store; handlers run in the daemon's asyncio loop."""

    def __init__(
        self,
        store: LocalStore,
        executor: Executor,
        accepts_job: Callable[[str], bool],
        *,
        max_item_bytes: int | None = None,
        reserve_bytes: int = RESERVE_BYTES,
        metrics: Metrics = NO_METRICS,
        channel: DataListener | None = None,
        channel_timeout: float = 30.0,
    ) -> None:
        """``max_item_bytes`` caps one push; by default, the store's free space minus a
        margin (``room_on``) and minus what pushes in flight will still write. With a
        ``channel``, transfers that ask for it move their bytes there; ``channel_timeout``
        bounds the wait for its connection and any stall on it."""
        self.store = store
        self.channel = channel
        self.channel_timeout = channel_timeout
        self.executor = executor
        self.accepts_job = accepts_job
        self.max_item_bytes = max_item_bytes
        self.reserve_bytes = reserve_bytes
        self.metrics = metrics
        self._inflight: dict[ItemId, int] = {}

    def _room(self) -> int:
        if self.max_item_bytes is not None:
            return self.max_item_bytes
        incoming = sum(self._inflight.values())
        return room_on(self.store.root, self.reserve_bytes) - incoming

    def _check_push(self, header: pb.PushHeader) -> Manifest:
        item = item_id(header.item)
        if not self.accepts_job(item.job):
            raise Refused(f"this node does not take items of job {item.job!r} now")
        manifest = check_manifest(header.manifest, header.manifest_digest, item)
        room = self._room()
        if manifest.total_bytes > room:
            raise TooLarge(
                f"{item}: {manifest.total_bytes} bytes do not fit, this node can take {room}"
            )
        return manifest

    async def PushItem(
        self,
        request_iterator: AsyncIterator[pb.PushItemRequest],
        context: grpc.aio.ServicerContext[pb.PushItemRequest, pb.PushItemResponse],
    ) -> pb.PushItemResponse:
        try:
            return await self._push(request_iterator, context)
        except Exception as exc:
            await _abort(context, "PushItem", exc)

    async def _push(
        self,
        requests: AsyncIterator[pb.PushItemRequest],
        context: grpc.aio.ServicerContext[pb.PushItemRequest, pb.PushItemResponse],
    ) -> pb.PushItemResponse:
        t0 = time.monotonic()
        peer = context.peer()
        first = await anext(requests, None)
        if first is None or first.WhichOneof("body") != "header":
            raise TransferError("a push starts with its header")
        manifest = self._check_push(first.header)
        item = manifest.item
        jlog = JobLog(log, item.job, item.rank)
        held = self.store.get(item)
        if held is not None and held.digest == first.header.manifest_digest:
            jlog.info("push of %s from %s: already held", item, peer, step=item.step)
            return pb.PushItemResponse(already_had=True)
        if item in self._inflight:
            raise Busy(f"{item}: another transfer of this item is in flight")
        self._inflight[item] = manifest.total_bytes
        ticket = (
            self.channel.issue()
            if self.channel is not None and first.header.data_channel and manifest.total_bytes
            else None
        )
        try:
            if ticket is None:
                await context.send_initial_metadata((GO_AHEAD,))
                nbytes = await receive_item(
                    self.store, manifest, chunks_of(requests), self.executor
                )
            else:
                assert self.channel is not None
                offer = f"{self.channel.port} {ticket.token_hex}"
                await context.send_initial_metadata((GO_AHEAD, (DATA_CHANNEL_KEY, offer)))
                sock = await self.channel.connection(ticket, self.channel_timeout)
                nbytes = await receive_staged(
                    self.store, manifest, sock, idle_timeout=self.channel_timeout
                )
        except asyncio.CancelledError:
            jlog.warning("push of %s from %s cancelled", item, peer, step=item.step)
            raise
        except Exception:
            if ticket is None:  # on the data channel, no chunks are in flight to race
                await _drain(requests, manifest.total_bytes)
            raise
        finally:
            del self._inflight[item]
            if ticket is not None:
                assert self.channel is not None
                self.channel.withdraw(ticket)  # closes its connection
        dt = time.monotonic() - t0
        jlog.info(
            "received %s from %s %s: %d bytes in %.3fs (%.1f MB/s)",
            item,
            peer,
            "in gRPC chunks" if ticket is None else "over the data channel",
            nbytes,
            dt,
            rate(nbytes, dt),
            step=item.step,
        )
        self.metrics.transfer(TransferKind.REPLICATE_IN, nbytes, dt)
        return pb.PushItemResponse(bytes_received=nbytes)

    async def PullItem(
        self,
        request: pb.PullItemRequest,
        context: grpc.aio.ServicerContext[pb.PullItemRequest, pb.PullItemResponse],
    ) -> AsyncIterator[pb.PullItemResponse]:
        try:
            t0 = time.monotonic()
            item = item_id(request.item)
            manifest = self.store.get(item)
            if manifest is None:
                raise NotHeld(f"{item}: not held here")
            digest = manifest.digest
            if request.manifest_digest and request.manifest_digest != digest:
                raise Refused(f"{item}: held with digest {digest}, not {request.manifest_digest}")
            header = pb.PullHeader(manifest=manifest.to_json(), manifest_digest=digest)
            data = self.store.data_path(item)
            via = "in gRPC chunks"
            if self.channel is not None and request.data_channel and manifest.total_bytes:
                via = "over the data channel"
                ticket = self.channel.issue()
                try:
                    header.data_port = self.channel.port
                    header.data_token = ticket.token
                    yield pb.PullItemResponse(header=header)
                    sock = await self.channel.connection(ticket, self.channel_timeout)
                    try:
                        await send_staged(
                            manifest,
                            data,
                            sock,
                            idle_timeout=self.channel_timeout,
                            root=self.store.root,
                        )
                    except FileNotFoundError:
                        raise NotHeld(f"{item}: deleted (retention) while being sent") from None
                finally:
                    self.channel.withdraw(ticket)  # closes its connection
            else:
                yield pb.PullItemResponse(header=header)
                try:
                    with contextlib.closing(
                        iter_chunks(manifest, data, root=self.store.root)
                    ) as chunks:
                        for index, offset, buf, crc in chunks:
                            response = pb.PullItemResponse()
                            fill_chunk(response.chunk, index, offset, buf, crc)
                            yield response
                except FileNotFoundError:
                    raise NotHeld(f"{item}: deleted (retention) while being sent") from None
            dt = time.monotonic() - t0
            JobLog(log, item.job, item.rank).info(
                "sent %s to %s %s: %d bytes in %.3fs (%.1f MB/s)",
                item,
                context.peer(),
                via,
                manifest.total_bytes,
                dt,
                rate(manifest.total_bytes, dt),
                step=item.step,
            )
            self.metrics.transfer(TransferKind.SERVE_PULL, manifest.total_bytes, dt)
        except Exception as exc:
            await _abort(context, "PullItem", exc)

    async def ListItems(
        self,
        request: pb.ListItemsRequest,
        context: grpc.aio.ServicerContext[pb.ListItemsRequest, pb.ListItemsResponse],
    ) -> pb.ListItemsResponse:
        try:
            job = request.job or None
            if job is not None and (not JOB_NAME_RE.fullmatch(job) or ".." in job):
                raise TransferError(f"unsafe job name {job!r:.80}")
            return pb.ListItemsResponse(
                items=[
                    pb.ItemInfo(
                        item=item_ref(item),
                        manifest_digest=m.digest,
                        total_bytes=m.total_bytes,
                    )
                    for item, m in sorted(self.store.manifests(job).items())
                ]
            )
        except Exception as exc:
            await _abort(context, "ListItems", exc)

    def register(self, server: grpc.aio.Server) -> None:
        peer_pb2_grpc.add_PeerServicer_to_server(self, server)
