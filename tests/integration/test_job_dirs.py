"""Many jobs per node (issue 36): CHECKPOINT_DIR's root and ``jobs/<job>/`` job directories
served at once by the same daemons, against two real daemons (mutual TLS, a ``file://``
backup).

- Job ``root-job`` in CHECKPOINT_DIR's root (the one-job contract, unchanged) and job
  ``trial-b`` in ``jobs/trial-b/`` start, save and replicate side by side; node 1 then loses
  its RAM disk and both jobs restart: each restores its own newest step, node 1's from its
  peer, node 0's locally, the markers in the job directory linking to the views through
  ``../..`` as the pod sees the tree; ``mtc status`` names both as running.
- A job directory serves the job it is named after: a handshake naming another job is
  refused there, with the reason in that directory's ``replicator.failed``.
- A symlink ``jobs/<name>`` planted to a directory outside CHECKPOINT_DIR is never served:
  nothing is read or written there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import node_pb2, node_pb2_grpc
from mtc_replicator.core.contract import CONFIG_FILE, FAILED_FILE
from tests.integration.cluster import Cluster, running
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_prerestore,
    read_tree,
    store_root,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration

ROOT_JOB = "root-job"
TRIAL = "trial-b"
NODES = 2


def _dir(cluster: Cluster, rank: int, job: str) -> Path:
    """Where ``job``'s pod on node ``rank`` hands its files."""
    return cluster.dirs[rank] if job == ROOT_JOB else cluster.dirs[rank] / "jobs" / job


def _handshake(cluster: Cluster, job: str) -> None:
    for r in range(NODES):
        where = _dir(cluster, r, job)
        where.mkdir(parents=True, exist_ok=True)
        write_yaml_atomic(where, config_text(job, rank=r, nodes=NODES, **cluster.keys))


def _marker(cluster: Cluster, rank: int, job: str, step: int) -> Path:
    return _dir(cluster, rank, job) / f"{job}-s{step}-n{rank}-w0.restore"


def _wait_markers(cluster: Cluster, job: str, step: int) -> None:
    for r in range(NODES):
        wait_until(
            lambda r=r: os.path.lexists(_marker(cluster, r, job, step)),
            f"{job}'s marker of step {step} on node {r}",
            daemon=cluster.daemon(r),
            timeout=60,
        )


def _held(cluster: Cluster, node: int, job: str) -> set[tuple[int, str]]:
    root = store_root(cluster.dirs[node]) / "items" / job
    if not root.is_dir():
        return set()
    return {
        (int(step.name), item.name)
        for step in root.iterdir()
        for item in step.iterdir()
        if (item / "MANIFEST.json").exists()
    }


def _save(cluster: Cluster, job: str, step: int) -> dict[int, dict[str, bytes]]:
    """Every rank of ``job`` saves ``step``; waits until each is at home and at its peer."""
    files = {r: payload(step, seed=f"{job}/{r}") for r in range(NODES)}
    for r in range(NODES):
        make_step(_dir(cluster, r, job), step, files[r])
    for r in range(NODES):
        for node in range(NODES):
            wait_until(
                lambda r=r, node=node: (step, f"{r}-0") in _held(cluster, node, job),
                f"{job}'s rank {r} step {step} held on node {node}",
                daemon=cluster.daemon(node),
            )
    return files


def _running_jobs(cluster: Cluster, node: int) -> set[str]:
    tls = cluster.tls[node]
    assert tls is not None
    material = tls.material()
    with grpc.secure_channel(
        cluster.daemon(node).address,
        material.channel_credentials(),
        options=material.channel_options(),
    ) as channel:
        answer = node_pb2_grpc.NodeStub(channel).Status(node_pb2.NodeStatusRequest(), timeout=10)
    return {j.job for j in answer.jobs if j.active}


def test_two_jobs_side_by_side_save_replicate_and_restore(tmp_path: Path) -> None:
    with running(Cluster(tmp_path, ROOT_JOB, nodes=NODES)) as cluster:
        for job in (ROOT_JOB, TRIAL):
            _handshake(cluster, job)
        for job in (ROOT_JOB, TRIAL):
            _wait_markers(cluster, job, 0)
            for r in range(NODES):
                os.unlink(_marker(cluster, r, job, 0))
        assert _running_jobs(cluster, 0) == {ROOT_JOB, TRIAL}
        saved = {job: _save(cluster, job, 5) for job in (ROOT_JOB, TRIAL)}

        cluster.wipe(1)  # node 1 loses its RAM disk: both jobs' copies and its store
        for job in (ROOT_JOB, TRIAL):
            _handshake(cluster, job)
        for job in (ROOT_JOB, TRIAL):
            _wait_markers(cluster, job, 5)
            for r in range(NODES):
                marker = _marker(cluster, r, job, 5)
                if job == TRIAL:
                    assert os.readlink(marker).startswith("../../.mtc/views/")
                assert read_tree(marker) == saved[job][r], f"{job} rank {r} restored other bytes"
                prerestore = read_prerestore(_dir(cluster, r, job))
                assert prerestore["restore-step"] == 5
                assert prerestore["restore-source"] == ("peer" if r == 1 else "local")
        assert _running_jobs(cluster, 1) == {ROOT_JOB, TRIAL}


def test_a_job_directory_removed_and_made_again_serves_its_job_anew(tmp_path: Path) -> None:
    # A trial's directory removed while its job runs and made again for the same job: the
    # job in the removed directory ends as at a job's end (its newest step drained), and
    # the new directory is served; its handshake restores that step from each node's store.
    # Before, the daemon kept serving the removed directory, and the new one never.
    with running(Cluster(tmp_path, ROOT_JOB, nodes=NODES)) as cluster:
        _handshake(cluster, TRIAL)
        _wait_markers(cluster, TRIAL, 0)
        saved = _save(cluster, TRIAL, 5)
        for r in range(NODES):
            shutil.rmtree(_dir(cluster, r, TRIAL))
            _dir(cluster, r, TRIAL).mkdir()
        for r in range(NODES):
            wait_until(
                lambda r=r: f"its directory jobs/{TRIAL} was removed" in cluster.daemon(r).log(),
                f"node {r} to end the job of the removed directory",
                daemon=cluster.daemon(r),
            )
        _handshake(cluster, TRIAL)
        _wait_markers(cluster, TRIAL, 5)
        for r in range(NODES):
            assert read_tree(_marker(cluster, r, TRIAL, 5)) == saved[r]
            assert read_prerestore(_dir(cluster, r, TRIAL))["restore-source"] == "local"


def test_a_job_directory_serves_only_the_job_it_is_named_after(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / CONFIG_FILE).write_text(config_text("planted", nodes=1))
    with running(Cluster(tmp_path, ROOT_JOB, nodes=1)) as cluster:
        jobs = cluster.dirs[0] / "jobs"
        (jobs / "trial-c").mkdir(parents=True)
        write_yaml_atomic(jobs / "trial-c", config_text("trial-d", nodes=1))
        (jobs / "planted").symlink_to(outside)
        failed = jobs / "trial-c" / FAILED_FILE
        wait_until(failed.exists, "the misnamed handshake refused", daemon=cluster.daemon(0))
        assert "serves the job it is named after" in failed.read_text()
        # Meanwhile the planted link was seen at every scan: never followed.
        assert sorted(p.name for p in outside.iterdir()) == [CONFIG_FILE]
        assert "planted" not in _running_jobs_single(cluster)


def _running_jobs_single(cluster: Cluster) -> set[str]:
    return _running_jobs(cluster, 0)
