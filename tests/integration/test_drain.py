"""SIGTERM (a node drain, an upgrade): the newest step reaches the backup and the peers
before the daemon exits, within ``--drain-seconds``; past it the daemon exits anyway."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.integration.cluster import NODES, Cluster
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    backup_commits,
    config_text,
    make_step,
    payload,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("ingested", [True, False], ids=["ingested", "just-renamed"])
def test_sigterm_right_after_a_save_commits_that_step_in_the_backup(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon, ingested: bool
) -> None:
    daemon = start_daemon(backup=backup_dir)
    # Backups every hour: only the first step is ordered; the newest is the drain's to keep.
    write_yaml_atomic(ckpt, config_text(job, backup_interval_minutes=60))
    wait_markers(ckpt, job, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10))
    wait_until(lambda: 10 in backup_commits(backup_dir, job), "step 10's COMMIT", daemon=daemon)
    make_step(ckpt, 20, payload(20, size=8 << 20))
    if ingested:
        wait_ingested(ckpt, job, 20, daemon)
    # else: SIGTERM while the daemon may still be taking or hashing the step
    assert 20 not in backup_commits(backup_dir, job)

    t0 = time.monotonic()
    assert daemon.stop(timeout=30) == 0
    assert time.monotonic() - t0 < 25
    # Before the process exited, the newest step was committed in the bucket.
    assert 20 in backup_commits(backup_dir, job), daemon.log()[-4000:]
    assert "drain: backup of step 20 committed" in daemon.log()
    assert "ingest failed" not in daemon.log()


def test_a_drain_past_its_deadline_still_exits_in_time(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    # 1 MiB/s for uploads: a 24 MiB step needs 24 s, the drain has 1.
    daemon = start_daemon(
        backup=backup_dir, extra=("--max-transfer-rate", "1MiB", "--drain-seconds", "1")
    )
    write_yaml_atomic(ckpt, config_text(job, backup_interval_minutes=60))
    wait_markers(ckpt, job, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10, size=1024))
    wait_until(lambda: 10 in backup_commits(backup_dir, job), "step 10's COMMIT", daemon=daemon)
    make_step(ckpt, 20, payload(20, size=24 << 20))
    wait_ingested(ckpt, job, 20, daemon)

    t0 = time.monotonic()
    assert daemon.stop(timeout=30) == 0
    took = time.monotonic() - t0
    # The drain's second, the gRPC server's 5 s grace at most, and the exit itself.
    assert took < 10, f"stopped after {took:.1f}s"
    assert "stopped at its deadline (--drain-seconds 1)" in daemon.log()
    assert 20 not in backup_commits(backup_dir, job)


def test_sigterm_in_a_cluster_pushes_the_newest_step_to_the_peer_first(
    cluster: Cluster,
) -> None:
    cluster.fresh_start()
    cluster.save(5)
    rank = next(r for r in range(1, NODES) if cluster.holder(r, 5) != 0)
    target = cluster.holder(rank, 5)
    # The target answers nothing while the step is saved: no push can land before SIGTERM.
    cluster.pause(target)
    try:
        make_step(cluster.dirs[rank], 10, payload(10, seed=f"rank{rank}"))
        wait_until(
            lambda: (10, f"{rank}-0") in cluster.held(rank),
            f"rank {rank} committed step 10",
            daemon=cluster.daemon(rank),
        )
        assert (10, f"{rank}-0") not in cluster.held(target)
        daemon = cluster.daemon(rank)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the drain waits on the stalled peer meanwhile
    finally:
        cluster.resume(target)
    assert daemon.proc.wait(timeout=30) == 0
    # The peer held the step before the process exited.
    assert (10, f"{rank}-0") in cluster.held(target), daemon.log()[-4000:]
    assert "drain: step 10 reached the peers" in daemon.log()


def test_when_every_node_drains_the_last_uploader_commits_the_newest_step(
    cluster: Cluster,
) -> None:
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)  # the first step is backed up at once; the next in 100 steps
    cluster.save(10)
    assert 10 not in cluster.committed_backups()
    cluster.stop_all()  # one after another, as a drain of every node would
    # Each rank uploaded its own items of step 10; the last one's COMMIT found them all.
    assert 10 in cluster.committed_backups()
    logs = [cluster.daemon(r).log() for r in range(NODES)]
    assert sum("drain: backup of step 10 committed" in log for log in logs) == 1
