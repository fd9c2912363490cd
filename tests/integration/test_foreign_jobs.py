"""Two jobs in turn on one small RAM disk: the earlier job's items give way when it is in
the backup (room needed, the TTL, ``mtc drop``), and are kept and reported when not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    backup_commits,
    config_text,
    make_step,
    payload,
    stored_steps,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_metrics import sample, scrape_daemon

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root to mount a small tmpfs that can really fill up"
    ),
]

STEP = 12 << 20
"""A step's big array; with its sibling about 16 MiB: two fit on the 40 MiB disk, not three."""


def mtc(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTC_")}
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", *args],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


def run_a_then_b(ckpt: Path, daemon: DaemonProcess, a: str, b: str) -> None:
    """Job A saves step 10; then job B takes the node and saves step 1."""
    write_yaml_atomic(ckpt, config_text(a, backup_interval_steps=1))
    wait_markers(ckpt, a, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10, size=STEP))
    wait_ingested(ckpt, a, 10, daemon)
    write_yaml_atomic(ckpt, config_text(b, backup_interval_steps=1))
    wait_markers(ckpt, b, 0, daemon=daemon)
    make_step(ckpt, 1, payload(1, size=STEP))
    wait_ingested(ckpt, b, 1, daemon)


@pytest.mark.tmpfs_size("40m")
def test_a_backed_up_job_gives_way_to_the_next_jobs_saves(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    a, b = f"{job}-a", f"{job}-b"
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, config_text(a, backup_interval_steps=1))
    wait_markers(ckpt, a, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10, size=STEP))
    wait_until(lambda: 10 in backup_commits(backup_dir, a), "A's step 10 COMMIT", daemon=daemon)
    write_yaml_atomic(ckpt, config_text(b, backup_interval_steps=1))
    wait_markers(ckpt, b, 0, daemon=daemon)
    make_step(ckpt, 1, payload(1, size=STEP))
    wait_ingested(ckpt, b, 1, daemon)
    # B's next step would not fit beside A's copy, which the bucket holds: it goes.
    wait_until(lambda: not stored_steps(ckpt, a), "A's items dropped", daemon=daemon)
    # Said once the items are gone: the line may come a moment after (CI saw it race).
    said = f"dropped job {a} from this node (the running job needs"
    wait_until(lambda: said in daemon.log(), "the drop logged", daemon=daemon)
    make_step(ckpt, 2, payload(2, size=STEP))  # ENOSPC here before
    wait_ingested(ckpt, b, 2, daemon)
    assert 10 in backup_commits(backup_dir, a)


@pytest.mark.tmpfs_size("40m")
def test_a_job_not_in_the_backup_is_kept_and_reported(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    a, b = f"{job}-a", f"{job}-b"
    daemon = start_daemon(extra=("--metrics", "127.0.0.1:0"))  # no backup at all
    run_a_then_b(ckpt, daemon, a, b)
    wait_until(lambda: f"job {a} does not run here" in daemon.log(), "the warning", daemon=daemon)
    assert stored_steps(ckpt, a) == {10}
    held = sample(scrape_daemon(daemon), "mtc_held_without_backup_bytes", mtc_job=a)
    assert held is not None
    assert held > STEP

    out = mtc("status", "--address", daemon.address, "--json")
    assert out.returncode == 0, out.stderr
    (status,) = [j for j in json.loads(out.stdout)["jobs"] if j["job"] == a]
    assert status["kept_without_backup"] is True
    # Its own rank's copies, not a peer's: "held", never "peer" copies.
    assert (status["held_copies"], status["peer_copies"]) == ([{"rank": 0, "steps": [10]}], None)
    out = mtc("status", "--address", daemon.address)
    assert f"job {a}: not running here; its newest step held is NOT in the backup" in out.stdout

    # The operator's drop: never the running job, an only copy only when told.
    refused = mtc("drop", "--address", daemon.address, "--job", b)
    assert refused.returncode == 1
    assert f"job {b} runs on this node now" in refused.stderr
    refused = mtc("drop", "--address", daemon.address, "--job", a)
    assert refused.returncode == 1
    assert "may be its only copy" in refused.stderr
    assert stored_steps(ckpt, a) == {10}
    dropped = mtc("drop", "--address", daemon.address, "--job", a, "--even-if-only-copy")
    assert dropped.returncode == 0, dropped.stderr
    assert f"dropped job {a} from {daemon.address}" in dropped.stdout
    assert "rank 0: steps 10" in dropped.stdout
    assert stored_steps(ckpt, a) == set()
    assert stored_steps(ckpt, b) == {1}
    missing = mtc("drop", "--address", daemon.address, "--job", a)
    assert missing.returncode == 1
    assert f"holds no items of job {a}" in missing.stderr


def test_a_backed_up_job_goes_after_the_ttl(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    a, b = f"{job}-a", f"{job}-b"
    daemon = start_daemon(backup=backup_dir, extra=("--foreign-job-ttl", "0"))
    write_yaml_atomic(ckpt, config_text(a, backup_interval_steps=1))
    wait_markers(ckpt, a, 0, daemon=daemon)
    make_step(ckpt, 10, payload(10))
    wait_until(lambda: 10 in backup_commits(backup_dir, a), "A's step 10 COMMIT", daemon=daemon)
    write_yaml_atomic(ckpt, config_text(b, backup_interval_steps=1))
    wait_markers(ckpt, b, 0, daemon=daemon)
    wait_until(lambda: not stored_steps(ckpt, a), "A's items dropped", daemon=daemon)
    assert "(ttl 0s)" in daemon.log()
