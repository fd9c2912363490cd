"""No single report destroys data (issue 25, item 5), against four real daemons.

The attacker holds node 3's certificate (the CA's, as any node's): mutual TLS lets it join
the round as rank 3 and report. A member may report failed only the sources its plan gave
it, and only for its own restore; but a rank with no source left has no step, so its
report of failing its OWN sources takes the whole job to an older step or a fresh start.
That it may do (it could as well never report ready); what it must not do is have the
survivors delete their committed copies: they are set aside, and the job restores them
at the next restart once the attacker is gone.
"""

from __future__ import annotations

import asyncio

import pytest

from mtc_replicator.cluster.coordinator_client import CoordinatorClient
from mtc_replicator.cluster.messages import (
    FailedFetch,
    RestoreReport,
    RoundState,
    cluster_view_json,
)
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.coordination import Phase
from tests.integration.cluster import NODES, Cluster, assert_restored
from tests.integration.helpers import config_text, store_root, wait_until

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"
FORGED = "forged3"


def _kept(
    cluster: Cluster, rank: int, areas: tuple[str, ...] = ("items", "aside")
) -> set[tuple[int, str]]:
    """(step, '<rank>-<worker>') of every committed item in the rank's store, in the index
    or set aside: what the node still holds, whatever the restore round made of it."""
    held = set()
    for area in areas:
        root = store_root(cluster.dirs[rank]) / area / cluster.job
        for path in root.glob("*/*/MANIFEST.json") if root.is_dir() else ():
            held.add((int(path.parent.parent.name), path.parent.name))
    return held


async def _report_own_sources_failed(
    cluster: Cluster, newest: int, down_to: int | None
) -> RoundState:
    """Join as rank 3 holding nothing, report every source the plan gave rank 3 failed
    until the plan is ``down_to``, then ready for it, so that the round is released."""
    tls = cluster.tls[3]
    assert tls is not None
    view = cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))
    address = cluster.daemon(0).address
    async with CoordinatorClient(cluster.job, address, tls=tls.material()) as client:

        async def planned(round_: int, state: RoundState | None = None) -> RoundState:
            while state is None or state.phase is not Phase.FETCH:
                state = await client.round_status(3, FORGED, round_, seen=state, wait_seconds=5)
                round_ = state.round
            return state

        plan = await planned((await client.join(3, FORGED, view, NOWHERE, {})).round)
        assert plan.step == newest, plan
        while plan.step != down_to:
            failures = [
                FailedFetch(f, corrupt=False, detail="unreachable")
                for fetches in plan.assignments.values()
                for f in fetches
            ]
            await client.report_restore(
                3,
                FORGED,
                RestoreReport(
                    plan.round, plan.plan_version, False, tuple(failures), plan.addresses
                ),
            )
            plan = await planned(plan.round)
        await client.report_restore(3, FORGED, RestoreReport(plan.round, plan.plan_version, True))
        return plan


@pytest.mark.parametrize("cluster_backup", [False])
def test_one_ranks_report_of_its_own_sources_failed_deletes_no_survivors_copies(
    cluster: Cluster,
) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    holder = cluster.holder(3, 5)
    before = {r: _kept(cluster, r) for r in range(3)}
    assert (5, "3-0") in before[holder]
    # Node 3 lost its RAM disk and is down; the attacker plays rank 3 in the job's restart.
    cluster.daemon(3).kill()
    cluster.clear(3)
    cluster.handshake([0, 1, 2])
    final = asyncio.run(_report_own_sources_failed(cluster, 5, None))
    assert final.step is None  # its word for its own restore left step 5 no source for it
    for r in range(3):
        wait_until(
            lambda r=r: cluster.markers(r) == [f"{cluster.job}-s0-n{r}-w0.restore"],
            f"rank {r}'s fresh-start marker",
            daemon=cluster.daemon(r),
        )
    # The survivors' committed copies outlive the round: their own and rank 3's peer copy.
    for r in range(3):
        assert _kept(cluster, r) == before[r], r
        assert "aside" in cluster.errors(r), cluster.errors(r)
    assert "passed over only because ranks [3]" in cluster.daemon(0).log()
    # The attacker stops; node 3 comes back empty; the job's next restart restores step 5.
    cluster.start(3)
    cluster.handshake([2, 3, 1, 0])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    assert cluster.source(3) == "peer"


@pytest.mark.parametrize("cluster_backup", [False])
def test_one_ranks_report_that_costs_the_newest_step_deletes_none_of_it(cluster: Cluster) -> None:
    cluster.fresh_start()
    cluster.save(5)
    files = cluster.save(10)
    before = {r: _kept(cluster, r) for r in range(3)}
    assert all((10, f"{r}-0") in before[r] for r in range(3))
    cluster.daemon(3).kill()
    cluster.clear(3)
    cluster.handshake([0, 1, 2])
    # Rank 3's word takes the job back to step 5 (its sources of step 5 are left alone).
    final = asyncio.run(_report_own_sources_failed(cluster, 10, 5))
    assert final.step == 5
    for r in range(3):
        wait_until(
            lambda r=r: cluster.markers(r) == [f"{cluster.job}-s5-n{r}-w0.restore"],
            f"rank {r}'s marker of step 5",
            daemon=cluster.daemon(r),
        )
    # Step 10 is gone from no store: set aside, not restorable, not deleted by retention.
    for r in range(3):
        assert _kept(cluster, r) == before[r], r
    assert "passed over only because ranks [3]" in cluster.daemon(0).log()
    cluster.start(3)
    cluster.handshake([3, 0, 2, 1])
    cluster.wait_markers(10)
    assert_restored(cluster, 10, files)


def test_steps_set_aside_go_once_a_newer_step_is_restorable(cluster: Cluster) -> None:
    """The honest path: two nodes lost, so step 7 cannot be completed and the job goes back
    to step 5 (in the backup); the survivors keep step 7 aside, then let it go once the job
    saved a newer step that every rank holds, and never hold it in the meantime as theirs."""
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)
    cluster.save(7)  # not due for a backup
    lost = (1, cluster.holder(1, 7))
    survivors = [r for r in range(NODES) if r not in lost]
    for r in lost:
        cluster.wipe(r)
    cluster.handshake([0, 1, 2, 3])
    cluster.wait_markers(5)
    for r in survivors:
        assert (7, f"{r}-0") in _kept(cluster, r, ("aside",)), r
        assert (7, f"{r}-0") not in cluster.held(r), r
    cluster.save(12)
    for r in survivors:
        wait_until(
            lambda r=r: _kept(cluster, r, ("aside",)) == set(),
            f"rank {r} releasing step 7 once step 12 is restorable",
            daemon=cluster.daemon(r),
        )
        assert (12, f"{r}-0") in cluster.held(r)
