"""A pool copy must never cost a node the copies it holds of a job that are not pool copies.

A node keeps the items of a job that ran here (as one of several nodes) after the job
left: its own rank's steps and the peers' replicas, perhaps the only copies of a step not
yet backed up, which SECURITY.md lets go only by the drop rules ("never drop an only
copy" without ``even_if_only_copy``). A push marked ``pool_copy`` of that job's rank 0
was admitted against every rank-0 item held here (``PoolHeld.newest``), and once
committed ``PoolHeld.committed`` kept only the newest two rank-0 steps of the job, deleting
the job's real rank-0 items: any node certificate holder could delete them with two
pushes of its own bytes, attested as itself for this node's namespace, and the note it
left made the job's next start here drop the rest of rank 0 as "pool copies".
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mtc_replicator.core.admission import Verdict
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.pool_held import PoolHeld
from mtc_replicator.local.store import LocalStore
from mtc_replicator.transport.pool_holding import PoolHolding
from tests.unit.cluster.test_pool import _commit

JOB = "trainer"
OWNER = "team-a"


def test_a_pool_copy_never_deletes_a_jobs_replicas_held_here(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    store = LocalStore(ckpt)
    store.open()
    # A 2-node job that ran here as rank 1 and left: its own steps and rank 0's replicas.
    real = [ItemId(JOB, step, rank, 0) for step in (10, 20, 30) for rank in (0, 1)]
    for item in real:
        _commit(store, item, tmp_path)
    held = PoolHeld(store)
    with ThreadPoolExecutor(1) as executor:
        holding = PoolHolding(held, lambda: OWNER, executor)

        async def push(step: int) -> None:
            """What ``PeerServicer`` does with a pool copy: admit, commit, ``committed``."""
            item = ItemId(JOB, step, 0, 0)
            admission, _, _ = await holding.admit(item, "mallory", runs_here=False)
            if admission.verdict is not Verdict.ACCEPT:
                return  # refused before a byte is staged
            _commit(store, item, tmp_path)
            await holding.committed(item)

        async def scenario() -> None:
            await push(31)
            await push(32)

        asyncio.run(scenario())

    left = set(store.manifests(JOB))
    assert set(real) <= left, f"deleted: {sorted(map(str, set(real) - left))}"
    # And the job's next start here as a job of several nodes keeps its real items.
    held.settle(JOB, nodes=2)
    assert set(real) <= set(store.manifests(JOB))
