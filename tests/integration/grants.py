"""mtc-controller's grant, given by the test as the controller gives it (``Node/AssignRank``
over TLS with the controller's certificate). A receiver that no rank 0 ever answers (the
``RECEIVER`` layout) then knows which node holds rank 0, and takes that node's pushes
(``core.admission``: none from a named node before)."""

from __future__ import annotations

from pathlib import Path

import grpc

from mtc_replicator._pb.mtc.v1 import node_pb2, node_pb2_grpc
from mtc_replicator.tools import certs
from mtc_replicator.transport.tls import TlsMaterial
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import RECEIVER


def controller(ca: certs.Pair, out: Path) -> TlsMaterial:
    """The controller's certificate of ``ca``, written below ``out`` the first time."""
    if not out.exists():
        certs.write_node_files(out, ca, certs.issue_controller(ca))
    return TlsMaterial(certs.node_files(out))


def assign_rank(
    address: str,
    material: TlsMaterial,
    job: str,
    *,
    rank: int,
    nodes: int,
    holders: tuple[str, ...],
    pod_uid: str = "",
) -> None:
    """What mtc-controller tells the daemon at ``address`` once the job's pods are placed:
    it holds ``rank`` of ``job``, every rank's node in ``holders`` (rank 0's first);
    ``pod_uid``: the pod its owner file names, if it has one."""
    request = node_pb2.AssignRankRequest(
        job=job,
        pod_uid=pod_uid,
        rank=rank,
        nodes=nodes,
        coordinator="127.0.0.1:8476",
        assignment="a1",
        source="index",
        holders=list(holders),
    )
    with grpc.secure_channel(
        address, material.channel_credentials(), options=material.channel_options()
    ) as channel:
        node_pb2_grpc.NodeStub(channel).AssignRank(request, timeout=10)


def grant_receiver(
    daemon: DaemonProcess,
    ca: certs.Pair,
    root: Path,
    job: str,
    *,
    holders: tuple[str, ...],
    pod_uid: str = "",
) -> None:
    """Assign ``daemon``'s rank (``RECEIVER``'s) of ``job`` (see ``assign_rank``)."""
    assign_rank(
        daemon.address,
        controller(ca, root / "controller"),
        job,
        rank=RECEIVER["rank"],
        nodes=RECEIVER["nodes"],
        holders=holders,
        pod_uid=pod_uid,
    )
