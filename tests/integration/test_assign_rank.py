"""``Node/AssignRank`` against a real daemon with TLS, the CSI plugin's volume logic and
``owner.json`` on real files, and ``python -m mtc_replicator.client.rank`` as a process
(issue 35, sticky ranks; docs/protocol.md, "Assigned ranks").

Only mtc-controller's certificate may hand a pod its rank: a node's (which could send
another node's pod to its own bytes) and one that names nothing are refused before anything
is written; an assignment for a pod that is no longer the node's is refused; and the next
pod never starts from the previous pod's files.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from mtc_replicator._pb.mtc.v1 import node_pb2, node_pb2_grpc, peer_pb2, peer_pb2_grpc
from mtc_replicator.csi.checkpoint import CheckpointDir
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import NodeVolumes
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import FAST_ARGS
from tests.integration.test_metrics import sample, scrape_daemon
from tests.tls import hand_made_node, node_tls

pytestmark = pytest.mark.integration

JAX, RANK = "jax-init-info.txt", "mtc-rank.json"
UID_A = "aaaaaaaa-0000-4000-8000-00000000000a"
UID_B = "bbbbbbbb-0000-4000-8000-00000000000b"
POD_A = PodInfo("team-a", "train-0", UID_A, "sa")
POD_B = PodInfo("team-a", "train-0", UID_B, "sa")  # the job restarted: a new pod


@dataclass
class Node:
    ca: certs.Pair
    root: Path
    ram: Path
    volumes: NodeVolumes
    daemon: DaemonProcess

    @property
    def ckpt(self) -> Path:
        return self.ram / "checkpoint"

    def publish(self, pod: PodInfo) -> None:
        assert self.volumes.publish(Publish("v", self.root / pod.pod_uid, False, pod))

    def unpublish(self, pod: PodInfo) -> None:
        self.volumes.unpublish(Unpublish("v", self.root / pod.pod_uid))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("assign")
    mounter = MemoryMounter()
    ram = root / "ram"
    ensure_ram_disk(mounter, ram, 2**30)
    CheckpointDir(ram).prepare()
    volumes = NodeVolumes(mounter, ram, clock=time.time)
    volumes.publish(Publish("v", root / POD_A.pod_uid, False, POD_A))
    ca = certs.new_ca()
    tls = node_tls(root / "tls", ca, node="node-a")
    daemon = DaemonProcess(
        ram / "checkpoint",
        extra_args=(*FAST_ARGS, *tls.args(), "--metrics", "127.0.0.1:0"),
        env={"MTC_OWNER_FILE": str(ram / "owner.json")},
        log_path=root / "daemon.log",
    )
    with daemon:
        yield Node(ca, root, ram, volumes, daemon)


def _pair(node: Node, kind: str) -> certs.Pair:
    if kind == "controller":
        return certs.issue_controller(node.ca)
    if kind == "node":
        return certs.issue(node.ca, node="node-b")
    if kind == "no identity":
        return hand_made_node(node.ca, node=None, usages=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    raise AssertionError(kind)


def assign(node: Node, kind: str = "controller", **fields: object) -> node_pb2.AssignRankResponse:
    request = {
        "job": "train",
        "pod_uid": POD_A.pod_uid,
        "rank": 3,
        "nodes": 4,
        "coordinator": "10.0.0.5:8476",
        "assignment": "a-1",
        "source": "holdings",
        **fields,
    }
    pair = _pair(node, kind)
    creds = grpc.ssl_channel_credentials(node.ca.cert, pair.key, pair.cert)
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    with grpc.secure_channel(node.daemon.address, creds, options=options) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        reply: node_pb2.AssignRankResponse = stub.AssignRank(
            node_pb2.AssignRankRequest(**request), timeout=10
        )
        return reply


def refused(node: Node, code: grpc.StatusCode, kind: str = "controller", **fields: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        assign(node, kind, **fields)
    assert info.value.code() == code, info.value.details()
    return info.value.details() or ""


def rank_cli(ckpt: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("POD_UID", "JOB_COMPLETION_INDEX")}
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.client.rank", "--checkpoint-dir", str(ckpt), *args],
        env={**environ, **env},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("kind", ["node", "no identity"])
def test_only_the_controllers_certificate_may_assign(node: Node, kind: str) -> None:
    before = scrape_daemon(node.daemon)
    details = refused(node, grpc.StatusCode.PERMISSION_DENIED, kind)
    assert "controller" in details
    assert not (node.ckpt / JAX).exists()
    assert not (node.ckpt / RANK).exists()
    after = scrape_daemon(node.daemon)
    counted = "mtc_identity_refusals_total"
    assert sample(after, counted, where="assign") == (
        (sample(before, counted, where="assign") or 0) + 1
    )
    assert "its certificate is not the controller's" in node.daemon.log()


def test_the_controllers_certificate_reads_status_and_nothing_else(node: Node) -> None:
    """It asks each node what it holds (``Node/Status``); it is no node for the rest."""
    pair = _pair(node, "controller")
    creds = grpc.ssl_channel_credentials(node.ca.cert, pair.key, pair.cert)
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    with grpc.secure_channel(node.daemon.address, creds, options=options) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        assert stub.Status(node_pb2.NodeStatusRequest(), timeout=10).address
        for call in (
            lambda: stub.Drop(node_pb2.DropRequest(job="train"), timeout=10),
            lambda: peer_pb2_grpc.PeerStub(channel).ListItems(
                peer_pb2.ListItemsRequest(), timeout=10
            ),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "not a node's" in (info.value.details() or "")


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("job", "Bad Job!", "job name"),
        ("rank", 4, "rank 4"),
        ("nodes", 0, "nodes"),
        ("coordinator", "10.0.0.5", "HOST:PORT"),
        ("coordinator", "10.0.0.5:99999", "HOST:PORT"),
        ("coordinator", "evil host:1", "HOST:PORT"),
        ("assignment", "x" * 65, "assignment"),
        ("assignment", "a/b", "assignment"),
        ("source", "guess", "source"),
    ],
)
def test_bad_fields_are_refused(node: Node, field: str, value: object, says: str) -> None:
    details = refused(node, grpc.StatusCode.INVALID_ARGUMENT, **{field: value})
    assert says in details
    assert not (node.ckpt / RANK).exists()


def test_the_controller_assigns_then_the_next_pod_never_sees_it(node: Node) -> None:
    """In order: written (content, modes), idempotent, read by client.rank; then the node
    gets a new pod: the plugin removes both files and a stale call for the old pod is
    refused; the new pod's call is written."""
    reply = assign(node)
    assert list(reply.written) == [JAX, RANK]
    assert (node.ckpt / JAX).read_text() == "3\n10.0.0.5:8476\n"
    record = json.loads((node.ckpt / RANK).read_text())
    assert record == {
        "job": "train",
        "rank": 3,
        "nodes": 4,
        "coordinator": "10.0.0.5:8476",
        "pod_uid": UID_A,
        "assignment": "a-1",
        "source": "holdings",
    }
    for name in (JAX, RANK):
        st = (node.ckpt / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o644, name
        assert st.st_gid == (node.ckpt).stat().st_gid, name  # the directory's group

    inode = (node.ckpt / RANK).stat().st_ino
    assert list(assign(node).written) == [JAX, RANK]
    assert (node.ckpt / RANK).stat().st_ino == inode, "the same assignment rewrote the file"

    done = rank_cli(node.ckpt, "--timeout", "5", POD_UID=UID_A)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "export NODE_RANK=3 MASTER_ADDR=10.0.0.5 MASTER_PORT=8476 NNODES=4\n"
    shell = f'eval "$({sys.executable} -m mtc_replicator.client.rank --timeout 5)"; '
    shell += 'echo "$NODE_RANK $MASTER_ADDR $MASTER_PORT $NNODES"'
    evaluated = subprocess.run(
        ["bash", "-c", shell],
        env={**os.environ, "MTC_CHECKPOINT_DIR": str(node.ckpt)},
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert evaluated.stdout == "3 10.0.0.5 8476 4\n", evaluated.stderr

    node.unpublish(POD_A)
    node.publish(POD_B)
    assert not (node.ckpt / JAX).exists()
    assert not (node.ckpt / RANK).exists()
    details = refused(node, grpc.StatusCode.FAILED_PRECONDITION)
    assert f"the pod on this node is {UID_B}" in details
    assert f"not {UID_A}" in details
    assert not (node.ckpt / JAX).exists()

    assign(node, pod_uid=UID_B, rank=1, assignment="a-2")
    assert (node.ckpt / JAX).read_text() == "1\n10.0.0.5:8476\n"
    node.unpublish(POD_B)
    node.publish(POD_A)  # back to the first pod: cleanup for the other tests


def test_client_rank_falls_back_to_the_index_with_one_warning(tmp_path: Path) -> None:
    started = time.monotonic()
    done = rank_cli(tmp_path, "--timeout", "1", JOB_COMPLETION_INDEX="2")
    assert done.returncode == 0
    assert done.stdout == "export NODE_RANK=2\n"
    warning = done.stderr.strip().splitlines()
    assert len(warning) == 1
    assert "falling back to the pod's index 2" in warning[0]
    assert "no mtc-rank.json appeared" in warning[0]
    assert 1.0 <= time.monotonic() - started < 30


def test_client_rank_waits_past_a_record_for_another_pod(tmp_path: Path) -> None:
    (tmp_path / RANK).write_text(
        json.dumps(
            {
                "job": "train",
                "rank": 0,
                "nodes": 2,
                "coordinator": "h:1",
                "pod_uid": "uid-old",
                "assignment": "a",
                "source": "index",
            }
        )
    )
    done = rank_cli(tmp_path, "--timeout", "1", "--index", "1", POD_UID="uid-new")
    assert done.stdout == "export NODE_RANK=1\n"
    assert "names pod uid-old, not this pod (uid-new)" in done.stderr


def test_client_rank_without_an_index_to_fall_back_to_fails(tmp_path: Path) -> None:
    done = rank_cli(tmp_path, "--timeout", "0")
    assert done.returncode == 2
    assert done.stdout == ""
    assert "set $JOB_COMPLETION_INDEX or pass --index" in done.stderr
