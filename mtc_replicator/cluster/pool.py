"""The pool: which nodes can hold one-node jobs' copies, and the copies' two moves. I/O:
the registry's object store and the peer plane.

Every daemon with a registry keeps a signed entry there, ``_pool/nodes/<node>.json``
(``Pool.announce``, every ``core.pool.ANNOUNCE_SECONDS``): its name, peer address, owner
and the time. ``Pool.members`` reads the fresh ones a node signed for itself (with TLS, an
entry signed by another node than it names, or not signed, is skipped: it could send a
job's copies anywhere). ``PoolCopies`` is one job's side: after each ingest the item goes
to the holder ``core.pool`` picks (one push at a time, the newest step first: an older
step still queued is skipped), and before the restore round the newest whole step the
candidates hold, if newer than this node's own, is pulled and verified here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mtc_replicator.core.attestation import ManifestTrust, NodeVerifier
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.jsonobj import NotAnObject, load_object
from mtc_replicator.core.manifest import ItemId, Manifest, ManifestError
from mtc_replicator.core.policy import worker_slots
from mtc_replicator.core.pool import (
    MEMBER_TTL_SECONDS,
    PoolMember,
    candidates,
    holder_for,
    newest_complete,
)
from mtc_replicator.core.signed import POOL_KIND, RecordRefused, RecordTrust, payload, split
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.storage.objectstore import ObjectNotFound, ObjectStore, ObjectStoreError
from mtc_replicator.transport.peer_client import ItemInfo, PeerClient, PeerError
from mtc_replicator.transport.peerwire import rate

log = logging.getLogger(__name__)

PREFIX = "_pool/nodes/"
MAX_ENTRY_BYTES = 32 * 1024
MEMBERS_CACHE_SECONDS = 30.0
"""How long a read of the pool serves the pushes that follow it."""

RunThread = Callable[..., Awaitable[Any]]


class Pool:
    """The pool's entries on one object store (the registry's). Blocking."""

    def __init__(
        self,
        objects: ObjectStore,
        trust: RecordTrust,
        verifier: NodeVerifier | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.objects = objects
        self.trust = trust
        self.verifier = verifier
        self.clock = clock

    def announce(self, node: str, address: str, owner: str) -> None:
        body = {"node": node, "address": address, "owner": owner, "announced_at": self.clock()}
        self.objects.put_bytes(f"{PREFIX}{node}.json", self.trust.seal(POOL_KIND, body))

    def members(self) -> list[PoolMember]:
        """The nodes whose entries are fresh and signed by themselves."""
        found = []
        for info in self.objects.list(PREFIX):
            try:
                raw = self.objects.get_bytes(info.key)
            except ObjectNotFound:
                continue  # gone since the listing
            member = self._member(info.key, raw)
            if member is not None and self.clock() - member.announced_at < MEMBER_TTL_SECONDS:
                found.append(member)
        return found

    def _member(self, key: str, raw: bytes) -> PoolMember | None:
        try:
            data = load_object(raw, MAX_ENTRY_BYTES)
            member = PoolMember(
                str(data["node"]),
                str(data["address"]),
                str(data["owner"]),
                float(data["announced_at"]),
            )
            if self.verifier is not None:
                body, signature = split(POOL_KIND, raw)
                if signature is None:
                    raise RecordRefused("not signed")
                signer = self.verifier.verify_node(
                    payload(POOL_KIND, body), signature, member.announced_at
                )
                if signer != member.node:
                    raise RecordRefused(f"signed by node {signer[:100]!r}")
        except (NotAnObject, KeyError, TypeError, ValueError, RecordRefused) as exc:
            log.warning("skipping the pool entry %s: %s", key, exc)
            return None
        return member


class PoolCopies:
    """One one-node job's copies on another node of the pool."""

    def __init__(  # one job's context, passed once
        self,
        pool: Pool,
        peers: PeerClient,
        store: LocalStore,
        config: JobConfig,
        *,
        me: str,
        owner: str,
        run_thread: RunThread,
        trust: ManifestTrust,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self.pool, self.peers, self.store, self.config = pool, peers, store, config
        self.me, self.owner, self.trust, self.metrics = me, owner, trust, metrics
        self._thread = run_thread
        self._log = JobLog(log, config.job_name, config.node_rank)
        self._members: tuple[float, list[PoolMember]] | None = None
        self._queue: dict[ItemId, Manifest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._holder: str | None = None
        self._failing: str | None = None
        self._current: int | None = None
        """The step whose items are being pushed."""

    async def members(self) -> list[PoolMember]:
        now = time.monotonic()
        if self._members is None or now - self._members[0] > MEMBERS_CACHE_SECONDS:
            self._members = (now, await self._thread(self.pool.members))
        return self._members[1]

    def push_later(self, manifest: Manifest) -> None:
        """Queue an ingested item for the holder; an older step still queued is dropped,
        unless its push has begun (its other workers' items are then still sent)."""
        step = manifest.item.step
        keep = {step, self._current}
        self._queue = {i: m for i, m in self._queue.items() if i.step >= step or i.step in keep}
        self._queue[manifest.item] = manifest
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._push_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _push_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                item = min(self._queue, key=lambda i: (i.step, i.worker))
                manifest = self._queue.pop(item)
                self._current = item.step
                try:
                    await self._push(manifest)
                except (PeerError, ObjectStoreError, ManifestError, OSError) as exc:
                    self._failed(f"{type(exc).__name__}: {exc}")

    async def _push(self, manifest: Manifest) -> None:
        job = self.config.job_name
        holder = holder_for(job, self.me, self.owner, await self.members())
        if holder is None:
            self._failed(f"no other node of owner {self.owner or '(unowned)'!r} in the pool")
            return
        if holder.node != self._holder:
            self._holder = holder.node
            self._log.info(
                "pool copies of this job go to node %s (%s)", holder.node, holder.address
            )
        item = manifest.item
        if self.store.get(item) is None:
            return  # dropped by retention meanwhile
        t0 = time.monotonic()
        await self.peers.push_item(
            holder.address, manifest, self.store.data_path(item), self.store.root, pool_copy=True
        )
        self.metrics.transfer(
            TransferKind.REPLICATE_OUT, manifest.total_bytes, time.monotonic() - t0
        )
        self._failing = None

    def _failed(self, why: str) -> None:
        if why != self._failing:  # once per distinct reason, not per step
            self._log.warning("no pool copy of this job's newest step: %s", why)
        self._failing = why

    async def fetch_newest(self) -> int | None:
        """Before the restore round: pull the newest whole step the candidates hold when it
        is newer than this node's own; the step brought here, or None."""
        job, workers = self.config.job_name, list(worker_slots(self.config))
        own = newest_complete(self.store.manifests(job), workers)
        best: tuple[int, PoolMember, list[ItemInfo]] | None = None
        for member in candidates(job, self.me, self.owner, await self.members()):
            try:
                infos = await self.peers.list_items(member.address, job)
            except PeerError as exc:
                self._log.info("pool copies: cannot ask node %s: %s", member.node, exc)
                continue
            step = newest_complete((i.item for i in infos), workers)
            if (
                step is not None
                and (own is None or step > own)
                and (best is None or step > best[0])
            ):
                best = (
                    step,
                    member,
                    [i for i in infos if i.item.step == step and i.item.rank == 0],
                )
        if best is None:
            return None
        step, member, infos = best
        t0, nbytes = time.monotonic(), 0
        try:
            for info in infos:
                manifest = await self.peers.pull_item(
                    member.address,
                    info.item,
                    self.store,
                    info.digest,
                    total_bytes=info.total_bytes,
                    vet=lambda m: self.trust.check(m, self.owner),
                )
                nbytes += manifest.total_bytes
        except (PeerError, ManifestError, StoreError) as exc:
            self._log.warning(
                "pool copies: step %d from node %s failed (%s); the round plans without it",
                step,
                member.node,
                exc,
                step=step,
            )
            return None
        dt = time.monotonic() - t0
        self.metrics.transfer(TransferKind.RESTORE_PEER, nbytes, dt)
        self._log.info(
            "pool copies: step %d pulled from node %s: %d bytes in %.3fs (%.1f MB/s)",
            step,
            member.node,
            nbytes,
            dt,
            rate(nbytes, dt),
            step=step,
        )
        return step
