"""Sending an item, whole: a push this node makes (``peer_client``) and a pull it serves
(``peer_servicer``) alike. I/O module.

A committed item's files are read from the store down through no symlink
(``transfer.iter_chunks``), in pieces no larger than the pacer's meter lets go at once,
each booked with the meter before it leaves: as gRPC chunk messages, written by the RPC
module through ``ChunkWrite``, or on the data channel (``dataconn``,
``datachannel.send_staged``: one or more connections, each with its part of the files),
within the minimum rate's deadline when one is given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path

from mtc_replicator.core.manifest import Manifest
from mtc_replicator.core.pacing import transfer_deadline
from mtc_replicator.local.pacer import Meter
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.dataconn import DataConn, connections
from mtc_replicator.transport.peerwire import paced_chunk
from mtc_replicator.transport.transfer import deadline, iter_chunks

ChunkWrite = Callable[[int, int, bytes, int], Awaitable[None]]
"""Sends one chunk, ``(file_index, offset, data, crc32c)``, as the RPC's next message."""
Sink = ChunkWrite | DataConn
"""Where an item's bytes go: gRPC chunk messages or a data connection."""


async def send(
    manifest: Manifest,
    data: Path,
    sink: Sink,
    meter: Meter,
    *,
    root: Path | None,
    what: str,
    floor: float | None = None,
    grace: float = 0.0,
) -> None:
    """Send the committed item whose files are below ``data`` (opened from ``root`` down
    through no symlink) to ``sink``, every byte booked with ``meter``. With a ``floor``
    (bytes per second), the whole must be sent within ``grace`` plus its bytes at that
    rate (``core.pacing.transfer_deadline``), or ``TooSlow``."""
    limit = transfer_deadline(manifest.total_bytes, floor, grace, manifest.entries)
    async with deadline(limit, what):
        if isinstance(sink, DataConn):
            async with connections(sink) as socks:
                await datachannel.send_staged(
                    manifest,
                    data,
                    socks,
                    idle_timeout=sink.idle,
                    pool=sink.pool,
                    root=root,
                    meter=meter,
                )
            return
        chunks = iter_chunks(manifest, data, paced_chunk(meter), root=root)
        with contextlib.closing(chunks):
            for index, offset, buf, crc in chunks:
                await meter.take_async(len(buf))
                await sink(index, offset, buf, crc)
