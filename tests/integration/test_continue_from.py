"""PopulationBasedTraining's exploit through the tiers (issue 36): a job whose handshake
says ``continue-from-job: trial-b`` and ``continue-from-step: 6`` restores trial-b's step
6, under its own name, from the fastest tier that has it. Three real daemons (mutual TLS,
per-node certificates, a shared ``file://`` registry and backup):

- trial-b (one node, a job directory) saves steps 4 and 6 on node 0, backed up at each.
- The exploited trial's new job on node 0 takes step 6 from node 0's own RAM disk; on
  another node, from a node of the pool that holds it (node 0 or trial-b's pool holder);
  once those are lost, from the bucket. Every time the marker's bytes are trial-b's step 6,
  and the adopted item is attested by the node that took it, as this job's.
- A node of another namespace cannot continue from trial-b: the bucket's copy is refused
  ("belongs to owner"), ``replicator.failed`` says so, and nothing of trial-b's is adopted.
- A step nobody holds fails the same way, naming each tier tried.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.core.contract import FAILED_FILE
from mtc_replicator.core.manifest import Manifest
from mtc_replicator.local.store import MANIFEST_FILE
from tests.integration.cluster import Cluster, running
from tests.integration.helpers import (
    backup_commits,
    config_text,
    item_dir,
    make_step,
    payload,
    read_text,
    read_tree,
    stored_steps,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_job_owner import write_owner

pytestmark = pytest.mark.integration

DONOR = "trial-b"


def _dir(cluster: Cluster, node: int, job: str) -> Path:
    return cluster.dirs[node] / "jobs" / job


def _handshake(cluster: Cluster, node: int, job: str, **keys: object) -> Path:
    where = _dir(cluster, node, job)
    where.mkdir(parents=True, exist_ok=True)
    write_yaml_atomic(where, config_text(job, backup_interval_steps=1, **keys))
    return where


def _continue(cluster: Cluster, node: int, job: str, step: int = 6) -> Path:
    """``job`` starts on ``node`` as trial-b's step ``step`` continued: its marker."""
    where = _handshake(cluster, node, job, continue_from_job=DONOR, continue_from_step=step)
    marker = where / f"{job}-s{step}-n0-w0.restore"
    wait_until(
        lambda: os.path.lexists(marker) or (where / FAILED_FILE).exists(),
        f"{job}'s marker of step {step} on node {node}",
        daemon=cluster.daemon(node),
        timeout=60,
    )
    return marker


def _adopted(cluster: Cluster, node: int, job: str, step: int = 6) -> Manifest:
    raw = (item_dir(cluster.dirs[node], job, step) / MANIFEST_FILE).read_bytes()
    return Manifest.from_json(raw)


def test_an_exploit_continues_from_the_donors_step_from_the_fastest_tier(tmp_path: Path) -> None:
    with running(Cluster(tmp_path, DONOR, nodes=3)) as cluster:
        where = _handshake(cluster, 0, DONOR)
        wait_until(
            lambda: os.path.lexists(where / f"{DONOR}-s0-n0-w0.restore"),
            "trial-b started",
            daemon=cluster.daemon(0),
        )
        saved = {}
        for step in (4, 6):
            saved[step] = payload(step, seed=DONOR, size=32 * 1024)
            make_step(where, step, saved[step])
        wait_until(
            lambda: {4, 6} <= backup_commits(cluster.backup, DONOR),
            "trial-b's steps backed up",
            daemon=cluster.daemon(0),
        )

        for node, job, tier in ((0, "trial-a.x1", "this node"), (1, "trial-c.x1", "node node")):
            marker = _continue(cluster, node, job)
            assert read_tree(marker) == saved[6], read_text(marker.parent / FAILED_FILE)
            said = f"continues from trial-b/s6/n0-w0 (from {tier}"
            assert said in cluster.daemon(node).log()
            attestation = _adopted(cluster, node, job).attestation
            assert attestation is not None
            assert attestation.producer == f"node{node}"  # adopted as this node's own

        # Every RAM disk that held trial-b's step 6 is lost: the bucket still has it.
        lost = {0, 1} | {n for n in range(3) if 6 in stored_steps(cluster.dirs[n], DONOR)}
        for node in sorted(lost):
            cluster.daemon(node).kill()
            cluster.clear(node)
        for node in sorted(lost):
            cluster.start(node)
        marker = _continue(cluster, 0, "trial-d.x1")
        assert read_tree(marker) == saved[6], read_text(marker.parent / FAILED_FILE)
        assert "continues from trial-b/s6/n0-w0 (from the backup)" in cluster.daemon(0).log()

        missing = _continue(cluster, 0, "trial-e.x1", step=99)
        failed = read_text(missing.parent / FAILED_FILE)
        assert "cannot continue from job trial-b's step 99" in failed, failed
        assert "the backup: no COMMIT of step 99" in failed, failed


def test_another_namespace_cannot_continue_from_a_trial(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, DONOR, nodes=2)
    owner = tmp_path / "owner-b.json"
    write_owner(owner, "team-b")
    cluster.node_env[1] = {"MTC_OWNER_FILE": str(owner)}
    with running(cluster) as cluster:
        where = _handshake(cluster, 0, DONOR)
        make_step(where, 6, payload(6, seed=DONOR))
        wait_until(
            lambda: 6 in backup_commits(cluster.backup, DONOR),
            "trial-b's step 6 backed up",
            daemon=cluster.daemon(0),
        )
        marker = _continue(cluster, 1, "thief.x1")
        failed = read_text(marker.parent / FAILED_FILE)
        assert "cannot continue from job trial-b's step 6" in failed, failed
        assert "belongs to owner ''" in failed, failed
        assert not os.path.lexists(marker)
        assert stored_steps(cluster.dirs[1], "thief.x1") == set()
