"""A job belongs to its namespace: takeovers and foreign joins against real daemons.

Each node's owner file stands in for the one the CSI plugin writes when it publishes the
RAM disk into a pod (``--owner-file``, given here as ``MTC_OWNER_FILE``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc
from mtc_replicator.cluster.coordinator_client import CHANNEL_OPTIONS
from mtc_replicator.cluster.registry import RegistryEntry, open_registry
from mtc_replicator.core.contract import FAILED_FILE
from mtc_replicator.transport.tls import open_channel
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import FAST, NODES, Cluster, assert_restored, running
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_text,
    read_tree,
    store_root,
    stored_steps,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration

VICTIM = "team-a"
THIEF = "team-b"


def write_owner(path: Path, namespace: str, pod: str = "trainer-0") -> None:
    """What the CSI plugin writes at NodePublishVolume (atomically)."""
    body = {
        "namespace": namespace,
        "pod": pod,
        "pod_uid": "0f5e3a9c-1d2b-4c3d-9e8f-7a6b5c4d3e2f",
        "service_account": "default",
        "published_at": time.time(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.rename(path)


def owned_cluster(root: Path, job: str) -> Cluster:
    """Four nodes whose pods are all of namespace VICTIM."""
    cluster = Cluster(root, job)
    for r in range(NODES):
        owner = root / "owners" / f"node{r}.json"
        write_owner(owner, VICTIM, pod=f"trainer-{r}")
        cluster.node_env[r] = {"MTC_OWNER_FILE": str(owner)}
    return cluster


def entry_of(cluster: Cluster) -> RegistryEntry | None:
    return open_registry(cluster.backup_url).lookup(cluster.job)


def snapshot(cluster: Cluster) -> dict[int, set[tuple[int, str]]]:
    return {r: cluster.held(r) for r in range(NODES)}


@pytest.fixture
def cluster(tmp_path: Path, job: str) -> Iterator[Cluster]:
    with running(owned_cluster(tmp_path, job)) as c:
        yield c


def test_another_namespace_cannot_take_over_a_jobs_coordinator(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A pod of namespace THIEF on a fifth node writes a ``replicator.yaml`` naming the
    victim's job with ``node-rank: 0``: its daemon refuses the handshake, registers
    nothing, and the victim's entry, items and next restore are its own."""
    job = cluster.job
    cluster.fresh_start()
    files = cluster.save(5)
    before = entry_of(cluster)
    assert before is not None
    assert before.owner == VICTIM
    held = snapshot(cluster)

    thief_dir = tmp_path / "thief"
    thief_dir.mkdir()
    owner = tmp_path / "owners" / "thief.json"
    write_owner(owner, THIEF, pod="miner-0")
    assert cluster.ca is not None
    thief = DaemonProcess(
        thief_dir,
        backup=cluster.backup_url,
        # A node of the stack like any other: its certificate is from the same CA.
        extra_args=(*FAST, *node_tls(tmp_path / "tls" / "thief", cluster.ca).args()),
        env={"MTC_OWNER_FILE": str(owner)},
        log_path=tmp_path / "thief.log",
    )
    with thief:
        write_yaml_atomic(thief_dir, config_text(job, rank=0, nodes=NODES, **cluster.keys))
        failed = thief_dir / FAILED_FILE
        wait_until(
            lambda: failed.exists() or entry_of(cluster) != before,
            "the thief's handshake judged",
            daemon=thief,
        )
        assert entry_of(cluster) == before, "the thief's daemon took over the registry entry"
        text = read_text(failed)
        assert f"job {job} is registered to another owner" in text
        assert VICTIM not in text  # the refusal does not name the victim's namespace
        assert not (store_root(thief_dir) / "items" / job).exists()

        # The victim's job restarts: rank 0 first, so a coordinator the thief might have
        # registered would be the one found. Every rank restores its own bytes.
        cluster.handshake([0, 3, 1, 2])
        cluster.wait_markers(5)
        assert_restored(cluster, 5, files)
        after = snapshot(cluster)
        for r in range(NODES):
            assert held[r] <= after[r], f"rank {r} lost committed items"
        assert not (store_root(thief_dir) / "items" / job).exists(), "the thief got an item"
        assert entry_of(cluster) is not None
        assert entry_of(cluster).owner == VICTIM  # type: ignore[union-attr]


def test_rank_0_moving_to_another_node_of_the_same_namespace_still_restores(
    cluster: Cluster,
) -> None:
    """The job restarts with ranks 0 and 1 swapped between nodes 0 and 1 (the scheduler
    moved rank 0): node 1 replaces the entry, same owner, and every rank restores."""
    job = cluster.job
    cluster.fresh_start()
    files = cluster.save(5)
    first = entry_of(cluster)
    assert first is not None
    assert first.address == cluster.daemon(0).advertise

    rank_of = {0: 1, 1: 0, 2: 2, 3: 3}  # node -> rank
    for node in (3, 0, 2, 1):
        text = config_text(job, rank=rank_of[node], nodes=NODES, **cluster.keys)
        write_yaml_atomic(cluster.dirs[node], text)
    for node, rank in rank_of.items():
        marker = cluster.dirs[node] / f"{job}-s5-n{rank}-w0.restore"
        wait_until(marker.is_symlink, f"node {node}'s marker", daemon=cluster.daemon(node))
        assert read_tree(marker) == files[rank], f"node {node} (rank {rank}) restored other bytes"
    moved = entry_of(cluster)
    assert moved is not None
    assert moved.address == cluster.daemon(1).advertise
    assert moved.owner == VICTIM
    assert moved.coordinator_id != first.coordinator_id


async def _foreign_join(address: str, tls_root: Path, job: str) -> grpc.aio.AioRpcError:
    """A Join as rank 3 of ``job`` from a node whose pod is of namespace THIEF."""
    channel = open_channel(address, CHANNEL_OPTIONS, NodeTls(tls_root).material())
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = pb.JoinRequest(
            job=job,
            rank=3,
            incarnation_id="0123456789abcdef",
            cluster_view='{"nodes": 4}',
            address="127.0.0.1:1",
            owner=THIEF,
        )
        try:
            await stub.Join(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc
        raise AssertionError("a join from another namespace was admitted")
    finally:
        await channel.close()


def test_a_join_from_another_namespace_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    """Node 3's pod is of namespace THIEF and names the victim's job as rank 3: the
    coordinator refuses its join (PERMISSION_DENIED, nothing about the job), its daemon
    says so in ``replicator.failed``, and the other ranks wait. Once a pod of the job's
    namespace holds node 3, the round completes."""
    job = cluster.job
    write_owner(tmp_path / "owners" / "node3.json", THIEF, pod="miner-0")
    cluster.handshake([0, 1, 2, 3])
    failed = cluster.dirs[3] / FAILED_FILE
    wait_until(
        lambda: failed.exists() or cluster.markers(3),
        "rank 3's join judged",
        daemon=cluster.daemon(3),
        timeout=60,
    )
    assert not cluster.markers(3), "a rank of another namespace joined the round"
    text = read_text(failed)
    assert "belongs to another owner" in text
    assert VICTIM not in text
    assert not any(cluster.markers(r) for r in range(NODES))

    # The same refusal, seen on the wire: the status and every word the caller gets.
    assert cluster.tls[3] is not None
    leader = cluster.daemon(0).address
    refusal = asyncio.run(_foreign_join(leader, cluster.tls[3].root, job))
    assert refusal.code() is grpc.StatusCode.PERMISSION_DENIED
    details = refusal.details() or ""
    assert details == f"join refused: job {job} belongs to another owner"

    # A pod of the job's own namespace takes node 3: the round completes.
    write_owner(tmp_path / "owners" / "node3.json", VICTIM, pod="trainer-3")
    failed.unlink()
    write_yaml_atomic(cluster.dirs[3], config_text(job, rank=3, nodes=NODES, **cluster.keys))
    cluster.wait_markers(0)


def test_a_missing_owner_file_refuses_the_handshake(tmp_path: Path, job: str) -> None:
    """``--owner-file`` is set but the CSI plugin wrote nothing (or garbage): the handshake
    is refused with a clear ``replicator.failed``; with the file in place it goes on."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    owner = tmp_path / "owner.json"
    daemon = DaemonProcess(ckpt, env={"MTC_OWNER_FILE": str(owner)}, extra_args=FAST)
    with daemon:
        write_yaml_atomic(ckpt, config_text(job))
        failed = ckpt / FAILED_FILE
        wait_until(failed.exists, "the refusal", daemon=daemon)
        assert "cannot tell which namespace this node's pod belongs to" in read_text(failed)
        assert str(owner) in read_text(failed)

        owner.write_text('{"namespace": "Team A"}')
        failed.unlink()
        write_yaml_atomic(ckpt, config_text(job))
        wait_until(failed.exists, "the second refusal", daemon=daemon)
        assert "malformed" in read_text(failed)

        write_owner(owner, VICTIM)
        failed.unlink()
        write_yaml_atomic(ckpt, config_text(job))
        marker = ckpt / f"{job}-s0-n0-w0.restore"
        wait_until(marker.exists, "the fresh start's marker", daemon=daemon)
        assert not failed.exists()


def test_a_new_namespace_on_the_node_ends_the_old_job_and_its_views(
    tmp_path: Path, job: str
) -> None:
    """The CSI plugin hands CHECKPOINT_DIR to another namespace's pod (and rewrites the owner
    file): the old job's incarnation stops and its markers, views and items go, so the new
    pod never reads the old job's checkpoint, even before its own handshake."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    owner = tmp_path / "owner.json"
    write_owner(owner, VICTIM)
    daemon = DaemonProcess(ckpt, env={"MTC_OWNER_FILE": str(owner)}, extra_args=FAST)
    with daemon:
        write_yaml_atomic(ckpt, config_text(job))
        wait_markers(ckpt, job, 0, daemon)
        make_step(ckpt, 1, payload(1))
        wait_ingested(ckpt, job, 1, daemon)
        write_yaml_atomic(ckpt, config_text(job))  # a restart of the same job: a view of step 1
        (marker,) = wait_markers(ckpt, job, 1, daemon)
        views = ckpt / ".mtc" / "views"
        assert any(views.rglob("*")), "the restore made no view"

        write_owner(owner, "team-b", pod="other-0")
        wait_until(
            lambda: not os.path.lexists(marker) and not any(views.rglob("*")),
            "the old job's markers and views removed",
            daemon=daemon,
        )
        # The node is the new namespace's now: the old job's items on it go too (its
        # copies elsewhere stay); test_node_handoff.py has the attacks this stops.
        wait_until(lambda: not stored_steps(ckpt, job), "the old job's items removed")
        assert "this node changed hands" in daemon.log()
