"""``--require-rank-grant``: a node stack that serves only jobs mtc-controller assigned ranks
for, against four real daemons with their own certificates and an insider holding a fifth
certificate of the same CA (``mallory``), as ``test_grants`` sets them up.

Without the flag, a job the controller did not assign (no sticky-ranks label) binds each
rank to the first node that joins as it (SECURITY.md, "Coordinator inputs"). With it, no
rank is ever bound by coming first: a handshake without the node's grant is refused with
the reason in ``replicator.failed`` (so no coordinator, no join, no push), and the job's
items are read only by the nodes of its newest grant, whatever the node serves.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2, peer_pb2_grpc
from mtc_replicator.core.contract import FAILED_FILE
from mtc_replicator.transport.tls import TlsMaterial
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import read_prerestore, wait_until
from tests.integration.test_grants import _join_as, _mallory, grant, handshake

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster_extra() -> tuple[str, ...]:
    return ("--require-rank-grant",)


def test_a_job_without_its_grant_runs_nowhere_until_the_grant_comes(cluster: Cluster) -> None:
    handshake(cluster, list(range(NODES)))
    for r in range(NODES):
        failed = cluster.dirs[r] / FAILED_FILE
        wait_until(failed.exists, f"rank {r}'s handshake refused", daemon=cluster.daemon(r))
        text = failed.read_text()
        assert "--require-rank-grant" in text
        assert f"gives it rank {r}" in text
        assert "mtc_replicator.client.rank" in text
        assert cluster.markers(r) == []
    # Nobody hosts the job's coordinator: an insider's join as any rank goes nowhere.
    outcome = asyncio.run(_join_as(cluster, _mallory(cluster), 2, "mallory-as-2"))
    assert "hosts no coordinator" in outcome, outcome

    grant(cluster)
    for r in range(NODES):
        (cluster.dirs[r] / FAILED_FILE).unlink()
    handshake(cluster, list(range(NODES)))  # the job restarted, as the remedy says
    cluster.wait_markers(0)
    for r in range(NODES):
        assert read_prerestore(cluster.dirs[r]) == {}
    cluster.save(5)  # the peer tier works under the grant's bindings


def test_only_the_grants_nodes_read_and_nobody_reads_an_ungranted_job(cluster: Cluster) -> None:
    grant(cluster)
    cluster.fresh_start()
    cluster.save(5)
    mallory = _mallory(cluster)
    node1 = cluster.tls[1]
    assert node1 is not None

    def listed(tls: TlsMaterial, job: str) -> grpc.StatusCode | int:
        with grpc.secure_channel(
            cluster.daemon(0).address, tls.channel_credentials(), options=tls.channel_options()
        ) as channel:
            try:
                answer = peer_pb2_grpc.PeerStub(channel).ListItems(
                    peer_pb2.ListItemsRequest(job=job), timeout=10
                )
            except grpc.RpcError as exc:
                return exc.code()
            return len(answer.items)

    assert listed(mallory.material(), cluster.job) is grpc.StatusCode.PERMISSION_DENIED
    count = listed(node1.material(), cluster.job)
    assert isinstance(count, int)
    assert count >= 1
    # A job this node holds no grant of is read by nobody (without the flag: anyone).
    assert listed(node1.material(), "not-granted") is grpc.StatusCode.PERMISSION_DENIED
