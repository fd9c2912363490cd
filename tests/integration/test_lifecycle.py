"""The daemon process's own lifecycle: a clean SIGTERM, and one daemon per CHECKPOINT_DIR."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_tree,
    wait_ingested,
    wait_markers,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration


def test_sigterm_stops_quickly_with_exit_code_zero(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 1, payload(1, seed=job))
    wait_ingested(ckpt, job, 1, daemon)

    started = time.monotonic()
    code = daemon.stop(timeout=10)
    elapsed = time.monotonic() - started
    assert code == 0, daemon.log()[-3000:]
    assert elapsed < 5, f"SIGTERM took {elapsed:.1f}s"
    assert "stopped" in daemon.log().splitlines()[-1]


def test_second_daemon_on_same_dir_fails_fast(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    first = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, first)

    started = time.monotonic()
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtc_replicator.node.daemon",
            "--checkpoint-dir",
            str(ckpt),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert second.returncode == 3, second.stderr
    assert elapsed < 10, f"the second daemon took {elapsed:.1f}s to give up"
    assert "another mtc-replicator already serves" in second.stderr
    assert str(ckpt) in second.stderr

    # The first one is unharmed and still does its job.
    assert first.running
    make_step(ckpt, 2, payload(2, seed=job))
    data = wait_ingested(ckpt, job, 2, first)
    assert read_tree(data) == payload(2, seed=job)
