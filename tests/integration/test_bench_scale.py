"""The scale benchmark (scripts/bench_scale.py) runs end to end, tiny: a real coordinator
daemon, a real peer daemon and simulated members over mutual TLS, every phase."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_scale.py"


def test_the_scale_bench_measures_every_phase() -> None:
    args = ["--nodes", "16", "--steady-seconds", "3", "--save-every", "1", "--json"]
    # Its own session: on a timeout the whole group goes, the daemons it started included
    # (a killed script left 16 of them running under the rest of the suite).
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the scale bench did not end within 180 s:\n{stderr[-5000:]}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)

    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["nodes"], result["tls"]) == (16, True)
    for phase in ("round", "loss_1", "loss_10", "loss_100"):
        calls, seconds = result[phase]["calls_per_member"], result[phase]["seconds"]
        assert 0 < seconds < 60
        # Every member joined and reported once, each call long-polled; RoundStatus only
        # when a join's 10 s wait ended first (real daemons restarting on a loaded box),
        # one per 10 s at most. Polling alone took three or more per member and round.
        assert (calls["Join"], calls["ReportRestore"]) == (1.0, 1.0), calls
        assert calls.get("RoundStatus", 0) <= seconds / 10 + 1, (calls, seconds)
        assert result[phase]["retried_calls"] == 0
    assert result["steady"]["backups_committed"] >= 1
    assert result["steady"]["cpu_seconds_per_minute"] > 0
    # The restarted coordinator ordered a backup again (every member reported to it).
    assert 0 < result["restart"]["seconds_to_backup_order"] < 60
