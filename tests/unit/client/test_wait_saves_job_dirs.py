"""The preStop hook (``wait_saves``) must also wait for a save in flight in a job
directory, ``CHECKPOINT_DIR/jobs/<job>/``, where ``RayCheckpointer(job_directory=True)``
and ``TuneCheckpointer`` write: the hook is given CHECKPOINT_DIR itself."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.client.wait_saves import main, saves_in_flight
from tests.unit.client.test_async_save import Gate, state

pytest.importorskip("torch")

from mtc_replicator.client import AsyncSaver


def test_a_save_in_flight_in_a_job_directory_is_waited_for(tmp_path: Path) -> None:
    job_dir = tmp_path / "jobs" / "trial-1"
    job_dir.mkdir(parents=True)
    gate = Gate("rename")  # the step's temporary is written; its rename is held
    with AsyncSaver(job_dir, phase_hook=gate) as saver, ThreadPoolExecutor(1) as pool:
        saver.save_file(10, state(), job="trial-1", rank=0, worker=0)
        assert gate.reached.wait(30)
        assert saves_in_flight(tmp_path) == ["jobs/trial-1/trial-1-s10-n0-w0.save.tmp"]
        waiting = pool.submit(main, ["--dir", str(tmp_path), "--timeout", "20"])
        time.sleep(0.5)
        assert not waiting.done(), "the preStop wait returned with a job's save in flight"
        gate.release.set()
        assert waiting.result(timeout=10) == 0
        assert (job_dir / "trial-1-s10-n0-w0.save").is_file()


def test_a_symlinked_job_directory_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step=3-unfinished").mkdir()
    root = tmp_path / "ckpt"
    (root / "jobs").mkdir(parents=True)
    os.symlink(elsewhere, root / "jobs" / "j")
    assert saves_in_flight(root) == []
