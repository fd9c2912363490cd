"""Several processes on one node (``torchrun --nproc-per-node=8`` with docs/deploy.md's
snippet) against a real daemon: one handshake per launch, every process the same restore;
the daemon's answers to a repeated handshake (served again during the restore, a restart
after it), to a conflicting
one (refused, not restarted) and to a second save of one step name (refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cluster import Cluster
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAILED,
    config_text,
    holds,
    item_dir,
    make_step,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    receiver_args,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_metrics import METRICS, sample, scrape_daemon

pytestmark = pytest.mark.integration

PROCS = 8
LAUNCHER_ENV = (
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MTC_LAUNCH_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "RAY_RAYLET_PID",
)


def launch(ckpt: Path, job: str, out: Path, *, timeout: float = 20.0) -> list[dict[str, Any]]:
    """One launch of ``PROCS`` processes on the node, as torchrun starts them; each one's
    handshake outcome, by local rank."""
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.integration.node_launcher",
            *("--dir", str(ckpt), "--job", job, "--procs", str(PROCS)),
            *("--out", str(out), "--timeout", str(timeout)),
        ],
        env=env,
        check=True,
        timeout=3 * timeout + 60,
    )
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(PROCS)]


def rounds(daemon: Any, job: str, outcome: str) -> float | None:
    return sample(scrape_daemon(daemon), "mtc_restore_rounds_total", mtc_job=job, outcome=outcome)


def incarnation_id(ckpt: Path) -> str:
    return str(json.loads((store_root(ckpt) / "incarnation.json").read_text())["id"])


def test_eight_processes_of_one_node_make_one_handshake_per_launch(
    ckpt: Path, tmp_path: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(extra=METRICS)

    first = launch(ckpt, job, tmp_path / "first")
    assert first == [
        {"step": None, "path": None, "source": None, "seconds": r["seconds"]} for r in first
    ], first
    assert rounds(daemon, job, "fresh") == 1, "one incarnation for the whole launch"

    # Local rank 0 saves step 10 (one <N>/ per node), then the job restarts.
    saved = payload(10, seed=job)
    make_step(ckpt, 10, saved)
    wait_ingested(ckpt, job, 10, daemon)
    second = launch(ckpt, job, tmp_path / "second")
    want = {"step": 10, "path": str(ckpt / "10"), "source": "local"}
    assert [{k: r.get(k) for k in ("step", "path", "source", "error")} for r in second] == [
        {**want, "error": None}
    ] * PROCS, second
    assert rounds(daemon, job, "restored") == 1
    assert rounds(daemon, job, "fresh") == 1
    assert read_tree(ckpt / "10") == saved
    assert not (ckpt / FAILED).exists()


def test_after_the_markers_the_same_yaml_is_a_restart(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """Once the markers are out, the same yaml again is the contract's restart, even before a
    save: it may be the restart an operator's restore pin waits for
    (test_bucket_permissions). A launcher whose processes each write the yaml after that is
    what our client's election prevents."""
    daemon = start_daemon(extra=METRICS)
    text = config_text(job, framework="pytorch.distributed", backup_interval_minutes=30)
    write_yaml_atomic(ckpt, text)
    (marker,) = wait_markers(ckpt, job, 0, daemon)
    marker.unlink()
    accepted = incarnation_id(ckpt)

    write_yaml_atomic(ckpt, text)
    wait_until(
        lambda: current_incarnation(ckpt) not in (None, accepted),
        "a new incarnation",
        daemon=daemon,
    )
    wait_markers(ckpt, job, 0, daemon)
    assert rounds(daemon, job, "fresh") == 2
    assert "the same replicator.yaml again" not in daemon.log()


def current_incarnation(ckpt: Path) -> str | None:
    try:
        return incarnation_id(ckpt)
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return None


def test_during_the_restore_round_the_same_yaml_is_kept_and_another_refused(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """Rank 0 of a two-node job waits in its round for rank 1: a second process's yaml
    must neither restart it (which would make every rank start over) nor replace it."""
    daemon = start_daemon(extra=receiver_args(ckpt))
    fields: dict[str, Any] = {"peers_per_node": 1, "backup_interval_minutes": 30}
    text = config_text(job, framework="pytorch.distributed", nodes=2, **fields)
    write_yaml_atomic(ckpt, text)
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the yaml accepted", daemon=daemon)
    accepted = wait_until(lambda: incarnation_id(ckpt), "the incarnation saved", daemon=daemon)

    write_yaml_atomic(ckpt, text)
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the same yaml consumed", daemon=daemon)
    assert incarnation_id(ckpt) == accepted

    other = {**fields, "backup_interval_minutes": 5}
    write_yaml_atomic(ckpt, config_text(job, framework="pytorch.distributed", nodes=2, **other))
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the other yaml consumed", daemon=daemon)
    errors = wait_until(lambda: read_text(ckpt / ERRORS), ERRORS, daemon=daemon)
    assert f"refused a second {CONFIG} for job {job} rank 0" in errors
    assert "backup-interval-minutes: 30 -> 5" in errors
    assert not (ckpt / FAILED).exists(), "replicator.failed would stop the first process too"
    assert incarnation_id(ckpt) == accepted
    assert "stopping incarnation" not in daemon.log()


def test_a_second_save_of_one_step_is_refused_and_a_later_incarnation_may_save_it(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()
    text = config_text(job, framework="pytorch.distributed", backup_interval_minutes=30)
    write_yaml_atomic(ckpt, text)
    (marker,) = wait_markers(ckpt, job, 0, daemon)
    marker.unlink()
    first = payload(10, seed=f"{job}/first")
    make_step(ckpt, 10, first)
    wait_ingested(ckpt, job, 10, daemon)

    make_step(ckpt, 10, payload(10, seed=f"{job}/second"))  # another process's step 10
    wait_until(lambda: not (ckpt / "10").exists(), "the second step 10 removed", daemon=daemon)
    errors = wait_until(lambda: read_text(ckpt / ERRORS), ERRORS, daemon=daemon)
    assert f"job={job} rank=0" in errors
    assert f"step 10 of job {job} rank 0 was saved again" in errors
    assert "the second save was refused" in errors
    assert read_tree(item_dir(ckpt, job, 10) / "data") == first

    # A later incarnation restored from step 10 re-trains and saves step 10 again: taken.
    write_yaml_atomic(ckpt, text)
    (marker,) = wait_markers(ckpt, job, 10, daemon)
    marker.unlink()
    again = payload(10, seed=f"{job}/again")
    make_step(ckpt, 10, again)
    wait_until(
        lambda: read_tree(item_dir(ckpt, job, 10) / "data") == again,
        "step 10 of the later incarnation committed",
        daemon=daemon,
    )
    assert "was saved again" not in read_text(ckpt / ERRORS)


def test_a_repeat_during_a_clusters_round_is_served_once_the_round_is_released(
    cluster: Cluster,
) -> None:
    """Rank 0's node gets its yaml twice (two processes) before the other ranks joined: one
    round, and both processes get the marker, one after the other."""
    rank0 = cluster.dirs[0]
    cluster.handshake([0])
    wait_until(lambda: not (rank0 / CONFIG).exists(), "rank 0's yaml accepted")
    accepted = incarnation_id(rank0)
    cluster.handshake([0])  # the node's second process
    wait_until(lambda: not (rank0 / CONFIG).exists(), "the same yaml consumed")

    cluster.handshake([1, 2, 3])
    cluster.wait_markers(0)
    (marker,) = (rank0 / name for name in cluster.markers(0))
    marker.unlink()  # the first process takes it
    wait_until(marker.exists, "the marker for the second process", daemon=cluster.daemon(0))
    marker.unlink()
    holds(lambda: not marker.exists(), "no third marker", 1.0, daemon=cluster.daemon(0))
    assert incarnation_id(rank0) == accepted
    assert read_prerestore(rank0) == {}
    assert not (rank0 / FAILED).exists()
