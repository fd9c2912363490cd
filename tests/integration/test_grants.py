"""Who may be rank r is decided by mtc-controller's grant, not by whoever comes first (issue
39), against four real daemons with their own certificates (node0..node3) and an insider
holding a fifth certificate of the same CA (``mallory``: a node of the stack, not of the
job). Before the job starts, the controller's certificate hands every node its pod's rank
and the whole assignment's bindings (``Node/AssignRank``), as mtc-controller does.

- At the job's first start, with node 2's pod not up yet, the insider's join as rank 2 is
  refused (before: admitted, and its claimed steps restored by the other ranks); node 2
  then joins and the job starts fresh.
- A flood of the insider's joins as rank 2 while node 2 starts never takes the rank: node 2's
  join is admitted, every rank gets its marker, and the refusals are logged once.
- A push of rank 1's item by the insider, in the first seconds of the run, is refused before
  a byte of it is read.
- The insider can neither list nor pull the job's items; a node of the grant can.

Each fails on the code before grants (``git show`` it into a scratch worktree to check).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2, peer_pb2_grpc
from mtc_replicator.cluster.coordinator_client import CoordinatorClient
from mtc_replicator.cluster.link import CoordinatorError
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.coordination import JoinRejected
from mtc_replicator.core.layout import holders
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.peerwire import item_ref
from mtc_replicator.transport.tls import TlsMaterial
from tests.integration.cluster import NODES, Cluster
from tests.integration.grants import assign_rank, controller
from tests.integration.helpers import config_text, read_prerestore, wait_until, write_yaml_atomic
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration

NOWHERE = "127.0.0.1:9"


def _controller(cluster: Cluster) -> TlsMaterial:
    assert cluster.ca is not None
    return controller(cluster.ca, cluster.root / "tls" / "controller")


def _mallory(cluster: Cluster) -> NodeTls:
    assert cluster.ca is not None
    return node_tls(cluster.root / "tls" / "mallory", cluster.ca, node="mallory")


def grant(cluster: Cluster) -> None:
    """What mtc-controller does once the job's pods are placed: rank r on node r."""
    material = _controller(cluster)
    for node in range(NODES):
        assign_rank(
            cluster.daemon(node).address,
            material,
            cluster.job,
            rank=node,
            nodes=NODES,
            holders=tuple(f"node{n}" for n in range(NODES)),
            pod_uid=f"pod-{node}",
        )


def handshake(cluster: Cluster, ranks: list[int]) -> None:
    for r in ranks:
        write_yaml_atomic(
            cluster.dirs[r], config_text(cluster.job, rank=r, nodes=NODES, **cluster.keys)
        )


def _view(cluster: Cluster) -> str:
    return cluster_view_json(parse_config(config_text(cluster.job, nodes=NODES, **cluster.keys)))


async def _join_as(cluster: Cluster, mallory: NodeTls, rank: int, incarnation: str) -> str:
    """The insider's join as ``rank`` at rank 0's coordinator: "admitted" or the refusal."""
    deadline = time.monotonic() + 30
    async with CoordinatorClient(
        cluster.job, cluster.daemon(0).address, tls=mallory.material()
    ) as client:
        while True:
            try:
                await client.join(rank, incarnation, _view(cluster), NOWHERE, {})
            except (CoordinatorError, JoinRejected) as exc:
                if "hosts no coordinator" in str(exc) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # rank 0's handshake not accepted yet
                    continue
                return str(exc)
            return "admitted"


def test_an_insiders_join_as_a_rank_not_started_yet_is_refused(cluster: Cluster) -> None:
    grant(cluster)
    mallory = _mallory(cluster)
    handshake(cluster, [0, 1, 3])  # node 2's pod is not up yet
    outcome = asyncio.run(_join_as(cluster, mallory, 2, "mallory-as-2"))
    assert "granted to node 'node2'" in outcome, outcome
    handshake(cluster, [2])
    cluster.wait_markers(0)  # a fresh start: nothing to restore on any rank
    for r in range(NODES):
        assert read_prerestore(cluster.dirs[r]) == {}
    assert "join refused: rank 2 is granted to node 'node2'" in cluster.daemon(0).log()


def test_a_flood_of_joins_never_locks_the_granted_node_out(cluster: Cluster) -> None:
    grant(cluster)
    mallory = _mallory(cluster)
    handshake(cluster, [0, 1, 3])

    async def flood() -> list[str]:
        first = await _join_as(cluster, mallory, 2, "mallory-0")  # the coordinator is up
        async with CoordinatorClient(
            cluster.job, cluster.daemon(0).address, tls=mallory.material()
        ) as client:

            async def one(i: int) -> str:
                try:
                    await client.join(2, f"mallory-{i}", _view(cluster), NOWHERE, {})
                except (CoordinatorError, JoinRejected) as exc:
                    return str(exc)
                return "admitted"

            handshake(cluster, [2])  # node 2 starts in the middle of it
            rest = await asyncio.gather(*(one(i) for i in range(1, 300)))
        return [first, *rest]

    outcomes = asyncio.run(flood())
    assert "admitted" not in outcomes
    cluster.wait_markers(0)
    log = cluster.daemon(0).log()
    refused = "join refused: rank 2 is granted to node 'node2' by mtc-controller's assignment"
    assert log.count(refused) == 1


def _forged_push(cluster: Cluster, mallory: NodeTls, target: int, tmp_path: Path) -> str:
    """Once ``target`` accepted its handshake, the insider pushes it a forged step 20 of
    rank 1, attested by its own key: "accepted" or the refusal."""
    wait_until(
        lambda: not (cluster.dirs[target] / "replicator.yaml").exists(),
        "the handshake accepted",
        daemon=cluster.daemon(target),
    )
    data = tmp_path / "forged"
    data.mkdir()
    (data / "state.bin").write_bytes(b"forged step 20 of rank 1")
    manifest = mallory.attest(build_manifest(ItemId(cluster.job, 20, 1, 0), data))

    async def push() -> str:
        client = PeerClient(tls=mallory.material())
        try:
            await client.push_item(cluster.daemon(target).address, manifest, data)
        except Exception as exc:
            return str(exc)
        finally:
            await client.close()
        return "accepted"

    return asyncio.run(push())


def test_an_insiders_push_in_the_first_seconds_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    grant(cluster)
    mallory = _mallory(cluster)
    # Rank 1's copies go to the node that holds its peer copy: the insider poses as rank 1,
    # the moment that node accepted its handshake (before any word from the coordinator).
    config = parse_config(config_text(cluster.job, rank=1, nodes=NODES, **cluster.keys))
    (target,) = holders(config, 1).copies
    handshake(cluster, list(range(NODES)))
    outcome = _forged_push(cluster, mallory, target, tmp_path)
    assert "node 'node1', not 'mallory'" in outcome, outcome
    assert (20, "1-0") not in cluster.held(target)


def test_without_a_grant_no_push_is_taken_before_the_ranks_nodes_are_known(
    cluster: Cluster, tmp_path: Path
) -> None:
    """No controller: a rank's node is known once the job's coordinator answered. Before
    that (one node's pod not up, so no round is released and nobody answered), the insider's
    push of rank 1's forged item is refused (before: taken on the layout's word, and once
    in an inventory before the first plan, the job's record of who produced what was never
    complete, so a later restart could restore it). The job then starts and replicates."""
    mallory = _mallory(cluster)
    config = parse_config(config_text(cluster.job, rank=1, nodes=NODES, **cluster.keys))
    (target,) = holders(config, 1).copies
    late = next(r for r in range(NODES) if r not in (1, target))  # its pod is not up yet
    handshake(cluster, [r for r in range(NODES) if r != late])
    outcome = _forged_push(cluster, mallory, target, tmp_path)
    assert "does not know yet which node holds rank 1" in outcome, outcome
    assert (20, "1-0") not in cluster.held(target)
    handshake(cluster, [late])
    cluster.wait_markers(0)
    for r in range(NODES):
        os.unlink(cluster.dirs[r] / f"{cluster.job}-s0-n{r}-w0.restore")
    cluster.save(5)  # every rank's copy taken at its holder once the nodes are known


def test_only_the_grants_nodes_read_the_jobs_items(cluster: Cluster) -> None:
    grant(cluster)
    mallory = _mallory(cluster)
    cluster.fresh_start()
    cluster.save(5)
    item = ItemId(cluster.job, 5, 0, 0)

    def call(tls: TlsMaterial, what: str) -> grpc.StatusCode | int:
        with grpc.secure_channel(
            cluster.daemon(0).address, tls.channel_credentials(), options=tls.channel_options()
        ) as channel:
            stub = peer_pb2_grpc.PeerStub(channel)
            try:
                if what == "list":
                    return len(stub.ListItems(peer_pb2.ListItemsRequest(job=cluster.job)).items)
                for _ in stub.PullItem(peer_pb2.PullItemRequest(item=item_ref(item))):
                    pass
                return 0
            except grpc.RpcError as exc:
                return exc.code()

    assert call(mallory.material(), "list") is grpc.StatusCode.PERMISSION_DENIED
    assert call(mallory.material(), "pull") is grpc.StatusCode.PERMISSION_DENIED
    node1 = cluster.tls[1]
    assert node1 is not None
    listed = call(node1.material(), "list")
    assert isinstance(listed, int)
    assert listed >= 1
    # A listing of every job leaves the granted job out for the insider.
    with grpc.secure_channel(
        cluster.daemon(0).address,
        mallory.material().channel_credentials(),
        options=mallory.material().channel_options(),
    ) as channel:
        every = peer_pb2_grpc.PeerStub(channel).ListItems(peer_pb2.ListItemsRequest())
    assert all(i.item.job != cluster.job for i in every.items)
    wait_until(lambda: "refused: not a node of its grant" in cluster.daemon(0).log(), "logged")
