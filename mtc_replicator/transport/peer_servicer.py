"""The ``mtc.v1.Peer`` service: what a daemon answers to other daemons. I/O module.

Handlers run in the daemon's asyncio loop (grpc.aio). A push is hostile input: its header is
checked completely before anything touches the disk or a data-channel token is issued:
whether this node takes the item at all (``core.admission``: its job, its rank, its step),
then ``transport.receiving`` checks the manifest, its attestation and room for it, and
stages, verifies and commits its bytes. A push of an item already held with the same
digest is answered at once; one with another digest is refused, never committed in its
place. A pulled item's bytes go out through ``transport.sending``. This module is the RPC
plumbing around the two: what to tell the other side, and when. Our exceptions become
status codes in one place, ``status_for``; every transfer is logged with its bytes, seconds
and MB/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import grpc.aio

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.admission import (
    MAX_STEP_LEAD,
    Admission,
    Served,
    Verdict,
    admit_copy,
    admit_push,
)
from mtc_replicator.core.attestation import OPEN_MANIFESTS, ManifestTrust, Unattested
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import (
    DEFAULT_MAX_ITEM_FILES,
    Cancelled,
    CorruptItem,
    ItemId,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.pacing import DEFAULT_MIN_TRANSFER_RATE, Traffic
from mtc_replicator.core.stripes import stream_count
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import StoreError
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.transport import sending
from mtc_replicator.transport.dataconn import DataListener, Ticket, accepted
from mtc_replicator.transport.identity import caller
from mtc_replicator.transport.obtaining import Obtain, Obtaining
from mtc_replicator.transport.peerwire import (
    DATA_CHANNEL_KEY,
    GO_AHEAD,
    chunks_of,
    fill_chunk,
    item_id,
    item_ref,
    offer_text,
)
from mtc_replicator.transport.pool_holding import NO_POOL, PoolHolding
from mtc_replicator.transport.receiving import ItemInFlight, Receiving, Source, TooLarge
from mtc_replicator.transport.streams import (
    ChannelBroken,
    ChannelProtocolError,
    StreamIdle,
    TooSlow,
    TransferError,
    idle_bounded,
    within,
)

log = logging.getLogger(__name__)

IDLE_SECONDS = 30.0
"""Default idle timeout of every transfer stream (``--idle-timeout-seconds``)."""
MAX_TRANSFERS_PER_PEER = 32
"""Pushes and pulls one peer address may have in flight here at once; more are refused
RESOURCE_EXHAUSTED (a peer retries). A node makes one or two at a time."""


class Refused(Exception):
    """The request is well formed but this node will not serve it (wrong job, other digest)."""


class NotAllowed(Exception):
    """The caller may not send this item here (not a rank that pushes to this node), or read
    this job's items (not a node of its grant)."""


class Conflict(Exception):
    """Another item with this id is committed here; a push never replaces it."""


class NotHeld(Exception):
    """This node holds no such committed item."""


class Busy(Exception):
    """This node's restore round is obtaining a pulled item now; try again later."""


class PeerOverLimit(Exception):
    """One peer has as many transfers in flight here as it may."""


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``):
    the limits per peer count connections from one host, whatever their ports."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that turns a servicer-side exception into a gRPC status."""
    cause = exc.__cause__ if isinstance(exc, StoreError) else exc
    if isinstance(exc, (ManifestError, TransferError, ChannelProtocolError)):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, (NotAllowed, Unattested)):
        code = grpc.StatusCode.PERMISSION_DENIED
    elif isinstance(exc, Conflict):
        code = grpc.StatusCode.ALREADY_EXISTS
    elif isinstance(exc, CorruptItem):
        code = grpc.StatusCode.DATA_LOSS
    elif isinstance(exc, Refused):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, NotHeld):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, (TooLarge, PeerOverLimit)):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif isinstance(exc, (Busy, ItemInFlight)):
        code = grpc.StatusCode.ABORTED
    elif isinstance(exc, (Cancelled, ChannelBroken, StreamIdle)):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif isinstance(cause, OSError) and cause.errno == errno.ENAMETOOLONG:
        code = grpc.StatusCode.INVALID_ARGUMENT  # the manifest's limits should catch it first
    else:
        code = grpc.StatusCode.INTERNAL
    return code, str(exc) or type(exc).__name__


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], method: str, exc: Exception
) -> NoReturn:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s from %s failed: %s", method, context.peer(), message, exc_info=exc)
    elif isinstance(exc, (Busy, ItemInFlight)):  # "try again shortly": asked every second
        log.info("%s from %s: %s", method, context.peer(), message)
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


def _way(connections: int) -> str:
    """How a transfer's bytes moved, for its log line."""
    if connections == 0:
        return "in gRPC chunks"
    if connections == 1:
        return "over the data channel"
    return f"over the data channel ({connections} connections)"


def _refuse_unless(admission: Admission) -> None:
    """Raise the exception ``status_for`` turns into the verdict's status code."""
    if admission.accepted:
        return
    reason = admission.reason
    if admission.verdict is Verdict.NOT_IN_JOB:
        raise TransferError(reason)
    if admission.verdict is Verdict.NOT_A_PUSHER:
        raise NotAllowed(reason)
    if admission.verdict is Verdict.CONFLICT:
        raise Conflict(reason)
    raise Refused(reason)  # NOT_SERVED, TOO_FAR_AHEAD: FAILED_PRECONDITION


@dataclass(frozen=True)
class ServiceRules:
    """The bounds every transfer this node serves keeps."""

    max_step_lead: int = MAX_STEP_LEAD
    """How far ahead of this rank's newest step a pushed step may be."""
    idle_timeout: float = IDLE_SECONDS
    """Every wait on the other side: a header, the next chunk, room to send one, the data
    connection, a stall on it."""
    max_transfers_per_peer: int = MAX_TRANSFERS_PER_PEER
    max_item_files: int = DEFAULT_MAX_ITEM_FILES
    """The most files and directories one pushed item may list (refused before any is
    checked or staged); every push must also leave inodes free (``receiving``)."""
    data_streams: int = 1
    """The most data connections one transfer may use here (``core.stripes``): the other
    side asks for as many as it can use, and gets the lesser."""
    min_rate: float | None = DEFAULT_MIN_TRANSFER_RATE
    """A push or a pull served must move its bytes at this average rate after a grace of
    ``idle_timeout`` (``core.pacing.transfer_deadline``) or it is dropped, its reservation
    and staging with it; None: no floor."""


DEFAULT_RULES = ServiceRules()


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """``mtc.v1.Peer`` over this node's store; handlers run in the daemon's asyncio loop."""

    def __init__(
        self,
        receiving: Receiving,
        serving: Callable[[str], Served | None],
        *,
        rules: ServiceRules = DEFAULT_RULES,
        metrics: Metrics = NO_METRICS,
        channel: DataListener | None = None,
        obtaining: Obtaining | None = None,
        pacer: Pacer | None = None,
        handed_over: Callable[[], bool] = lambda: False,
        trust: ManifestTrust = OPEN_MANIFESTS,
        readers: Callable[[str], Collection[str] | None] = lambda job: None,
        pool: PoolHolding | None = None,
    ) -> None:
        """``receiving``: how an incoming item is checked and taken into the store (the
        node's one, shared with its pulls). ``serving(job)`` says how this node serves
        ``job`` now (None: it runs no incarnation of it), read for every push; ``rules``:
        the bounds every transfer here keeps (``ServiceRules``). With a ``channel``,
        transfers that ask for it move their bytes there while it has a free slot for the
        peer. ``obtaining`` says which items this node's restore round is still fetching,
        so a pull of one is told to try again (ABORTED) or, once the round gave it up, to
        go elsewhere (FAILED_PRECONDITION), instead of NOT_FOUND. ``pacer``: the node's
        outgoing transfers; a pull served is a restore (first, never throttled).
        ``handed_over``: whether the node changed hands and its store is not emptied yet
        (``core.handoff``; blocking, run on the receiving's executor): no pull is served
        nor item listed meanwhile. ``trust``: which pushed items are attested for the job
        served (``core.attestation``), checked before a byte is staged. ``pool``: how pool
        copies are taken (``core.pool``); None: refused."""
        self.receiving, self.store = receiving, receiving.store
        self.serving, self.rules = serving, rules
        self.readers = readers
        """The nodes that may list and pull a job's items: its grant's (``core.grant``);
        None, no grant: any node of the CA."""
        self.channel, self.pool, self.obtaining = channel, pool, obtaining
        self.trust, self.handed_over = trust, handed_over
        self.pacer = pacer or Pacer()
        self.metrics = metrics
        self._per_peer: dict[str, int] = {}

    @contextlib.contextmanager
    def _admitted(self, host: str) -> Iterator[None]:
        """Count a transfer against its peer's limit for as long as it runs."""
        if self._per_peer.get(host, 0) >= self.rules.max_transfers_per_peer:
            raise PeerOverLimit(
                f"{host} has {self.rules.max_transfers_per_peer} transfers in flight here already"
            )
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        try:
            yield
        finally:
            self._per_peer[host] -= 1
            if not self._per_peer[host]:
                del self._per_peer[host]

    @contextlib.contextmanager
    def _channel_slot(
        self, host: str, wanted: bool, streams: int, manifest: Manifest
    ) -> Iterator[tuple[Ticket, ...]]:
        """Data-channel tickets for this transfer, one per connection (as many as the
        other side asked for, this node allows and the item's files can fill,
        ``core.stripes``), when it asked for the channel and there is a free slot for
        ``host``; none otherwise. Slot and tickets released after."""
        channel = self.channel
        if (
            channel is None
            or not wanted
            or manifest.total_bytes <= 0
            or not channel.pool.claim(host)
        ):
            yield ()
            return
        sizes = [entry.size for entry in manifest.files]
        count = stream_count(sizes, min(max(streams, 1), self.rules.data_streams))
        tickets = tuple(channel.issue() for _ in range(count))
        try:
            yield tickets
        finally:
            for ticket in tickets:
                channel.withdraw(ticket)  # closes its connection
            channel.pool.release(host)

    async def _check_push(self, header: pb.PushHeader) -> tuple[Manifest, bool]:
        """The pushed manifest, checked, and whether the same copy is held already."""
        item = item_id(header.item)
        served = self.serving(item.job)
        owner, producers = (None if served is None else served.owner), None
        # Admission first: a push this node must not take costs no manifest parsing.
        if not header.pool_copy:
            admission = admit_push(served, item, max_lead=self.rules.max_step_lead, pusher=caller())
        elif self.pool is None:
            admission = NO_POOL
        else:
            runs_here = served is not None
            admission, owner, producers = await self.pool.admit(item, caller(), runs_here)
        _refuse_unless(admission)
        trust, by = self.trust, owner

        def attested(manifest: Manifest) -> None:
            if by is not None:
                trust.check(manifest, by, producers)

        manifest = await self.receiving.check(
            header.manifest,
            header.manifest_digest,
            item,
            attested,
            max_files=self.rules.max_item_files,
        )
        held = self.store.get(item)
        admission = admit_copy(item, manifest.digest, held.digest if held is not None else None)
        if admission.verdict is Verdict.ALREADY_HELD:
            return manifest, True
        _refuse_unless(admission)
        return manifest, False

    async def PushItem(
        self,
        request_iterator: AsyncIterator[pb.PushItemRequest],
        context: grpc.aio.ServicerContext[pb.PushItemRequest, pb.PushItemResponse],
    ) -> pb.PushItemResponse:
        try:
            with self._admitted(peer_host(context.peer())):
                return await self._push(request_iterator, context)
        except Exception as exc:
            await _abort(context, "PushItem", exc)

    async def _push(
        self,
        requests: AsyncIterator[pb.PushItemRequest],
        context: grpc.aio.ServicerContext[pb.PushItemRequest, pb.PushItemResponse],
    ) -> pb.PushItemResponse:
        watch = Stopwatch()
        peer = context.peer()
        idle = self.rules.idle_timeout
        first = await within(anext(requests, None), idle, "a push's header")
        if first is None or first.WhichOneof("body") != "header":
            raise TransferError("a push starts with its header")
        manifest, held = await self._check_push(first.header)
        item = manifest.item
        jlog = JobLog(log, item.job, item.rank)
        if held:
            jlog.info("push of %s from %s: already held", item, peer, step=item.step)
            return pb.PushItemResponse(already_had=True)
        failed: Exception | None = None
        offered = False
        try:
            # Released before any draining: a stalled or hostile sender holds nothing.
            async with self.receiving.reserved(manifest):
                with self._channel_slot(
                    peer_host(peer),
                    first.header.data_channel,
                    first.header.data_streams,
                    manifest,
                ) as tickets:
                    offered = bool(tickets)
                    source = await self._go_ahead(requests, context, item, tickets)
                    nbytes = await self.receiving.take(
                        manifest,
                        source,
                        what=f"push of {item} from {peer}",
                        kind=TransferKind.REPLICATE_IN,
                        floor=self.rules.min_rate,
                        grace=idle,
                    )
        except asyncio.CancelledError:
            jlog.warning("push of %s from %s cancelled", item, peer, step=item.step)
            raise
        except (ItemInFlight, TooLarge):
            raise  # refused before the go-ahead: nothing was sent yet
        except Exception as exc:
            failed = exc
        if failed is not None:
            # On the data channel, no chunks are in flight to race; a stalled sender has none.
            if not offered and not isinstance(failed, StreamIdle):
                await _drain(idle_bounded(requests, idle, "drain"), manifest.total_bytes)
            raise failed
        jlog.info(
            "received %s from %s %s: %s",
            item,
            peer,
            _way(len(tickets)),
            watch.summary(nbytes),
            step=item.step,
        )
        self.metrics.transfer(TransferKind.REPLICATE_IN, nbytes, watch.seconds())
        if first.header.pool_copy and self.pool is not None:
            await self.pool.committed(item)
        return pb.PushItemResponse(bytes_received=nbytes)

    async def _go_ahead(
        self,
        requests: AsyncIterator[pb.PushItemRequest],
        context: grpc.aio.ServicerContext[pb.PushItemRequest, pb.PushItemResponse],
        item: ItemId,
        tickets: tuple[Ticket, ...],
    ) -> Source:
        """Tell the pusher to send (on the data channel, a connection per ticket, when
        there are ``tickets``); where the bytes come from."""
        idle = self.rules.idle_timeout
        if not tickets:
            await context.send_initial_metadata((GO_AHEAD,))
            return chunks_of(idle_bounded(requests, idle, f"push of {item}"))
        assert self.channel is not None
        offer = offer_text(self.channel.port, [ticket.token for ticket in tickets])
        await context.send_initial_metadata((GO_AHEAD, (DATA_CHANNEL_KEY, offer)))
        return accepted(self.channel, tickets, idle)

    async def PullItem(  # type: ignore[override]  # writes with context.write, below
        self,
        request: pb.PullItemRequest,
        context: grpc.aio.ServicerContext[pb.PullItemRequest, pb.PullItemResponse],
    ) -> None:
        # context.write, not yield: a write can then be given up on after the idle timeout
        # when the puller stops reading, which a suspended generator's yield cannot.
        try:
            with self._admitted(peer_host(context.peer())):
                await self._pull(request, context)
        except Exception as exc:
            if context.cancelled():  # the puller went away: a write failed, nobody to answer
                log.info("PullItem from %s cancelled: %s", context.peer(), exc)
                return
            await _abort(context, "PullItem", exc)

    async def _pull(
        self,
        request: pb.PullItemRequest,
        context: grpc.aio.ServicerContext[pb.PullItemRequest, pb.PullItemResponse],
    ) -> None:
        watch = Stopwatch()
        item = item_id(request.item)
        self._may_read(item.job)
        await self._not_handed_over()
        manifest = self.store.get(item)
        if manifest is None:
            state = None if self.obtaining is None else self.obtaining.state(item)
            if state is Obtain.IN_PROGRESS:
                raise Busy(f"{item}: being obtained here by the restore round; try again")
            if state is Obtain.GAVE_UP:
                raise Refused(f"{item}: the restore round here could not obtain it")
            raise NotHeld(f"{item}: not held here")
        digest = manifest.digest
        if request.manifest_digest and request.manifest_digest != digest:
            raise Refused(f"{item}: held with digest {digest}, not {request.manifest_digest}")
        header = pb.PullHeader(manifest=manifest.to_json(), manifest_digest=digest)
        idle, what = self.rules.idle_timeout, f"pull of {item}"
        sink: sending.Sink

        async def write(index: int, offset: int, buf: bytes, crc: int) -> None:
            response = pb.PullItemResponse()
            fill_chunk(response.chunk, index, offset, buf, crc)
            await within(context.write(response), idle, what)

        try:
            with self._channel_slot(
                peer_host(context.peer()), request.data_channel, request.data_streams, manifest
            ) as tickets:
                sink = write
                if tickets:
                    assert self.channel is not None
                    header.data_port = self.channel.port
                    header.data_token = tickets[0].token
                    header.more_tokens.extend(ticket.token for ticket in tickets[1:])
                    sink = accepted(self.channel, tickets, idle)
                await within(context.write(pb.PullItemResponse(header=header)), idle, what)
                # A restore: never throttled, and while it is served this node's pushes and
                # backup uploads trickle (the puller's job waits on these bytes).
                with self.pacer.transfer(Traffic.RESTORE) as meter:
                    await sending.send(
                        manifest,
                        self.store.data_path(item),
                        sink,
                        meter,
                        root=self.store.root,
                        what=f"{what} by {context.peer()}",
                        floor=self.rules.min_rate,
                        grace=idle,
                    )
        except FileNotFoundError:
            raise NotHeld(f"{item}: deleted (retention) while being sent") from None
        except TooSlow:
            self.metrics.transfer_too_slow(TransferKind.SERVE_PULL)
            raise
        JobLog(log, item.job, item.rank).info(
            "sent %s to %s %s: %s",
            item,
            context.peer(),
            _way(len(tickets)),
            watch.summary(manifest.total_bytes),
            step=item.step,
        )
        self.metrics.transfer(TransferKind.SERVE_PULL, manifest.total_bytes, watch.seconds())

    async def ListItems(
        self,
        request: pb.ListItemsRequest,
        context: grpc.aio.ServicerContext[pb.ListItemsRequest, pb.ListItemsResponse],
    ) -> pb.ListItemsResponse:
        try:
            job = request.job or None
            if job is not None and not is_job_name(job):
                raise TransferError(f"unsafe job name {job!r:.80}")
            if job is not None:
                self._may_read(job)
            await self._not_handed_over()
            readable = self._readable()
            return pb.ListItemsResponse(
                items=[
                    pb.ItemInfo(
                        item=item_ref(item),
                        manifest_digest=m.digest,
                        total_bytes=m.total_bytes,
                    )
                    for item, m in sorted(self.store.manifests(job).items())
                    if readable(item.job)
                ]
            )
        except Exception as exc:
            await _abort(context, "ListItems", exc)

    def _may_read(self, job: str) -> None:
        """A job with a grant is read by its grant's nodes alone (PERMISSION_DENIED)."""
        node = caller()
        allowed = self.readers(job)
        if allowed is None or node is None or node in allowed:
            return
        self.metrics.identity_refused("read")
        log.warning(
            "a read of job %s by node %r refused: not a node of its grant",
            job,
            node,
            extra={"job": job},
        )
        raise NotAllowed(
            f"job {job}'s items are read by the nodes mtc-controller gave its ranks to, "
            f"not {node[:100]!r}"
        )

    def _readable(self) -> Callable[[str], bool]:
        """For a listing of every job: the jobs this caller may read (the others left out)."""
        node = caller()
        if node is None:
            return lambda job: True
        return lambda job: (allowed := self.readers(job)) is None or node in allowed

    async def _not_handed_over(self) -> None:
        """Refuse while the node's previous owner's items are still here (a handoff)."""
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self.receiving.executor, self.handed_over):
            raise Refused("this node changed hands: its items are being removed")

    def register(self, server: grpc.aio.Server) -> None:
        peer_pb2_grpc.add_PeerServicer_to_server(self, server)
