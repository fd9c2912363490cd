"""A trainer saving asynchronously (``client.AsyncSaver``), killed with SIGKILL at each phase
of its save, leaves the complete previous step or the complete new one: in the daemon's
view (``core.policy.find_handoffs`` over ``node.checkpoint_dir.list_top``, what it would
take) and on disk, and the daemon's handshake clean-up leaves no temporary. And SIGTERM,
the pod's termination notice, publishes the save in flight before the process ends.

The trainer is a real process (this module run as a script), stopped at a phase by the
saver's phase hook, then killed; CHECKPOINT_DIR is a tmpfs (the ``ckpt`` fixture). Then a
real daemon: the job's next handshake removes the killed save's temp and restores the
whole step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.client import AsyncSaver
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.policy import find_handoffs
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.checkpoint_dir import cleanup_workload_files, list_top
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    config_text,
    wait_ingested,
    wait_markers,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
TENSORS = 4


def values(step: int) -> dict[str, Any]:
    """The state the trainer saves at ``step``."""
    return {f"t{i}": torch.full((1 << 16,), float(step * 100 + i)) for i in range(TENSORS)}


def child(directory: str, layout: str, stop_at: str) -> None:
    """The trainer: step 1 saved and published, then step 2 stopped at ``stop_at``."""
    armed = threading.Event()
    preempt = stop_at == "sigterm"
    where = "write" if preempt else stop_at

    def hook(phase: str) -> None:
        if not armed.is_set() or phase != where:
            return
        if preempt:  # the pod's notice arrives while step 2 is being written
            os.kill(os.getpid(), signal.SIGTERM)
            return
        print(phase, flush=True)
        threading.Event().wait()  # held here until killed

    def save(saver: AsyncSaver, step: int, state: dict[str, Any]) -> None:
        if layout == "step-dir":
            saver.save_state_dict(step, state)
        else:
            saver.save_file(step, state, job="j", rank=0, worker=0)

    saver = AsyncSaver(directory, phase_hook=hook)
    if preempt:
        saver.finish_on_sigterm()
    live = values(1)
    save(saver, 1, live)
    saver.wait()
    armed.set()
    for i, t in enumerate(live.values()):  # the loop moves on: step 2's state, in place
        t.fill_(200.0 + i)
    save(saver, 2, live)
    for t in live.values():
        t.fill_(-1.0)  # must not reach step 2's file
    threading.Event().wait(60)  # the loop "trains" until killed (SIGTERM: the handler exits)


def run_child(ckpt: Path, layout: str, stop_at: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "tests.integration.test_async_save_kill", str(ckpt)]
    return subprocess.Popen(
        [*args, layout, stop_at], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def taken_steps(ckpt: Path, layout: str) -> list[int]:
    """The steps the daemon would take from ``ckpt`` now (settled long ago)."""
    framework = Framework.PYTORCH_DISTRIBUTED if layout == "step-dir" else Framework.PYTORCH
    config = JobConfig("j", framework, 0, 1, backup_interval=BackupInterval(minutes=30))
    handoffs = find_handoffs(config, list_top(ckpt), (), time.time() + 3600, 1.0)
    return [h.step for h in handoffs]


def published(ckpt: Path, layout: str, step: int) -> Path:
    return ckpt / (f"{step}/state.pt" if layout == "step-dir" else f"j-s{step}-n0-w0.save")


def assert_complete(ckpt: Path, layout: str, step: int) -> None:
    loaded = torch.load(published(ckpt, layout, step), weights_only=True)
    assert loaded.keys() == values(step).keys()
    for key, expected in values(step).items():
        assert torch.equal(loaded[key], expected), (step, key)


PHASES = [
    ("step-dir", "snapshot", [1]),
    ("step-dir", "write", [1]),
    ("step-dir", "rename", [1]),
    ("step-dir", "published", [1, 2]),
    ("save-file", "write", [1]),
    ("save-file", "published", [1, 2]),
]


@pytest.mark.parametrize(("layout", "stop_at", "steps"), PHASES)
def test_a_kill_at_any_phase_leaves_whole_steps_only(
    ckpt: Path, layout: str, stop_at: str, steps: list[int]
) -> None:
    proc = run_child(ckpt, layout, stop_at)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == stop_at, "the trainer never reached the phase"
    finally:
        proc.kill()
        proc.wait(30)

    assert taken_steps(ckpt, layout) == steps
    for step in steps:
        assert_complete(ckpt, layout, step)
    # The handshake of the restarted job removes what the killed save left; nothing else.
    store = LocalStore(ckpt)
    store.open()
    cleanup_workload_files(ckpt, store)
    names = sorted(e.name for e in list_top(ckpt))
    assert names == sorted(published(ckpt, layout, s).relative_to(ckpt).parts[0] for s in steps)


def test_a_real_daemon_restores_the_whole_step_and_removes_the_killed_saves_temp(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    proc = run_child(ckpt, "step-dir", "write")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "write"
    finally:
        proc.kill()
        proc.wait(30)
    assert (ckpt / "step=2-unfinished").is_dir()

    # The job comes back: its handshake removes the temp; step 1 is ingested and restored.
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job, framework="pytorch.distributed"))
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert not os.path.lexists(ckpt / "step=2-unfinished")
    restored = torch.load(marker / "state.pt", weights_only=True)
    assert all(torch.equal(restored[k], v) for k, v in values(1).items())

    # An asynchronous save of this incarnation is taken whole.
    with AsyncSaver(ckpt) as saver:
        saver.save_state_dict(2, values(2))
    data = wait_ingested(ckpt, job, 2, daemon)
    saved = torch.load(data / "state.pt", weights_only=True)
    assert all(torch.equal(saved[k], v) for k, v in values(2).items())


@pytest.mark.parametrize("layout", ["step-dir", "save-file"])
def test_sigterm_publishes_the_save_in_flight_then_ends_the_process(
    ckpt: Path, layout: str
) -> None:
    proc = run_child(ckpt, layout, "sigterm")
    assert proc.wait(60) == -signal.SIGTERM  # the default action, after the save
    assert taken_steps(ckpt, layout) == [1, 2]
    assert_complete(ckpt, layout, 2)
    assert sorted(e.name for e in list_top(ckpt)) == sorted(
        published(ckpt, layout, s).relative_to(ckpt).parts[0] for s in (1, 2)
    )


if __name__ == "__main__":
    child(*sys.argv[1:4])
