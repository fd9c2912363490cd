"""Hostile coordinator inputs against four real daemons (issue 16, item 4).

The attacker holds a node certificate of the stack's CA (node 3's): mutual TLS lets it call
every coordinator method, so the coordinator itself must keep a stranger's Join from
stopping a running job and a member's ReportRestore from taking the others' copies away.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as cpb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc, peer_pb2
from mtc_replicator.cluster.coordinator_client import CoordinatorClient
from mtc_replicator.cluster.link import CoordinatorError
from mtc_replicator.cluster.messages import (
    FailedFetch,
    RestoreReport,
    RoundState,
    cluster_view_json,
)
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.coordination import Phase
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.tools import certs
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import config_text, read_prerestore, read_tree, wait_until

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"
DIGEST = "0" * 64


def _view(cluster: Cluster) -> str:
    return cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))


def _intruder(cluster: Cluster, node: int = 3) -> CoordinatorClient:
    """A client of rank 0's coordinator with node ``node``'s certificate (the CA's)."""
    tls = cluster.tls[node]
    assert tls is not None
    return CoordinatorClient(cluster.job, cluster.daemon(0).address, tls=tls.material())


def test_a_stray_join_in_steady_state_stops_no_backup(cluster: Cluster) -> None:
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)

    async def stray_join() -> RoundState:
        # From rank 2's own node: from another, the join is not even queued
        # (tests/integration/test_rank_holders.py).
        async with _intruder(cluster, node=2) as client:
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
                    RestoreReport(
                        plan.round, plan.plan_version, False, tuple(everything), addresses
                    ),
                )
            except CoordinatorError as exc:
                refusal = str(exc)
            # Then it claims ready for whatever plan stands, so that the round is released.
            plan = await planned(client, plan.round)
            await client.report_restore(
                3, "forged3", RestoreReport(plan.round, plan.plan_version, True)
            )
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


def _secure_channel(cluster: Cluster, address: str) -> grpc.Channel:
    """A channel with node 3's certificate, as ``_intruder`` has, for raw stubs."""
    tls = cluster.tls[3]
    assert tls is not None
    files = tls.files
    creds = grpc.ssl_channel_credentials(
        files.ca.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    return grpc.secure_channel(address, creds, options=options)


def test_an_oversized_join_is_refused_before_it_costs_the_loop(cluster: Cluster) -> None:
    """65,535 invented items in one Join (issue 23): refused INVALID_ARGUMENT at once, and
    the health service on rank 0's loop answers promptly meanwhile. The limit of a 4-node,
    1-worker job is 4 x 1 x 64 items."""
    cluster.fresh_start()
    job = cluster.job
    request = cpb.JoinRequest(
        job=job,
        rank=2,
        incarnation_id="oversized2",
        cluster_view=_view(cluster),
        address=NOWHERE,
        items=[
            cpb.HeldItem(
                item=peer_pb2.ItemRef(job=job, step=step, rank=2, worker=0), manifest_digest=DIGEST
            )
            for step in range(65_535)
        ],
    )
    address = cluster.daemon(0).address
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with _secure_channel(cluster, address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                t0 = time.monotonic()
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                latencies.append(time.monotonic() - t0)
                stop.wait(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    with _secure_channel(cluster, address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        prober.start()
        try:
            for _ in range(3):
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Join(request, timeout=30)
                elapsed = time.monotonic() - t0
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                    refused.value.code(),
                    refused.value.details(),
                )
                assert "items: 65535 entries, at most 256" in str(refused.value.details())
                assert elapsed < 2.0, elapsed  # the 7 MB request crossing loopback, no more
        finally:
            stop.set()
            prober.join(15)
    assert latencies, "no health check answered"
    # Each of those joins cost the loop 0.7-2.6 s before; a busy CI box adds its own delays.
    assert max(latencies) < 1.0, sorted(latencies)[-5:]
    # The job runs on: the refused join changed nothing.
    cluster.save(5)
    for r in range(NODES):
        assert (5, f"{r}-0") in cluster.held(r)
