"""Ranks bound to the node that joined as them, against four real daemons (issue 25, item 2).

Every node has its own certificate (``tests/integration/cluster.py``: node0..node3). The
attacker holds node 3's: a real node of the cluster, so mutual TLS and the node-name check
let it call every coordinator method. Before ranks were bound to nodes it could take rank
1 after rank 0's daemon restarted (the first progress report naming a rank was believed),
and queue itself as rank 2 for the next round while node 2 was down.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mtc_replicator.cluster.coordinator_client import CoordinatorClient
from mtc_replicator.cluster.link import CoordinatorError, NoCoordinator
from mtc_replicator.cluster.messages import RoundState, cluster_view_json
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.progress import Progress
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import config_text, store_root, wait_until

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"


def _intruder(cluster: Cluster) -> CoordinatorClient:
    """A client of rank 0's coordinator with node 3's certificate."""
    tls = cluster.tls[3]
    assert tls is not None
    return CoordinatorClient(cluster.job, cluster.daemon(0).address, tls=tls.material())


def test_after_rank0_restarts_an_impostors_first_report_does_not_take_a_rank(
    cluster: Cluster,
) -> None:
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)
    holders = store_root(cluster.dirs[0]) / "rank-holders" / f"{cluster.job}.json"
    assert holders.is_file(), "the released round's holders are kept beside the store"
    # Rank 1 is silent while rank 0's daemon restarts: the impostor's report comes first.
    cluster.pause(1)
    try:
        cluster.daemon(0).stop()
        cluster.start(0)

        async def impostor_report() -> str:
            deadline = time.monotonic() + 30
            async with _intruder(cluster) as client:
                while True:
                    try:
                        await client.report_progress(1, "impostor-of-1", Progress(5))
                    except NoCoordinator:  # not hosted again yet
                        assert time.monotonic() < deadline, "rank 0's coordinator never came"
                        await asyncio.sleep(0.1)
                        continue
                    except CoordinatorError as exc:
                        return str(exc)
                    return "accepted"

        outcome = asyncio.run(impostor_report())
    finally:
        cluster.resume(1)
    assert outcome != "accepted"
    log = cluster.daemon(0).log()
    assert "progress report refused: rank 1 is held by node 'node1', not 'node3'" in log
    # The real rank 1 keeps its rank: its reports are adopted, so step 10 is backed up.
    cluster.save(10)
    cluster.wait_backup(10)


def test_an_impostor_cannot_join_as_the_rank_of_a_node_that_is_down(cluster: Cluster) -> None:
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)
    cluster.daemon(2).kill()  # node 2 is down
    view = cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))

    async def impostor_join() -> RoundState:
        async with _intruder(cluster) as client:
            round_ = (await client.join(2, "impostor-of-2", view, NOWHERE, {})).round
            return await client.round_status(2, "impostor-of-2", round_)

    # Before: queued for the next round rank 0 opens ("waiting for rank 0"), as rank 2.
    state = asyncio.run(impostor_join())
    assert state.phase is None, state
    assert "not a member" in state.message
    wait_until(
        lambda: "is held by node 'node2', not 'node3'" in cluster.daemon(0).log(),
        "the refusal logged",
        daemon=cluster.daemon(0),
    )
    # Node 2 comes back: its rank is still its own, the job runs on and backs up.
    cluster.start(2)
    cluster.save(10)
    cluster.wait_backup(10)
