"""Per-node certificates as deploy/overlays/cert-manager-per-node issues them, against real
daemons: a certificate shaped as cert-manager's CA Issuer signs csi-driver's request (the
pod's name in the node URI, the shared DNS name, no subject), under the flags the overlay
passes (its ``--tls-node-name-pattern``, no ``--tls-shared-certificate``).

The daemon starts on such a certificate and names itself by the pod; another pod's
certificate of the same shape is served; a certificate of the same CA naming a Kubernetes
node (``mtc certs node``), or the old shared certificate, is refused on every call, and a
daemon given the shared certificate under these flags does not start. And what a pod's
name costs, in a four-node cluster: a rank whose pod is replaced under a running job gets
its rank back only when the job restarts, and loses nothing meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from mtc_replicator._pb.mtc.v1 import node_pb2, node_pb2_grpc, peer_pb2_grpc
from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.core.identity import node_uri
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import Cluster, assert_restored
from tests.integration.helpers import ram_disk, running_daemon, wait_until
from tests.integration.test_startup_checks import _one_line_exit_2, _start
from tests.tls import cert_manager_ca, csi_driver_certificate, node_tls

pytestmark = pytest.mark.integration

PATCH = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "components"
    / "cert-manager-per-node"
    / "daemonset-patch.yaml"
)
POD = "mtc-node-default-x7k2p"
OTHER_POD = "mtc-node-default-b9q4z"


def _overlay_pattern() -> str:
    """``MTC_TLS_NODE_NAME_PATTERN`` as the component's JSON patch sets it for the replicator
    (where it replaces ``MTC_TLS_SHARED_CERTIFICATE``)."""
    ops = yaml.safe_load(PATCH.read_text())
    values = [
        op["value"]["value"]
        for op in ops
        if op["op"] == "replace" and op["value"].get("name") == "MTC_TLS_NODE_NAME_PATTERN"
    ]
    assert len(values) == 1
    assert not [op for op in ops if "SHARED" in str(op.get("value")) and op["op"] != "test"]
    return str(values[0])


def _flags(root: Path, ca: certs.Pair, pair: certs.Pair) -> tuple[str, ...]:
    certs.write_node_files(root, ca, pair)
    files = certs.node_files(root)
    return (*certs.daemon_flags(files), "--tls-node-name-pattern", _overlay_pattern())


@dataclass
class Setup:
    ca: certs.Pair
    daemon: DaemonProcess


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("per-node")
    ca = cert_manager_ca()
    own = csi_driver_certificate(ca, node_uri(POD))
    with (
        ram_disk(root / "ckpt", "32m") as ckpt,
        running_daemon(ckpt, extra=_flags(root / "tls", ca, own)) as daemon,
    ):
        yield Setup(ca, daemon)


def _channel(setup: Setup, pair: certs.Pair) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(setup.ca.cert, pair.key, pair.cert)
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    return grpc.secure_channel(setup.daemon.address, creds, options=options)


def test_the_daemon_starts_on_a_csi_driver_certificate_named_by_its_pod(setup: Setup) -> None:
    log = setup.daemon.log()
    assert f"node={POD} " in log, log[-2000:]
    assert "tls=on" in log


def test_another_pods_certificate_is_a_node(setup: Setup) -> None:
    pair = csi_driver_certificate(setup.ca, node_uri(OTHER_POD))
    with _channel(setup, pair) as channel:
        peer_pb2_grpc.PeerStub(channel).ListItems(pb.ListItemsRequest(), timeout=5)
        node_pb2_grpc.NodeStub(channel).Status(node_pb2.NodeStatusRequest(), timeout=5)


@pytest.mark.parametrize(
    "kind", ["a Kubernetes node's name", "the shared certificate", "an RSA pod certificate"]
)
def test_what_the_overlay_does_not_issue_is_refused(setup: Setup, kind: str) -> None:
    if kind == "a Kubernetes node's name":
        pair = certs.issue(setup.ca, node="gke-pool-1-abcd")  # `mtc certs node`, same CA
    elif kind == "the shared certificate":
        pair = certs.issue(setup.ca)  # the shared DNS name, no node
    else:
        # Shaped right but naming no DaemonSet pod: the pattern, not the key type, decides.
        pair = csi_driver_certificate(setup.ca, node_uri("trainer-0"), rsa_key=True)
    with _channel(setup, pair) as channel, pytest.raises(grpc.RpcError) as refused:
        peer_pb2_grpc.PeerStub(channel).ListItems(pb.ListItemsRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value.details()
    assert "not a node's" in (refused.value.details() or "")


def test_the_shared_certificate_does_not_start_a_daemon_under_the_overlays_flags(
    tmp_path: Path,
) -> None:
    ca = cert_manager_ca()
    line = _one_line_exit_2(_start(tmp_path, *_flags(tmp_path / "tls", ca, certs.issue(ca))))
    assert "names no node" in line
    assert "--tls-shared-certificate" in line  # the remedy for a cluster still migrating


# --- what a pod's name costs: a replaced pod is a new identity (docs/deploy.md) ------------


def test_a_replaced_pod_holds_its_rank_again_only_after_the_job_restarts(cluster: Cluster) -> None:
    """Rank 1's pod is replaced while the job runs (a DaemonSet rollout): its daemon comes
    back on the same RAM disk under a new pod name, as csi-driver names it. Its reports and
    pushes are refused and nothing newer is committed; the job's restart frees the rank,
    and the job restores the newest step rank 1's bound node produced (its step 10 was
    produced by a node that did not hold the rank: never restored, SECURITY.md "Attested
    manifests"), then commits again."""
    cluster.keys["backup_interval_steps"] = 5
    cluster.fresh_start()
    before = cluster.save(5)
    cluster.wait_backup(5)

    assert cluster.ca is not None
    cluster.daemon(1).stop()
    cluster.tls[1] = node_tls(cluster.root / "tls" / "replaced", cluster.ca, node=OTHER_POD)
    cluster.start(1)
    files = cluster.write_step(10)
    cluster.wait_saved(10, copies=False)  # each rank's own step 10 is on its RAM disk
    refused = f"rank 1 is held by node 'node1', not '{OTHER_POD}'"
    wait_until(
        lambda: refused in cluster.daemon(0).log(),
        "rank 0's coordinator refuses the replaced pod's reports as rank 1",
        daemon=cluster.daemon(0),
    )
    assert 10 not in cluster.committed_backups()
    assert 5 in cluster.committed_backups()

    cluster.handshake([1, 2, 3, 0])  # the job restarts: rank 0's new incarnation
    cluster.wait_markers(5)
    assert_restored(cluster, 5, before)
    assert f"produced by node '{OTHER_POD}', which never held rank 1" in cluster.errors(1)
    assert files[1] != before[1]
    cluster.save(15)
    cluster.wait_backup(15)
