"""The store does not outlive a node handoff: against a real daemon, with ``owner.json``
written by the CSI plugin's own publish (``NodeVolumes`` over ``MemoryMounter``: the same
decision, emptying and record as on a node, without root).

A's pod saves a step; the node passes to B (A's volume unpublished, B's published: the
plugin empties CHECKPOINT_DIR and rewrites ``owner.json``); B's pod writes the handshake
A's pod wrote, naming A's job. Before the rule, the daemon restored A's step from the store
beside CHECKPOINT_DIR and linked B's marker to A's bytes, and its Peer server kept listing
and serving A's items to any certificate holder.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.csi.checkpoint import CheckpointDir
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import NodeVolumes
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    FAST_ARGS,
    config_text,
    expected_markers,
    make_step,
    marker_names,
    payload,
    read_tree,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration

A = PodInfo("team-a", "trainer-0", "0f5e3a9c-1d2b-4c3d-9e8f-7a6b5c4d3e2f", "trainer")
B = PodInfo("team-b", "miner-0", "7c1d2e3f-4a5b-4c6d-8e9f-0a1b2c3d4e5f", "miner")
STEP = 4


@dataclass
class Node:
    """One node: its RAM disk as the CSI plugin lays it out, the plugin's volumes, the
    daemon's certificate, and a certificate of the same CA for another node."""

    ram: Path
    volumes: NodeVolumes
    tls: NodeTls
    other: NodeTls
    targets: Path

    @property
    def ckpt(self) -> Path:
        return self.ram / "checkpoint"

    @property
    def owner_file(self) -> Path:
        return self.ram / "owner.json"

    def publish(self, pod: PodInfo) -> None:
        target = self.targets / pod.pod_uid
        assert self.volumes.publish(Publish("v", target, readonly=False, pod=pod))

    def unpublish(self, pod: PodInfo) -> None:
        self.volumes.unpublish(Unpublish("v", self.targets / pod.pod_uid))

    def daemon(self) -> DaemonProcess:
        return DaemonProcess(
            self.ckpt,
            extra_args=(*FAST_ARGS, *self.tls.args()),
            env={"MTC_OWNER_FILE": str(self.owner_file)},
            log_path=self.ram.parent / "daemon.log",
        )


@pytest.fixture
def node(tmp_path: Path) -> Node:
    mounter = MemoryMounter()
    ram = tmp_path / "ram"
    ensure_ram_disk(mounter, ram, 2**30)
    CheckpointDir(ram).prepare()
    (tmp_path / "targets").mkdir()
    ca = certs.new_ca()
    return Node(
        ram,
        NodeVolumes(mounter, ram, clock=time.time),
        node_tls(tmp_path / "tls" / "node", ca),
        node_tls(tmp_path / "tls" / "other", ca),
        tmp_path / "targets",
    )


def a_saves(node: Node, daemon: DaemonProcess, job: str) -> dict[str, bytes]:
    """A's pod: the handshake (a fresh start), then step STEP, committed in the store."""
    node.publish(A)
    write_yaml_atomic(node.ckpt, config_text(job))
    wait_markers(node.ckpt, job, 0, daemon)
    files = payload(STEP, seed="team-a's secret")
    make_step(node.ckpt, STEP, files)
    wait_ingested(node.ckpt, job, STEP, daemon)
    return files


def hand_over(node: Node) -> None:
    """A's pod goes, B's comes: what kubelet and the CSI plugin do."""
    node.unpublish(A)
    node.publish(B)
    assert os.listdir(node.ckpt) == [], "the plugin empties CHECKPOINT_DIR"


def a_items(node: Node, job: str) -> list[Path]:
    items = store_root(node.ckpt) / "items" / job
    return sorted(items.rglob("MANIFEST.json")) if items.is_dir() else []


def assert_nothing_of_a(
    node: Node, job: str, daemon: DaemonProcess, files: dict[str, bytes]
) -> None:
    """B's handshake is judged: a fresh start, no marker at A's bytes, A's items gone."""
    wait_until(lambda: marker_names(node.ckpt), "B's handshake judged", daemon=daemon)
    got = marker_names(node.ckpt)
    assert got == expected_markers(job, 0), f"B's pod was given a restore of A's: {got}"
    for name in os.listdir(node.ckpt):
        path = node.ckpt / name
        if path.is_symlink() or path.is_dir():
            assert read_tree(path) != files, f"{name} points at A's bytes"
    (marker,) = (node.ckpt / n for n in expected_markers(job, 0))
    assert not marker.is_symlink(), "B's pod got a restore, not a fresh start"
    assert marker.is_file()
    assert a_items(node, job) == [], "A's items stayed in the store beside B's CHECKPOINT_DIR"


def test_bs_handshake_naming_as_job_restores_nothing_of_as(node: Node, job: str) -> None:
    """The handshake comes at once after the publish (B's pod starts fast): the daemon
    reads it only after the handoff emptied the store."""
    with node.daemon() as daemon:
        files = a_saves(node, daemon, job)
        hand_over(node)
        write_yaml_atomic(node.ckpt, config_text(job))
        assert_nothing_of_a(node, job, daemon, files)
        assert "this node changed hands" in daemon.log()


def test_a_node_handed_over_while_its_daemon_was_down(node: Node, job: str) -> None:
    """The daemon restarts after the handoff, with A's incarnation saved and B's handshake
    waiting: nothing of A's is resumed or restored."""
    daemon = node.daemon()
    with daemon:
        files = a_saves(node, daemon, job)
    hand_over(node)
    write_yaml_atomic(node.ckpt, config_text(job))
    with node.daemon() as daemon:
        assert_nothing_of_a(node, job, daemon, files)


def listed_and_pulled(address: str, other: NodeTls, job: str) -> tuple[str, str]:
    """What another node's certificate gets from this node's Peer server for A's job: how
    many items ListItems gives (or its status), and what a pull of A's step says
    (``pulled``: the item's header came)."""
    files = other.files
    creds = grpc.ssl_channel_credentials(
        files.ca.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )
    options = [("grpc.ssl_target_name_override", certs.DEFAULT_SERVER_NAME)]
    with grpc.secure_channel(address, creds, options=options) as channel:
        stub = peer_pb2_grpc.PeerStub(channel)
        try:
            listed = f"{len(stub.ListItems(pb.ListItemsRequest(job=job), timeout=10).items)} items"
        except grpc.RpcError as exc:
            listed = exc.code().name  # type: ignore[attr-defined]
        ref = pb.ItemRef(job=job, step=STEP, rank=0, worker=0)
        try:
            next(iter(stub.PullItem(pb.PullItemRequest(item=ref), timeout=10)))
        except grpc.RpcError as exc:
            return listed, exc.code().name  # type: ignore[attr-defined]
        return listed, "pulled"


def test_the_peer_server_lists_and_serves_nothing_of_the_previous_owners(
    node: Node, job: str
) -> None:
    """No handshake of B's at all: from the moment ``owner.json`` names B, the node's Peer
    server lists nothing of A's job and serves no pull of it, to any certificate holder;
    once the daemon saw the handoff, A's items are gone and nothing is left to refuse."""
    with node.daemon() as daemon:
        a_saves(node, daemon, job)
        wait_until(  # the index learns of an item just after its manifest lands
            lambda: listed_and_pulled(daemon.address, node.other, job) == ("1 items", "pulled"),
            "A's item listed and served before the handoff",
            daemon=daemon,
        )
        hand_over(node)
        listed, pulled = listed_and_pulled(daemon.address, node.other, job)
        assert pulled != "pulled", "A's item was served after the handoff"
        assert listed != "1 items", "A's item was listed after the handoff"
        wait_until(
            lambda: listed_and_pulled(daemon.address, node.other, job) == ("0 items", "NOT_FOUND"),
            "the handoff done: nothing left to list or pull",
            daemon=daemon,
        )
        assert a_items(node, job) == []
