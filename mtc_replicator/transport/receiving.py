"""Receiving an item, whole: a push this node takes (``peer_servicer``) and a pull it makes
(``peer_client``) alike. I/O module.

An incoming item is checked here, in this order, before a byte is staged:

1. ``check``: its manifest parsed and proved against its digest off the event loop (a
   header may carry 16 MiB of JSON), within a bound on files per item, then the
   caller's trust check (``vet``: a push's attestation, a pull's checks by the restore
   round), raising before anything else is looked at;
2. ``reserved``: room for it, one rule for pushes and pulls: its bytes within the store's
   free space less a margin and less what every transfer in flight here will still write,
   one ``make_room`` asked before it is refused, its files and directories within the free
   inodes less those in flight, and no second transfer of the same item at once. The
   reservation is held until the transfer ends, however it ends.

``take`` then stages, verifies and commits its bytes, from gRPC chunks or a data-channel
connection (``dataconn``), within the minimum rate's deadline when one is given.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor

from mtc_replicator.core.admission import inode_room
from mtc_replicator.core.manifest import MAX_FILES, ItemId, Manifest
from mtc_replicator.core.pacing import earned_seconds, transfer_deadline
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.dataconn import DataConn, connections
from mtc_replicator.transport.streams import TooSlow
from mtc_replicator.transport.transfer import (
    RESERVE_BYTES,
    Chunk,
    Progress,
    check_manifest,
    deadline,
    inodes_on,
    receive_item,
    room_on,
)

Source = AsyncIterator[Chunk] | DataConn
"""Where an item's bytes come from: gRPC chunks (``peerwire.chunks_of``) or a data
connection."""


class TooLarge(StoreError):
    """The item does not fit in what this node may take now (bytes or inodes)."""


class ItemInFlight(StoreError):
    """Another transfer is bringing this item here now: try again shortly."""


class Receiving:
    """Takes incoming items into one store: the checks, the room rule, the staging."""

    def __init__(
        self,
        store: LocalStore,
        executor: Executor,
        *,
        reserve_bytes: int = RESERVE_BYTES,
        max_item_bytes: int | None = None,
        make_room: Callable[[int], Awaitable[None]] | None = None,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        """``max_item_bytes`` caps one item (by default, the room the store has, see
        ``room``). ``make_room(short)``: asked once before an item is refused for lacking
        ``short`` bytes (the daemon drops backed-up items of jobs that no longer run
        here). ``executor`` runs the blocking checks and disk writes."""
        self.store = store
        self.executor = executor
        self.reserve_bytes = reserve_bytes
        self.max_item_bytes = max_item_bytes
        self.make_room = make_room
        self.metrics = metrics
        self._bytes: dict[ItemId, int] = {}
        self._inodes: dict[ItemId, int] = {}

    async def check(
        self,
        raw: bytes,
        digest: str,
        item: ItemId,
        vet: Callable[[Manifest], object] | None = None,
        *,
        max_files: int = MAX_FILES,
    ) -> Manifest:
        """The manifest a transfer's header carries, proved to be ``item``'s with
        ``digest`` and at most ``max_files`` files and directories (a push's admission
        bound, ``--max-item-files``; a pull of this node's own step is held to the
        protocol's), then judged by ``vet`` (it raises to refuse). ``ManifestError`` or
        ``TransferError`` for a malformed or unsafe one."""
        manifest = await asyncio.get_running_loop().run_in_executor(
            self.executor, check_manifest, raw, digest, item, max_files
        )
        if vet is not None:
            vet(manifest)
        return manifest

    def room(self) -> int:
        """Bytes one more item may take now."""
        if self.max_item_bytes is not None:
            return self.max_item_bytes
        incoming = sum(self._bytes.values())
        return room_on(self.store.root, self.reserve_bytes) - incoming

    @contextlib.asynccontextmanager
    async def reserved(self, manifest: Manifest) -> AsyncIterator[None]:
        """Room for ``manifest``'s item, held while the body runs; ``TooLarge`` when it
        does not fit, ``ItemInFlight`` when another transfer of it runs here."""
        item = manifest.item
        if item in self._bytes:
            raise ItemInFlight(f"{item}: another transfer of this item is in flight")
        room = self.room()
        if manifest.total_bytes > room and self.make_room is not None:
            await self.make_room(manifest.total_bytes - room)
            room = self.room()
        if manifest.total_bytes > room:
            raise TooLarge(
                f"{item}: {manifest.total_bytes} bytes do not fit, this node can take {room}"
            )
        free, total = inodes_on(self.store.root)
        inodes = inode_room(free, total, sum(self._inodes.values()))
        if inodes is not None and manifest.entries > inodes:
            raise TooLarge(
                f"{item}: {manifest.entries} files and directories do not fit, this node "
                f"has inodes for {max(inodes, 0)}"
            )
        if item in self._bytes:  # another transfer of it reserved while make_room ran
            raise ItemInFlight(f"{item}: another transfer of this item is in flight")
        self._bytes[item] = manifest.total_bytes
        self._inodes[item] = manifest.entries
        try:
            yield
        finally:
            del self._bytes[item]
            del self._inodes[item]

    async def take(
        self,
        manifest: Manifest,
        source: Source,
        *,
        what: str,
        kind: TransferKind,
        floor: float | None = None,
        grace: float = 0.0,
    ) -> int:
        """Stage, verify and commit the item's bytes from ``source``; the bytes written.
        With a ``floor`` (bytes per second), the transfer must keep up with it all along,
        after ``grace`` seconds (``core.pacing``), or it is dropped (``TooSlow``, counted
        for ``kind``): a sender under the floor holds the reservation no longer than the
        grace, however large the item it declared."""
        progress = Progress()
        limit = transfer_deadline(manifest.total_bytes, floor, grace, manifest.entries)
        earned = None if floor is None else lambda: earned_seconds(progress.moved(), floor, grace)
        try:
            async with deadline(limit, what, earned):
                if isinstance(source, DataConn):
                    async with connections(source) as socks:
                        return await datachannel.receive_staged(
                            self.store,
                            manifest,
                            socks,
                            idle_timeout=source.idle,
                            pool=source.pool,
                            progress=progress,
                        )
                return await receive_item(self.store, manifest, source, self.executor, progress)
        except TooSlow:
            self.metrics.transfer_too_slow(kind)
            raise
