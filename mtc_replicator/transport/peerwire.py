"""The conventions of the ``mtc.v1.Peer`` wire that both ends speak: the client
(``transport.peer_client``) and the service (``transport.peer_servicer``) import them from here, so
neither side imports the other. Constants and functions, no I/O of their own: the service name,
the metadata of a push's go-ahead and data-channel offer, message limits and channel
options, ``ItemRef`` <-> ``ItemId`` (a hostile job name refused), chunks in and out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.stripes import stream_count
from mtc_replicator.local.pacer import Meter
from mtc_replicator.transport.datachannel import TOKEN_BYTES
from mtc_replicator.transport.dataconn import Offer
from mtc_replicator.transport.streams import TransferError
from mtc_replicator.transport.transfer import SEND_CHUNK, Chunk

SERVICE = "mtc.v1.Peer"
GO_AHEAD = ("mtc-send-chunks", "1")
"""Initial metadata a receiver sends once it accepted a push's header: only then does the
sender stream chunks. Otherwise the receiver's answer (already held, or a refusal) races
the sender's writes, and grpc.aio can then report "Internal error from Core" instead."""
DATA_CHANNEL_KEY = "mtc-data-channel"
"""Initial metadata beside ``GO_AHEAD`` offering the receiver's data channel for a push's
bytes: ``"<port> <token as hex>"``, with one more token per further connection."""
MAX_MESSAGE_BYTES = 16 << 20
"""Largest gRPC message either side accepts: a 4 MiB chunk, or a header whose manifest
lists ~100k files. Explicit, since the default receive limit (4 MiB) is below a chunk."""

_MESSAGE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    *_MESSAGE_OPTIONS,
    # A peer that vanishes mid-transfer (node lost, no FIN) is detected in ~40 s, not hours.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    *_MESSAGE_OPTIONS,
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # Accept the clients' keepalive pings during a stalled transfer instead of GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Without this a second daemon on the same fixed port would silently share it.
    ("grpc.so_reuseport", 0),
    # One deadline for the whole TLS handshake and HTTP/2 preface (default 120 s): a client
    # dripping its ClientHello must not hold a connection longer than the data port allows.
    ("grpc.server_handshake_timeout_ms", 10_000),
    # Calls that arrived while the event loop was busy wait in gRPC's queue until the
    # server asks for them, one per loop turn. Past 1,000 of them gRPC drops new calls at
    # random (3,000: all): the joins of a 4,096-rank round arrive together, and each
    # dropped one costs a retry with backoff. A rank has one coordinator call in flight.
    ("grpc.server.max_pending_requests", 16384),
    ("grpc.server.max_pending_requests_hard_limit", 65536),
]


def item_id(ref: pb.ItemRef) -> ItemId:
    """An ``ItemRef`` from the wire, its job name checked like a manifest's."""
    if not is_job_name(ref.job):
        raise TransferError(f"unsafe job name {ref.job!r:.80}")
    return ItemId(ref.job, ref.step, ref.rank, ref.worker)


def item_ref(item: ItemId) -> pb.ItemRef:
    return pb.ItemRef(job=item.job, step=item.step, rank=item.rank, worker=item.worker)


async def chunks_of(
    messages: AsyncIterator[pb.PushItemRequest] | AsyncIterator[pb.PullItemResponse],
) -> AsyncIterator[Chunk]:
    """The chunks that follow a transfer's header, as ``transfer.receive_item`` takes them."""
    async for message in messages:
        if message.WhichOneof("body") != "chunk":
            raise TransferError("only chunks may follow the header")
        c = message.chunk
        yield c.file_index, c.offset, c.data, c.crc32c  # each access of a bytes field copies


def channel_offer(port: int, token: bytes, more: Sequence[bytes] = ()) -> Offer | None:
    """A data channel offered by the other daemon, checked: ``(port, tokens)``, one token
    per connection, or None when none was offered; ``TransferError`` when the offer is
    malformed."""
    if port == 0 and not token and not more:
        return None
    tokens = (token, *more)
    if not 0 < port < 65536 or any(len(t) != TOKEN_BYTES for t in tokens):
        sizes = "/".join(str(len(t)) for t in tokens)
        raise TransferError(f"malformed data channel offer: port {port}, {sizes}-byte token")
    return port, tokens


def check_streams(offer: Offer, manifest: Manifest, asked: int) -> None:
    """``TransferError`` unless ``offer`` has no more connections than this side asked for
    and the item's files can fill (``core.stripes.stream_count``): a split both ends agree
    on, with no connection left empty."""
    most = stream_count([entry.size for entry in manifest.files], asked)
    if len(offer[1]) > most:
        raise TransferError(
            f"{manifest.item}: {len(offer[1])} data connections offered, at most {most} "
            f"for {len(manifest.files)} files when {asked} were asked for"
        )


def offer_text(port: int, tokens: Sequence[bytes]) -> str:
    """A push's data channel offer as its go-ahead metadata carries it."""
    return " ".join([str(port), *(token.hex() for token in tokens)])


def push_offer(metadata: tuple[tuple[str, str | bytes], ...]) -> Offer | None:
    """The data channel offered in a push's go-ahead metadata, if any (see ``channel_offer``):
    ``"<port> <token> [<token>...]"``, tokens in hex."""
    for key, value in metadata:
        if key == DATA_CHANNEL_KEY:
            port, *tokens = str(value).split(" ")
            try:
                first, *more = (bytes.fromhex(token) for token in tokens) if tokens else [b""]
                return channel_offer(int(port), first, more)
            except ValueError:
                raise TransferError(f"malformed data channel offer {str(value)!r:.80}") from None
    return None


def fill_chunk(chunk: pb.Chunk, file_index: int, offset: int, data: bytes, crc32c: int) -> None:
    """Fill a message's chunk in place: building a Chunk and wrapping it copies data twice."""
    chunk.file_index = file_index
    chunk.offset = offset
    chunk.data = data
    chunk.crc32c = crc32c


def paced_chunk(meter: Meter) -> Callable[[], int]:
    """The size of the next chunk a paced sender reads: at most ``SEND_CHUNK``, and never
    more than its meter lets it send at once. At a low limit or while held, a 1 MiB chunk
    would be many seconds' worth, longer than the receiver waits for the next one."""
    return lambda: min(SEND_CHUNK, meter.slice())
