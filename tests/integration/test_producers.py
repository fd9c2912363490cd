"""A restoring rank is told which nodes may have produced each item it restores (issue 25,
item 2), by rank 0's real coordinator over real gRPC, through a restart of rank 0's daemon.

Every node has its own certificate (``tests/integration/cluster.py``: node0..node3). Node 3
is lost after step 5; its rank comes back on node 9 (a fifth certificate of the same CA),
played by the test: the plan it gets names node 3, and only node 3, as the producer of
every source of rank 3's step 5, because rank 0's coordinator saw the job from its fresh
start and its daemon kept the history (``rank-holders/<job>.json``) through its restart.
Node 9 holds rank 3 now, but made none of step 5: its own signed bytes must not pass for
rank 3's. Without the record, the restarted coordinator cannot know who produced step 5:
it says so (None).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mtc_replicator.cluster.coordinator_client import CoordinatorClient
from mtc_replicator.cluster.link import CoordinatorError, NoCoordinator
from mtc_replicator.cluster.messages import RoundState, cluster_view_json
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.coordination import Phase
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import config_text, store_root
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"


async def _plan_of_rank3(cluster: Cluster, tls: NodeTls) -> RoundState:
    """Join rank 0's coordinator as rank 3 of the job's new incarnation until the round is
    planned (a join before rank 0's own opens the round is refused: rank 3 is node 3's
    until then), and return rank 3's plan."""
    view = cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))
    deadline = time.monotonic() + 60
    async with CoordinatorClient(cluster.job, cluster.daemon(0).address, tls=tls.material()) as c:
        while True:
            assert time.monotonic() < deadline, "rank 3 was never planned"
            try:
                state = await c.round_status(
                    3,
                    "on-node9",
                    (await c.join(3, "on-node9", view, NOWHERE, {})).round,
                    wait_seconds=5,
                )
                while state.phase is Phase.WAITING:
                    state = await c.round_status(
                        3, "on-node9", state.round, seen=state, wait_seconds=5
                    )
            except (NoCoordinator, CoordinatorError):
                await asyncio.sleep(0.2)  # not hosted again yet, or the round moved on
                continue
            if state.phase is Phase.FETCH:
                return state
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("record_kept", [True, False])
def test_rank3s_new_node_is_told_every_node_that_held_rank3(
    cluster: Cluster, record_kept: bool
) -> None:
    cluster.fresh_start()  # nothing anywhere: rank 0's coordinator sees every holder
    cluster.save(5)
    holder = cluster.holder(3, 5)
    record = store_root(cluster.dirs[0]) / "rank-holders" / f"{cluster.job}.json"
    assert record.is_file()
    # Rank 0's daemon restarts while the job runs (without its record, as on a node whose
    # store was rebuilt); then node 3 is lost and the job restarts.
    cluster.daemon(0).stop()
    if not record_kept:
        record.unlink()
    cluster.start(0)
    cluster.daemon(3).kill()
    cluster.clear(3)
    cluster.handshake([0, 1, 2])
    assert cluster.ca is not None
    node9 = node_tls(cluster.root / "tls" / "node9", cluster.ca, node="node9")
    plan = asyncio.run(_plan_of_rank3(cluster, node9))
    assert plan.step == 5
    fetches = [f for sources in plan.assignments.values() for f in sources]
    assert {f.holder for f in fetches} >= {holder}
    expected = ("node3",) if record_kept else None
    assert {f.producers for f in fetches} == {expected}
