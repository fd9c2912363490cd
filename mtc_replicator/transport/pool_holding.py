"""Pool copies pushed to this node: admitted, kept, pruned. I/O: the store, on the pool.

``PeerServicer`` hands a push whose header says ``pool_copy`` here instead of to the job's
admission (the job does not run on this node, so it has no config here to judge by):
``core.pool.admit_pool_copy`` decides, the manifest's attestation must be the pusher's own
for this node's owner, and once committed the job keeps its newest steps only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from dataclasses import dataclass

from mtc_replicator.core.admission import MAX_STEP_LEAD, Admission, Verdict
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import UNOWNED, BadOwner
from mtc_replicator.core.pool import admit_pool_copy
from mtc_replicator.local.pool_held import PoolHeld

log = logging.getLogger(__name__)

NO_POOL = Admission(
    Verdict.NOT_SERVED, "this node keeps no pool copies (its daemon runs with --no-pool-copies)"
)


@dataclass
class PoolHolding:
    """How this node takes pool copies: ``held`` keeps them; ``node_owner()`` (blocking;
    ``BadOwner`` when it cannot tell) is the namespace its RAM disk serves now, whose jobs'
    copies alone it keeps."""

    held: PoolHeld
    node_owner: Callable[[], str]
    executor: Executor
    max_lead: int = MAX_STEP_LEAD

    async def admit(
        self, item: ItemId, pusher: str | None, runs_here: bool
    ) -> tuple[Admission, str, Collection[str] | None]:
        """The verdict on a pool copy of ``item`` from ``pusher``, and what its manifest's
        attestation must say: the owner, and the producers (the pusher itself, when its
        certificate names a node)."""
        loop = asyncio.get_running_loop()
        producers = None if pusher in (None, LEGACY) else (pusher,)
        try:
            newest, owner, others = await loop.run_in_executor(self.executor, self._read, item.job)
        except BadOwner as exc:
            why = f"{item}: cannot tell whose this node is now, so it keeps no pool copy: {exc}"
            return Admission(Verdict.NOT_SERVED, why), UNOWNED, producers
        if others:
            why = (
                f"{item}: this node holds items of job {item.job} of several nodes (it ran "
                "here); a pool copy never goes beside them"
            )
            return Admission(Verdict.NOT_SERVED, why), owner, producers
        admission = admit_pool_copy(
            item, runs_here=runs_here, newest_held=newest, max_lead=self.max_lead
        )
        return admission, owner, producers

    def _read(self, job: str) -> tuple[int | None, str, bool]:
        return self.held.newest(job), self.node_owner(), self.held.of_several_nodes(job)

    async def committed(self, item: ItemId) -> None:
        loop = asyncio.get_running_loop()
        dropped = await loop.run_in_executor(self.executor, self.held.committed, item)
        if dropped:
            log.info(
                "pool copies of job %s: dropped steps %s, keeping the newest",
                item.job,
                dropped,
                extra={"job": item.job},
            )
