"""Where a restore gets an item: this node's store, a peer, or the backup. I/O: the store,
the peer plane and the object store.

``ItemSources`` brings the item a restore plan names (``core.restore_plan.Fetch``) into
the ``LocalStore``, verified against the plan's digest, from the source the plan gives; it
times and logs every restore transfer (``TransferKind.RESTORE_*``). Each source's own
failures leave it as one of three types of ours: ``CorruptItem`` (the bytes differ from the
plan: never used), ``SourceUnavailable`` (the source cannot give them now: a full disk, a
bucket or a peer down, no backup set on this node: ``NoBackupSet``) or ``LocalCopyGone``
(the plan's local copy left the store: there is nothing to judge). Anything else is a bug
and propagates. The order of the sources, what the peer service is told and what a failure
means for the round are ``cluster.rounds``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc

from mtc_replicator.core.attestation import OPEN_MANIFESTS, Attested, ManifestTrust, Unattested
from mtc_replicator.core.manifest import (
    CancelCheck,
    CorruptItem,
    ItemId,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.core.retry import Backoff
from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStoreError
from mtc_replicator.transport.peer_client import (
    ItemBusy,
    ItemNotFound,
    PeerClient,
    PeerError,
    PeerUnavailable,
)

log = logging.getLogger(__name__)

RunThread = Callable[..., Awaitable[Any]]
"""Runs a blocking function with its arguments off the event loop (the daemon's pool)."""

PENDING_WAIT_SECONDS = 600.0
"""How long a pull waits, at most, for a holder that says it is still obtaining the item
(``Fetch.pending``): a backup download of a large item takes minutes; past this, this rank
downloads it itself."""
PENDING_GRACE_SECONDS = 10.0
"""How long a pending pull keeps trying a holder that does not know the item yet: the
holder may not have received the plan. Past this the holder is not coming."""
PEER_RETRY_SECONDS = 20.0
"""How long a pull keeps trying a holder that cannot be reached before this rank reports the
copy unavailable (and the round may fall back to an older step): a daemon's restart, with
its start-up checks, fits."""


class SourceUnavailable(Exception):
    """A source cannot give the item now (unreachable, full, refused, a failing disk):
    the next source is tried; the bytes were not found corrupt."""


class NoBackupSet(SourceUnavailable):
    """The plan names the backup, but this node has none set (``--backup``), unlike
    the coordinator's node that listed it: a configuration to fix, not a corrupt copy, and
    a committed step the job must not restart without."""


class LocalCopyGone(Exception):
    """The plan names this node's copy, and the store no longer holds it (a drop, a
    reclaim or a node handoff since the join): no bytes to find corrupt, and none to wait
    for; the next source is tried."""


@contextmanager
def _unavailable_on_failure() -> Iterator[None]:
    """Translate the failures of the stores, the peer plane and the disk, once.

    ``CorruptItem`` and ``Cancelled`` are ours and pass; so does anything else, a bug."""
    try:
        yield
    except (PeerError, ObjectStoreError, StoreError, ManifestError, OSError) as exc:
        raise SourceUnavailable(str(exc)) from exc


def _never() -> bool:
    return False


class ItemSources:
    """Fetches an item by source into ``store``, verified; one per incarnation."""

    def __init__(
        self,
        store: LocalStore,
        rank: int,
        *,
        peers: PeerClient | None = None,
        backups: BackupStore | None = None,
        run_thread: RunThread = asyncio.to_thread,
        cancelled: CancelCheck = _never,
        metrics: Metrics = NO_METRICS,
        pending_wait: float = PENDING_WAIT_SECONDS,
        pending_grace: float = PENDING_GRACE_SECONDS,
        peer_retry: float = PEER_RETRY_SECONDS,
        trust: ManifestTrust = OPEN_MANIFESTS,
        owner: str = UNOWNED,
    ) -> None:
        """``rank``: this node's, for the log lines; ``peers``: None where no peer can
        hold anything (a one-node job); ``backups``: None where no backup is set;
        ``cancelled``: the incarnation stops (a verify or a download in a thread ends
        early); ``trust`` and ``owner``: which items this job takes (``core.attestation``)."""
        self.store = store
        self.trust = trust
        self.owner = owner
        self.rank = rank
        self.peers = peers
        self.backups = backups
        self.run_thread = run_thread
        self.cancelled = cancelled
        self.metrics = metrics
        self.pending_wait = pending_wait
        self.pending_grace = pending_grace
        self.peer_retry = peer_retry

    def holds(self, f: Fetch) -> bool:
        """This node's store holds ``f.item`` with the plan's digest (it is verified, not
        fetched, whatever the source)."""
        return self._holds(f.item, f.digest)

    def _holds(self, item: ItemId, digest: str) -> bool:
        held = self.store.get(item)
        return held is not None and held.digest == digest

    async def fetch(self, f: Fetch, addresses: Mapping[int, str], *, last: bool) -> None:
        """Make ``f.item`` present here with ``f.digest``, verified; ``addresses`` of the
        round's ranks, for a pull; ``last``: no other source of the item is left.

        Raises ``CorruptItem`` (a corrupt local copy of a LOCAL fetch is deleted, as is one
        that differs from the plan), ``LocalCopyGone`` (a LOCAL fetch of a copy no longer
        held), ``Unattested`` (a copy this job does not take: refused before its data moves,
        and one held before is kept), ``SourceUnavailable`` or ``Cancelled``."""
        held = self.holds(f)
        try:
            with _unavailable_on_failure():
                if held:
                    self._check_attested(f)  # before a byte is read
                    await self._verify_local(f.item)
                elif f.source is Source.LOCAL:
                    self._local_gone_or_different(f)
                elif f.source is Source.PEER:
                    await self._pull(f, addresses, last=last)
                else:
                    await self._download(f)
            self._note_unverifiable(f)
        except Unattested:
            raise  # nothing of it was committed, and what was held before stays
        except CorruptItem:
            if f.source is Source.LOCAL and self.store.get(f.item) is not None:
                self.store.delete(f.item)
            raise

    def _check_attested(self, f: Fetch) -> None:
        """``_vet`` the copy of ``f.item`` this node holds."""
        held = self.store.get(f.item)
        if held is not None:
            self._vet(held, f)

    def _vet(self, manifest: Manifest, f: Fetch) -> None:
        """``Unattested`` unless this job takes ``manifest``'s item: signed by its producer,
        for this job's owner, by a node that held its rank (``core.attestation``). Pulls and
        downloads ask before the first byte of data moves."""
        seal = self.trust.check(manifest, self.owner, f.producers)
        if seal is Attested.UNSIGNED:
            JobLog(log, f.item.job, self.rank).warning(
                "%s from %s is not attested: written before signed manifests, taken because "
                "of --accept-unsigned-records",
                f.item,
                f.source.value,
                step=f.item.step,
            )

    def _note_unverifiable(self, f: Fetch) -> None:
        """Say so when a restored copy was written before digests: its crc32cs matched,
        and they are all a format-1 manifest has (docs/architecture.md, "Content
        digests"). Such a copy is used, not refused: an upgrade must not lose the steps
        taken before it, and the next step taken is written with digests."""
        held = self.store.get(f.item)
        if held is not None and held.unverifiable:
            JobLog(log, f.item.job, self.rank).warning(
                "%s from %s is unverifiable: written before digests, checked by crc32c only",
                f.item,
                f.source.value,
                step=f.item.step,
            )

    # --- local -----------------------------------------------------------------------------

    def _local_gone_or_different(self, f: Fetch) -> None:
        """A LOCAL fetch of a copy this node does not hold with the plan's digest."""
        held = self.store.get(f.item)
        if held is None:
            raise LocalCopyGone(f"{f.item}: the local copy is no longer in this node's store")
        raise CorruptItem(
            f"{f.item}: the local copy differs from the plan (digest {held.digest[:12]}, "
            f"the plan's {f.digest[:12]})"
        )

    async def _verify_local(self, item: ItemId) -> None:
        t0 = time.monotonic()
        manifest = await self.run_thread(self.store.verify, item, self.cancelled)
        self.metrics.transfer(
            TransferKind.RESTORE_LOCAL, manifest.total_bytes, time.monotonic() - t0
        )

    # --- peer ------------------------------------------------------------------------------

    async def _pull(self, f: Fetch, addresses: Mapping[int, str], *, last: bool) -> None:
        peers = self.peers
        if peers is None or f.holder is None or f.holder not in addresses:
            raise SourceUnavailable(f"no address for rank {f.holder}")
        if f.pending:
            await self._pull_pending(peers, addresses[f.holder], f)
        else:
            await self._pull_retrying(peers, addresses[f.holder], f, retry=last)

    async def _pull_once(self, peers: PeerClient, address: str, f: Fetch) -> None:
        """One pull, timed alone: the waits between tries are not transfer time."""
        watch = Stopwatch()
        manifest = await peers.pull_item(
            address, f.item, self.store, f.digest, vet=lambda m: self._vet(m, f)
        )
        nbytes, dt = manifest.total_bytes, watch.seconds()
        JobLog(log, f.item.job, f.item.rank).info(
            "pulled %s from %s: %s",
            f.item,
            address,
            watch.summary(nbytes, dt),
            step=f.item.step,
        )
        self.metrics.transfer(TransferKind.RESTORE_PEER, nbytes, dt)

    async def _pull_retrying(
        self, peers: PeerClient, address: str, f: Fetch, *, retry: bool
    ) -> None:
        """Pull ``f`` from its holder. With ``retry`` (no other source of the item is left),
        try again for ``peer_retry`` seconds while the holder cannot be reached: it joined
        this round, so it is likely restarting (a DaemonSet update, a crash), and the
        channel fails fast while it reconnects. Giving up at once would make the round fall
        back to an older step and drop the newer copies everywhere (``make chaos``, seed
        67); with another source left, that source is tried at once instead."""
        backoff = Backoff(0.5, 4.0)
        deadline = time.monotonic() + (self.peer_retry if retry else 0.0)
        while True:
            try:
                return await self._pull_once(peers, address, f)
            except PeerUnavailable as exc:
                wait = backoff.next()
                if exc.code is not grpc.StatusCode.UNAVAILABLE or (
                    time.monotonic() + wait > deadline
                ):
                    raise
                log.info(
                    "pull of %s from rank %s: %s; again in %.1fs (the holder may be restarting)",
                    f.item,
                    f.holder,
                    exc,
                    wait,
                )
                await asyncio.sleep(wait)

    async def _pull_pending(self, peers: PeerClient, address: str, f: Fetch) -> None:
        """Pull an item its holder obtains during this round, once it has it.

        While the holder says the item is coming (ABORTED), try again with backoff for up
        to ``pending_wait``; while it does not know the item (NOT_FOUND: it may not have
        the plan yet), for up to ``pending_grace``. Any other answer, including the
        holder's word that it gave the item up, fails at once, so this rank falls back to
        its next source (the backup) promptly. The bytes are verified against the plan's
        digest like any pull's.
        """
        started = time.monotonic()
        backoff = Backoff(0.05, 1.0)
        while True:
            try:
                return await self._pull_once(peers, address, f)
            except (ItemBusy, ItemNotFound) as exc:
                waited = time.monotonic() - started
                busy = isinstance(exc, ItemBusy)
                if waited > (self.pending_wait if busy else self.pending_grace):
                    raise SourceUnavailable(f"{exc} (waited {waited:.1f}s for it)") from None
                await asyncio.sleep(backoff.next())

    # --- backup ----------------------------------------------------------------------------

    async def _download(self, f: Fetch) -> None:
        # The plan's digest is the one the COMMIT pins (the coordinator listed the backups
        # and checked the COMMIT's signature): no listing and no COMMIT read per rank.
        item, digest = f.item, f.digest
        if self.backups is None:
            raise NoBackupSet(
                f"{item}: no backup is set on this node; give its daemon the same "
                "--backup as the other nodes of the job"
            )
        await self.run_thread(self._download_staged, self.backups, f)
        if not self._holds(item, digest):
            raise CorruptItem(f"{item}: the backup copy differs from the plan")

    def _download_staged(self, backups: BackupStore, f: Fetch) -> None:
        """In a thread: download into a staging directory, then commit it whole."""
        item = f.item
        staged = self.store.new_staging()
        try:
            watch = Stopwatch()
            manifest = backups.fetch_pinned(
                item, f.digest, staged, self.cancelled, vet=lambda m: self._vet(m, f)
            )
            self.store.commit_staged(staged, manifest)
            nbytes, dt = manifest.total_bytes, watch.seconds()
            JobLog(log, item.job, self.rank).info(
                "restored %s from backup: %s", item, watch.summary(nbytes, dt), step=item.step
            )
            self.metrics.transfer(TransferKind.RESTORE_BACKUP, nbytes, dt)
        finally:
            fsutil.remove_tree(staged)
