"""This node in the pool (``core.pool``): its entry renewed, the copies it holds for others.
I/O: the registry's object store, the owner file, the store.

Built by the daemon when it has a registry and ``--pool-copies`` is on. Without a registry
there is no pool to find: one-node jobs keep their steps on their node and in the bucket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from mtc_replicator.cluster.pool import Pool, PoolView
from mtc_replicator.cluster.registry import Registry
from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.pool import ANNOUNCE_SECONDS
from mtc_replicator.local.pool_held import PoolHeld
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.bucket_probes import in_daemon_thread
from mtc_replicator.storage.objectstore import ObjectStoreError
from mtc_replicator.transport.pool_holding import PoolHolding

log = logging.getLogger(__name__)
T = TypeVar("T")


class PoolNode:
    """The pool, this node's entry in it, and the copies held here."""

    def __init__(
        self,
        registry: Registry,
        trust: ManifestTrust,
        store: LocalStore,
        executor: Executor,
        node_owner: Callable[[], str],
        *,
        max_lead: int,
    ) -> None:
        self.pool = Pool(registry.objects, registry.trust, trust.verifier)
        self.view = PoolView(self.pool, self._run)
        """The pool as this node's jobs read it (cached)."""
        self.held = PoolHeld(store)
        self.holding = PoolHolding(self.held, node_owner, executor, max_lead)
        self._node_owner = node_owner
        self.name = trust.producer
        """This node in the pool: its certificate's name; its address without one."""

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """On a thread of its own: a silent registry must not hold up SIGTERM (the daemon's
        pool is joined at shutdown)."""
        return await in_daemon_thread(fn, *args, name="mtc-pool")

    def start(self, advertise: str) -> asyncio.Task[None]:
        """Renew this node's entry every ``ANNOUNCE_SECONDS`` until cancelled."""
        self.name = self.name or advertise
        return asyncio.create_task(self._announce_forever(advertise), name="pool-announce")

    async def _announce_forever(self, advertise: str) -> None:
        failing = False
        while True:
            try:
                await self._run(self._announce, advertise)
                if failing:
                    log.info("pool: this node's entry is renewed again")
                failing = False
            except (ObjectStoreError, BadOwner, OSError) as exc:
                if not failing:
                    log.warning("pool: cannot renew this node's entry (retrying): %s", exc)
                failing = True
            await asyncio.sleep(ANNOUNCE_SECONDS)

    def _announce(self, advertise: str) -> None:
        self.pool.announce(self.name, advertise, self._node_owner())
