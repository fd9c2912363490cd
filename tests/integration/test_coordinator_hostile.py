"""Hostile coordinator inputs against four real daemons (issue 16, item 4).

The attacker holds a node certificate of the stack's CA (node 3's): mutual TLS lets it call
every coordinator method, so the coordinator itself must keep a stranger's Join from
stopping a running job and a member's ReportRestore from taking the others' copies away.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from replicator.cluster.client import CoordinatorClient, CoordinatorError
from replicator.cluster.messages import FailedFetch, RoundState, cluster_view_json
from replicator.core.contract import parse_config
from replicator.core.coordination import Phase
from replicator.core.manifest import ItemId
from replicator.core.policy import Source
from replicator.core.restore_plan import Fetch
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import config_text, read_prerestore, read_tree, wait_until

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"
DIGEST = "0" * 64


def _view(cluster: Cluster) -> str:
    return cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))


def _intruder(cluster: Cluster) -> CoordinatorClient:
    """A client of rank 0's coordinator with node 3's certificate (the CA's: any node)."""
    tls = cluster.tls[3]
    assert tls is not None
    return CoordinatorClient(cluster.job, cluster.daemon(0).address, tls=tls.material())


def test_a_stray_join_in_steady_state_stops_no_backup(cluster: Cluster) -> None:
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)

    async def stray_join() -> RoundState:
        async with _intruder(cluster) as client:
            round_ = (await client.join(2, "stray2", _view(cluster), NOWHERE, {})).round
            return await client.round_status(2, "stray2", round_)

    # A leftover or forged joiner of rank 2: it waits for rank 0's restart, no more.
    state = asyncio.run(stray_join())
    cluster.save(10)
    cluster.wait_backup(10)  # the running job still backs up: its round was not replaced
    for r in range(NODES):
        assert (10, f"{r}-0") in cluster.held(r)
        assert not os.path.exists(cluster.restored(r, 10))
    assert (state.phase, state.missing) == (Phase.WAITING, (0,))


def test_a_member_cannot_report_the_survivors_copies_as_failed(cluster: Cluster) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    cluster.daemon(3).stop()  # node 3 is down; an intruder joins the round as rank 3
    cluster.handshake([0, 1, 2])
    job = cluster.job
    # Every copy of every rank's step 5 that exists: their own, each peer copy, the backup.
    everything = [
        FailedFetch(Fetch(Source.PEER, ItemId(job, 5, r, 0), h, DIGEST), corrupt=True)
        for r in range(NODES)
        for h in range(NODES)
        if h != 3
    ] + [
        FailedFetch(Fetch(Source.BACKUP, ItemId(job, 5, r, 0), None, DIGEST), corrupt=True)
        for r in range(NODES)
    ]
    addresses = dict.fromkeys(range(NODES), NOWHERE)

    async def planned(client: CoordinatorClient, round_: int) -> RoundState:
        state = None
        while state is None or state.phase is not Phase.FETCH:
            state = await client.round_status(3, "forged3", round_, seen=state, wait_seconds=5)
            round_ = state.round
        return state

    async def intrude() -> str:
        async with _intruder(cluster) as client:
            round_ = (await client.join(3, "forged3", _view(cluster), NOWHERE, {})).round
            plan = await planned(client, round_)
            refusal = ""
            try:
                await client.report_restore(
                    3,
                    "forged3",
                    plan.round,
                    plan.plan_version,
                    ready=False,
                    failures=everything,
                    addresses=addresses,
                )
            except CoordinatorError as exc:
                refusal = str(exc)
            # Then it claims ready for whatever plan stands, so that the round is released.
            plan = await planned(client, plan.round)
            await client.report_restore(3, "forged3", plan.round, plan.plan_version, ready=True)
            return refusal

    refusal = asyncio.run(intrude())
    for r in range(3):
        wait_until(
            lambda r=r: cluster.markers(r) != [],
            f"rank {r}'s marker",
            daemon=cluster.daemon(r),
        )
        assert cluster.markers(r) == [f"{job}-s5-n{r}-w0.restore"]
        assert read_tree(cluster.restored(r, 5)) == files[r]
        assert read_prerestore(cluster.dirs[r])["restore-step"] == 5
        assert (5, f"{r}-0") in cluster.held(r)
    assert "INVALID_ARGUMENT" in refusal
    assert "did not give it" in refusal
