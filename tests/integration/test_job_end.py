"""A job that ends on a node, by a switch (another job's handshake), by an empty
``replicator.yaml`` or by the client's ``finish_job``: its newest step is drained like on
SIGTERM before its items become another job's neighbours; ``mtc upload`` uploads a kept
job's newest step on demand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtc_replicator import client
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    backup_commits,
    config_text,
    make_step,
    payload,
    read_text,
    stored_steps,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import NodeTls

pytestmark = pytest.mark.integration


def mtc(*args: str, tls: NodeTls | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTC_")}
    files = tls.files if tls is not None else None
    flags = (
        ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))
        if files is not None
        else ()
    )
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", *args, *flags],
        capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip


def run_x(ckpt: Path, backup: Path, daemon: DaemonProcess, x: str) -> None:
    """Job X saves steps 10 and 20 with a backup every hour: only the first is backed up."""
    write_yaml_atomic(ckpt, config_text(x, backup_interval_minutes=60))
    wait_markers(ckpt, x, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10))
    wait_until(lambda: 10 in backup_commits(backup, x), "X's step 10 COMMIT", daemon=daemon)
    make_step(ckpt, 20, payload(20, size=1 << 20))
    wait_ingested(ckpt, x, 20, daemon)
    assert 20 not in backup_commits(backup, x)


def test_a_job_switch_uploads_the_outgoing_jobs_newest_step(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    x, y = f"{job}-x", f"{job}-y"
    daemon = start_daemon(backup=backup_dir)
    run_x(ckpt, backup_dir, daemon, x)

    write_yaml_atomic(ckpt, config_text(y, backup_interval_minutes=60))
    wait_markers(ckpt, y, 0, daemon=daemon)
    # Before Y's markers appeared, X's newest step was committed in the backup.
    assert 20 in backup_commits(backup_dir, x), daemon.log()[-4000:]
    log = daemon.log()
    assert f"draining job {x} before it stops here (job {y}'s handshake)" in log
    assert "drain: backup of step 20 committed" in log
    # X's items stay (a fast restore if it comes back), now backed up: no warning.
    assert 20 in stored_steps(ckpt, x)
    out = mtc("status", "--address", daemon.address, "--json")
    assert out.returncode == 0, out.stderr
    (status,) = [j for j in json.loads(out.stdout)["jobs"] if j["job"] == x]
    assert (status["active"], status["kept_without_backup"]) == (False, False)


def test_an_empty_handshake_drains_the_job_and_leaves_it_droppable(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir)
    run_x(ckpt, backup_dir, daemon, job)

    write_yaml_atomic(ckpt, "")
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the empty yaml consumed", daemon=daemon)
    assert 20 in backup_commits(backup_dir, job), daemon.log()[-4000:]
    assert "(an empty replicator.yaml)" in daemon.log()
    assert read_text(ckpt / ERRORS) == ""  # nothing went wrong: nothing to tell the job
    # No longer running: kept until dropped, and droppable without --even-if-only-copy.
    dropped = mtc("drop", "--address", daemon.address, "--job", job)
    assert dropped.returncode == 0, dropped.stderr
    assert stored_steps(ckpt, job) == set()


def test_finish_job_returns_once_the_daemon_drained_the_job(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir)
    run_x(ckpt, backup_dir, daemon, job)
    client.finish_job(ckpt, timeout=60)
    # Returned after the drain: the newest step is in the backup, the yaml is gone.
    assert 20 in backup_commits(backup_dir, job), daemon.log()[-4000:]
    assert not (ckpt / CONFIG).exists()
    out = mtc("status", "--address", daemon.address, "--json")
    (status,) = [j for j in json.loads(out.stdout)["jobs"] if j["job"] == job]
    assert (status["active"], status["committed_backup_step"]) == (False, 20)


def test_finish_job_says_when_the_drain_could_not_upload_the_newest_step(
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
    lines = client.finish_job(ckpt, timeout=60)
    # The drain's second, and the stop: the upload past the deadline ends at its next slice.
    assert time.monotonic() - t0 < 8, daemon.log()[-3000:]
    assert "drain of job" in daemon.log()
    assert "stopped at its deadline (--drain-seconds 1)" in daemon.log()
    (line,) = lines
    assert f"job {job} stopped on this node and its newest step may not be in the backup" in line
    assert f"`mtc upload --job {job}` on this node uploads it" in line
    assert 20 not in backup_commits(backup_dir, job)
    assert 20 in stored_steps(ckpt, job)  # kept: it may be the only copy


def test_mtc_upload_uploads_a_kept_jobs_newest_step_on_demand(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    x, y = f"{job}-x", f"{job}-y"
    # No drain: X's newest step is left behind, as by a drain past its deadline.
    daemon = start_daemon(backup=backup_dir, extra=("--drain-seconds", "0"))
    run_x(ckpt, backup_dir, daemon, x)
    write_yaml_atomic(ckpt, config_text(y, backup_interval_minutes=60))
    wait_markers(ckpt, y, 0, daemon=daemon)
    make_step(ckpt, 1, payload(1))  # its ingest looks at the kept jobs: the warning
    wait_until(lambda: f"job {x} does not run here" in daemon.log(), "the warning", daemon=daemon)
    assert f"`mtc upload --job {x}` uploads it to the backup" in daemon.log()
    assert 20 not in backup_commits(backup_dir, x)
    refused = mtc("drop", "--address", daemon.address, "--job", x)
    assert refused.returncode == 1
    assert f"`mtc upload --job {x}` uploads that step to the backup first" in refused.stderr
    table = mtc("status", "--address", daemon.address).stdout
    assert f"(mtc upload --job {x} uploads it; mtc drop --job {x} --even-if-only-copy" in table

    # The layout it needs is kept in the store: a daemon restart does not lose it.
    assert daemon.stop(timeout=30) == 0
    daemon.start()
    for other, why in ((y, f"job {y} runs on this node now"), ("nope", "holds no items")):
        out = mtc("upload", "--address", daemon.address, "--job", other)
        assert (out.returncode, why in out.stderr) == (1, True), out.stderr
    out = mtc("upload", "--address", daemon.address, "--job", x, "--json")
    assert out.returncode == 0, out.stderr + daemon.log()[-3000:]
    body = json.loads(out.stdout)
    assert (body["step"], body["uploaded"], body["committed"]) == (20, ["0-0"], True)
    assert body["backup"] == backup_dir.as_uri()
    assert 20 in backup_commits(backup_dir, x)
    again = mtc("upload", "--address", daemon.address, "--job", x)
    assert again.returncode == 0, again.stderr
    assert f"job {x} step 20 is committed in {backup_dir.as_uri()} already" in again.stdout
    status = json.loads(mtc("status", "--address", daemon.address, "--json").stdout)
    (kept,) = [j for j in status["jobs"] if j["job"] == x]
    assert (kept["committed_backup_step"], kept["kept_without_backup"]) == (20, False)
    dropped = mtc("drop", "--address", daemon.address, "--job", x)
    assert dropped.returncode == 0, dropped.stderr


def end_job(cluster: Cluster, rank: int) -> None:
    write_yaml_atomic(cluster.dirs[rank], "")
    wait_until(
        lambda: not (cluster.dirs[rank] / CONFIG).exists(),
        f"rank {rank}'s empty yaml consumed",
        daemon=cluster.daemon(rank),
        timeout=60,
    )


def test_a_job_that_ends_on_every_node_is_committed_by_the_last_drain(
    cluster: Cluster,
) -> None:
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)  # the first step is backed up at once; the next in 100 steps
    cluster.save(10)
    for r in range(NODES):
        end_job(cluster, r)
        # Each rank uploads its items of step 10; the COMMIT needs every rank's.
        assert (10 in cluster.committed_backups()) == (r == NODES - 1)
    logs = [cluster.daemon(r).log() for r in range(NODES)]
    assert ["drain: backup of step 10 committed" in log for log in logs] == [
        False,
        False,
        False,
        True,
    ]
    assert all("drain: step 10 uploaded; not committed" in log for log in logs[:-1])


@pytest.mark.parametrize("cluster_extra", [("--drain-seconds", "0")])
def test_mtc_upload_of_a_cluster_job_commits_once_the_nodes_gave_every_rank(
    cluster: Cluster,
) -> None:
    cluster.fresh_start()
    cluster.save(5)
    cluster.wait_backup(5)
    cluster.save(10)
    for r in range(NODES):
        end_job(cluster, r)  # no drain: step 10 stays on the nodes alone
    assert 10 not in cluster.committed_backups()
    covered: set[int] = set()
    for r in range(NODES):
        # Each node uploads what it holds of step 10: its own rank's and its peer copies.
        held = {int(key.split("-")[0]) for step, key in cluster.held(r) if step == 10}
        covered |= held
        address = cluster.daemon(r).address
        out = mtc(
            "upload", "--address", address, "--job", cluster.job, "--json", tls=cluster.tls[r]
        )
        body = json.loads(out.stdout)
        assert sorted(body["uploaded"]) == sorted(f"{h}-0" for h in held)
        if covered == set(range(NODES)):
            assert (out.returncode, body["committed"]) == (0, True), out.stderr
            break
        assert (out.returncode, body["committed"]) == (1, False)
        assert body["missing_ranks"] == sorted(set(range(NODES)) - covered)
        text = mtc("upload", "--address", address, "--job", cluster.job, tls=cluster.tls[r])
        assert "NOT committed: the backup lacks the items of ranks" in text.stdout
    assert 10 in cluster.committed_backups()
