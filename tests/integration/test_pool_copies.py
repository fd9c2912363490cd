"""Pool copies (issue 36): a one-node job in a job directory (a Ray Tune trial of one
worker) has no peer ranks; its steps still go to another node of the pool, so a trial
restarted on any node restores its newest step from a RAM disk before the bucket.

Three real daemons (mutual TLS, per-node certificates, one ``file://`` registry and
backup whose interval no step reaches):

- The trial saves steps 5, 7 and 9 on node 0; each goes to the node that rendezvous
  hashing picks among nodes 1 and 2 (``core.pool``), which keeps the newest two.
- Node 0 is lost (daemon killed, RAM disk and store wiped). The trial restarts on the node
  that is *not* the holder: its step 9 comes from the holder's RAM disk, byte for byte;
  the bucket holds an older step only.
- The same trial on the holder itself restores step 9 locally.
- A push marked as a pool copy of a job that runs on the receiver is refused, and so is
  one attested by another node than the pusher.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.pool import holder_for
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.transport.peer_client import PeerClient, PeerError
from tests.integration.cluster import Cluster, running
from tests.integration.helpers import (
    backup_commits,
    config_text,
    make_step,
    payload,
    read_tree,
    stored_steps,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import node_tls

pytestmark = pytest.mark.integration

TRIAL = "trial-pool"
NODES = 3


def _dir(cluster: Cluster, node: int, job: str = TRIAL) -> Path:
    return cluster.dirs[node] / "jobs" / job


def _handshake(cluster: Cluster, node: int, job: str = TRIAL) -> None:
    where = _dir(cluster, node, job)
    where.mkdir(parents=True, exist_ok=True)
    write_yaml_atomic(where, config_text(job, backup_interval_steps=1000))


def _marker(cluster: Cluster, node: int, step: int) -> Path:
    return _dir(cluster, node) / f"{TRIAL}-s{step}-n0-w0.restore"


def _wait_marker(cluster: Cluster, node: int, step: int) -> Path:
    marker = _marker(cluster, node, step)
    wait_until(
        lambda: os.path.lexists(marker),
        f"{TRIAL}'s marker of step {step} on node {node}",
        daemon=cluster.daemon(node),
        timeout=60,
    )
    return marker


def _expected_holder() -> int:
    chosen = holder_for(TRIAL, "node0", [f"node{n}" for n in range(NODES)])
    assert chosen is not None
    return int(chosen.removeprefix("node"))


def test_a_one_node_trial_restores_on_another_node_from_its_pool_copy(tmp_path: Path) -> None:
    holder = _expected_holder()
    other = ({1, 2} - {holder}).pop()
    with running(Cluster(tmp_path, TRIAL, nodes=NODES)) as cluster:
        _handshake(cluster, 0)
        os.unlink(_wait_marker(cluster, 0, 0))
        saved = {}
        for step in (5, 7, 9):
            saved[step] = payload(step, seed=TRIAL, size=64 * 1024)
            make_step(_dir(cluster, 0), step, saved[step])
            wait_until(
                lambda step=step: step in stored_steps(cluster.dirs[holder], TRIAL),
                f"step {step}'s pool copy on node {holder}",
                daemon=cluster.daemon(holder),
            )
        # The holder keeps the newest two steps; the node the hash did not pick, none.
        wait_until(
            lambda: stored_steps(cluster.dirs[holder], TRIAL) == {7, 9},
            "step 5 dropped on the holder",
            daemon=cluster.daemon(holder),
        )
        assert stored_steps(cluster.dirs[other], TRIAL) == set()
        assert 9 not in backup_commits(cluster.backup, TRIAL)  # the first step only, or none

        cluster.daemon(0).kill()
        cluster.clear(0)  # node 0 is lost with its RAM disk
        _handshake(cluster, other)
        marker = _wait_marker(cluster, other, 9)
        assert read_tree(marker) == saved[9]
        log = cluster.daemon(other).log()
        assert re.search(rf"pool copies: step 9 pulled from node node{holder}\b", log), log

        _handshake(cluster, holder)  # the trial moves again, now to its holder
        marker = _wait_marker(cluster, holder, 9)
        assert read_tree(marker) == saved[9]
        assert "pulled from node" not in cluster.daemon(holder).log()


def test_a_pool_copy_is_refused_for_a_job_running_here_or_attested_by_another_node(
    tmp_path: Path,
) -> None:
    with running(Cluster(tmp_path, TRIAL, nodes=2)) as cluster:
        _handshake(cluster, 1)
        os.unlink(_wait_marker(cluster, 1, 0))
        data = tmp_path / "data"
        data.mkdir()
        (data / "state.bin").write_bytes(b"a step of rank 0" * 100)
        assert cluster.ca is not None
        mallory = node_tls(tmp_path / "mallory", cluster.ca, node="mallory")
        node0 = cluster.tls[0]
        assert node0 is not None

        async def push(job: str, signer_is_pusher: bool) -> str:
            manifest = build_manifest(ItemId(job, 3, 0, 0), data)
            manifest = (mallory if signer_is_pusher else node0).attest(manifest)
            async with PeerClient(timeout=10.0, tls=mallory.material()) as client:
                try:
                    await client.push_item(
                        cluster.daemon(1).address, manifest, data, pool_copy=True
                    )
                except PeerError as exc:
                    return str(exc)
            return "accepted"

        running_here = asyncio.run(push(TRIAL, signer_is_pusher=True))
        assert "runs on this node" in running_here, running_here
        forged = asyncio.run(push("another-trial", signer_is_pusher=False))
        assert "PERMISSION_DENIED" in forged, forged
        assert "which never held rank" in forged, forged
        assert stored_steps(cluster.dirs[1], "another-trial") == set()
        # The same push, attested by the pusher itself: kept as a pool copy.
        assert asyncio.run(push("another-trial", signer_is_pusher=True)) == "accepted"
        assert stored_steps(cluster.dirs[1], "another-trial") == {3}
