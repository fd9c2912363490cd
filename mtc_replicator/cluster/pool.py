"""The pool: which nodes can hold one-node jobs' copies, and the copies' two moves. I/O:
the registry's object store and the peer plane.

Every daemon with a registry keeps a signed entry there,
``_pool/nodes/<owner>/<node>.json`` (``Pool.announce``, every
``core.pool.ANNOUNCE_SECONDS``): its name, peer address, owner and the time. A node learns
its namespace's nodes from one listing of that owner's directory, fresh by the store's own
object times (``Pool.names``), and reads the entries of the nodes it dials only; an entry
counts when the node it names signed it (with TLS: else it could send a job's copies
anywhere). ``PoolView`` caches both for the node's jobs. ``PoolCopies`` is one job's side:
after each ingest the item goes to the holder ``core.pool`` picks (one push at a time, the
newest step first: an older step still queued is skipped), and before the restore round
the newest whole step the candidates hold, if newer than this node's own, is pulled and
verified here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from mtc_replicator.core.attestation import ManifestTrust, NodeVerifier
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.jsonobj import NotAnObject, load_object
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest, ManifestError
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
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.storage.objectstore import ObjectNotFound, ObjectStore, ObjectStoreError
from mtc_replicator.transport.peer_client import ItemInfo, PeerClient, PeerError, PeerUnavailable

log = logging.getLogger(__name__)

PREFIX = "_pool/nodes/"
MAX_ENTRY_BYTES = 32 * 1024
MEMBERS_CACHE_SECONDS = 30.0
"""How long a read of the pool serves the pushes that follow it."""

RunThread = Callable[..., Awaitable[Any]]
R = TypeVar("R")


UNOWNED_DIR = "_unowned"
"""The entries of nodes of no owner (no ``--owner-file``); no namespace starts with ``_``."""


def entry_key(owner: str, node: str) -> str:
    if not node or "/" in node or node in (".", ".."):
        raise ValueError(f"not a node name for a pool entry: {node!r:.80}")
    return f"{PREFIX}{owner or UNOWNED_DIR}/{node}.json"


class Pool:
    """The pool's entries on one object store (the registry's), one directory per owner:
    a node learns its namespace's nodes from one listing, and reads only the entries of the
    nodes it dials. Blocking."""

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
        self.objects.put_bytes(entry_key(owner, node), self.trust.seal(POOL_KIND, body))

    def names(self, owner: str) -> list[str]:
        """The nodes of ``owner``'s namespace whose entry was renewed within the TTL (by
        the store's own time of the object: one listing, no read)."""
        base = f"{PREFIX}{owner or UNOWNED_DIR}/"
        now = self.clock()
        found = []
        for info in self.objects.list(base):
            name = info.key[len(base) :]
            if name.endswith(".json") and "/" not in name and now - info.mtime < MEMBER_TTL_SECONDS:
                found.append(name.removesuffix(".json"))
        return found

    def member(self, owner: str, node: str) -> PoolMember | None:
        """``node``'s entry in ``owner``'s namespace, when it is fresh and that node signed
        it for itself (with TLS); None otherwise (logged: it could send copies anywhere)."""
        key = entry_key(owner, node)
        try:
            raw = self.objects.get_bytes(key)
        except ObjectNotFound:
            return None
        member = self._member(key, raw)
        if member is None or (member.node, member.owner) != (node, owner):
            return None
        return member if self.clock() - member.announced_at < MEMBER_TTL_SECONDS else None

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


class PoolView:
    """The pool as one node reads it, cached ``MEMBERS_CACHE_SECONDS``: its namespaces'
    node names, and the entries of the nodes it dials. Shared by the node's jobs."""

    def __init__(self, pool: Pool, run_thread: RunThread) -> None:
        self.pool = pool
        self._thread = run_thread
        self._names: dict[str, tuple[float, list[str]]] = {}
        self._members: dict[tuple[str, str], tuple[float, PoolMember | None]] = {}

    async def names(self, owner: str) -> list[str]:
        now = time.monotonic()
        cached = self._names.get(owner)
        if cached is None or now - cached[0] > MEMBERS_CACHE_SECONDS:
            cached = self._names[owner] = (now, await self._thread(self.pool.names, owner))
        return cached[1]

    async def member(self, owner: str, node: str, *, fresh: bool = False) -> PoolMember | None:
        now = time.monotonic()
        cached = self._members.get((owner, node))
        if fresh or cached is None or now - cached[0] > MEMBERS_CACHE_SECONDS:
            found = await self._thread(self.pool.member, owner, node)
            cached = self._members[(owner, node)] = (now, found)
        return cached[1]

    async def dial(
        self, owner: str, node: str, call: Callable[[PoolMember], Awaitable[R]]
    ) -> R | None:
        """``call`` with ``node``'s entry (None: it has none); once more with its entry
        read afresh when the cached address cannot be reached and the entry now names
        another (its daemon restarted on another port)."""
        member = await self.member(owner, node)
        if member is None:
            return None
        try:
            return await call(member)
        except PeerUnavailable:
            again = await self.member(owner, node, fresh=True)
            if again is None or again.address == member.address:
                raise
            return await call(again)


class PoolCopies:
    """One one-node job's copies on another node of the pool."""

    def __init__(  # one job's context, passed once
        self,
        view: PoolView,
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
        self.view, self.peers, self.store, self.config = view, peers, store, config
        self.me, self.owner, self.trust, self.metrics = me, owner, trust, metrics
        self._thread = run_thread
        self._log = JobLog(log, config.job_name, config.node_rank)
        self._queue: dict[ItemId, Manifest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._holder: str | None = None
        self._failing: str | None = None
        self._current: int | None = None
        """The step whose items are being pushed."""

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
                except (PeerError, ObjectStoreError, ManifestError, CorruptItem, StoreError,
                        OSError) as exc:  # fmt: skip
                    self._failed(f"{type(exc).__name__}: {exc}")

    async def _push(self, manifest: Manifest) -> None:
        job = self.config.job_name
        name = holder_for(job, self.me, await self.view.names(self.owner))
        if name is None:
            self._failed(f"no other node of owner {self.owner or '(unowned)'!r} in the pool")
            return
        item = manifest.item
        if self.store.get(item) is None:
            return  # dropped by retention meanwhile

        async def push(holder: PoolMember) -> bool:
            if holder.node != self._holder:
                self._holder = holder.node
                self._log.info("pool copies go to node %s (%s)", holder.node, holder.address)
            data = self.store.data_path(item)
            return await self.peers.push_item(
                holder.address, manifest, data, self.store.root, pool_copy=True
            )

        if await self.view.dial(self.owner, name, push) is None:
            self._failed(f"node {name}'s pool entry is gone, stale or not signed by it")
            return
        # Counted (replicate_out) by the PeerClient's push, and only when the holder did not
        # have the item already: counting it here too would count every pool copy twice.
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
        for name in candidates(job, self.me, await self.view.names(self.owner)):

            async def listing(m: PoolMember) -> tuple[PoolMember, list[ItemInfo]]:
                return m, await self.peers.list_items(m.address, job)

            try:
                found = await self.view.dial(self.owner, name, listing)
            except PeerError as exc:
                self._log.info("pool copies: cannot ask node %s: %s", name, exc)
                continue
            if found is None:
                continue
            member, infos = found
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
        watch, nbytes = Stopwatch(), 0
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
        dt = watch.seconds()
        self.metrics.transfer(TransferKind.RESTORE_PEER, nbytes, dt)
        self._log.info(
            "pool copies: step %d pulled from node %s: %s",
            step,
            member.node,
            watch.summary(nbytes, dt),
            step=step,
        )
        return step
