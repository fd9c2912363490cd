"""Steady-state replication: push this rank's newest committed step to its targets. I/O: gRPC.

Replication runs beside ingest, never in its way: one push task at a time, always for the
newest committed step (an older step a slow peer never got is superseded by the next one),
so a slow or dead peer delays only the cluster's restorable step, never the job's saves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import Cancelled, CorruptItem, Manifest
from mtc_replicator.core.policy import rank_items
from mtc_replicator.core.retry import Backoff
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.transport.peer_client import PeerClient, PeerError

log = logging.getLogger(__name__)

RETRY_FIRST = 0.5
RETRY_MAX = 15.0
"""Seconds between attempts to replicate a step that failed: from the first to the cap."""

ErrorSink = Callable[[str, int | None], None]


class Replication:
    """Which of this rank's steps its replication targets hold, and the pushes to get there."""

    def __init__(
        self,
        config: JobConfig,
        store: LocalStore,
        peers: PeerClient | None,
        on_error: ErrorSink,
        *,
        on_news: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.store = store
        self.peers = peers
        self.on_error = on_error
        self.on_news = on_news
        """Called once a push made a newer step replicated: worth a report now."""
        self.targets = replication_targets(config)
        self.addresses: dict[int, str] = {}
        self.newest_replicated: int | None = None
        """Newest own step committed here AND on every target (with no target, every
        committed step: the rounds may count on it, but the job is not reported replicated,
        see ``replicates``)."""
        self.pushing: int | None = None
        """The step being pushed now, if any (the coordinator asks every rank to keep it)."""
        self._wanted: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(RETRY_FIRST, RETRY_MAX)
        self._retry_at = 0.0
        """After a failed push, no new attempt of the same step before this (monotonic)."""
        self._log = JobLog(log, config.job_name, config.node_rank)

    @property
    def replicates(self) -> bool:
        """Whether this rank has targets (not one node, not ``peers-per-node: 0``): only then
        are ``mtc_newest_step{tier="replicated"}`` and ``mtc status``'s "last replicated"
        reported, never for replication that cannot happen."""
        return bool(self.targets)

    def set_addresses(self, addresses: Mapping[int, str]) -> None:
        self.addresses = dict(addresses)

    def update_addresses(self, addresses: Mapping[int, str]) -> None:
        """Newer addresses from the coordinator (a restarted peer listens elsewhere)."""
        changed = {r: a for r, a in addresses.items() if self.addresses.get(r) != a}
        if changed:
            self.addresses.update(changed)
            self._retry_at = 0.0  # a peer that moved is worth trying at once

    def committed(self, step: int) -> None:
        """A new own step is committed locally: replicate it (and forget older wishes).

        A step that failed is offered again on every rescan; it is retried with a jittered
        exponential backoff, so a dead peer costs a few connection attempts, not a loop.
        """
        if not self.targets:
            # Nobody to push to (one node): committed here is as replicated as it gets.
            if self.newest_replicated is None or step > self.newest_replicated:
                self.newest_replicated = step
            return
        if self._wanted is None or step > self._wanted:
            self._wanted = step
            self._retry_at = 0.0  # a new step is tried at once
        if time.monotonic() < self._retry_at:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"replicate-{self.config.job_name}")

    async def settle(self, step: int) -> bool:
        """A drain: let the push in flight end, then push ``step`` if a target still lacks
        it; True when every target holds it."""
        if self._task is not None and not self._task.done():
            await asyncio.wait([self._task])
        if self.newest_replicated is not None and self.newest_replicated >= step:
            return True
        if not self.targets:
            self.committed(step)
            return True
        self.pushing = step
        try:
            return await self.replicate(step)
        finally:
            self.pushing = None

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        # A step that arrives during a push is pushed next; a failed push is retried when
        # the agent offers the step again (on its next rescan).
        while self._wanted is not None and self._wanted != self.newest_replicated:
            step = self._wanted
            self.pushing = step
            try:
                done = await self.replicate(step)
            finally:
                self.pushing = None
            if done:
                self._backoff.reset()
            else:
                self._retry_at = time.monotonic() + self._backoff.next()
            if self._wanted == step:
                return

    async def replicate(self, step: int) -> bool:
        """Push every own item of ``step`` to every target; True when all hold it."""
        manifests: list[Manifest] = []
        for item in rank_items(self.config, step):
            manifest = self.store.get(item)
            if manifest is None:
                return False  # deleted meanwhile by retention: a newer step exists
            manifests.append(manifest)
        results = await asyncio.gather(*(self._push_all(t, manifests, step) for t in self.targets))
        if all(results):
            if self.newest_replicated is None or step > self.newest_replicated:
                self.newest_replicated = step
                self.on_news()
            return True
        return False

    async def _push_all(self, target: int, manifests: list[Manifest], step: int) -> bool:
        address = self.addresses.get(target)
        if address is None or self.peers is None:
            self.on_error(f"step {step}: no address known for peer rank {target}", step)
            return False
        try:
            for manifest in manifests:
                await self.peers.push_item(
                    address, manifest, self.store.data_path(manifest.item), self.store.root
                )
        except (PeerError, CorruptItem, StoreError, OSError, Cancelled) as exc:
            # CorruptItem: the peer found our bytes differ from our manifest (DATA_LOSS);
            # the next restore round verifies the local copy before anyone uses it.
            self.on_error(
                f"step {step}: replication to rank {target} ({address}) failed: {exc}", step
            )
            return False
        return True
