"""The real Orbax multi-tier checkpointing client against a real daemon process.

Each test starts ``python -m mtc_replicator.node.daemon`` on a fresh CHECKPOINT_DIR and runs
``tests/interop/orbax_driver.py`` (Orbax's own ``initialize_multi_tier_checkpointing``
handshake + ``ReplicatorCheckpointManager`` on CPU JAX, one process) as a subprocess, the way a
training pod would. See the driver's docstring for its JSON output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.daemon_process import DaemonProcess
from tests.integration.helpers import store_root, wait_until

pytest.importorskip(
    "orbax.checkpoint",
    reason="the real Orbax client is not installed (`make test` installs the [interop] extra)",
    exc_type=ImportError,
)

pytestmark = [pytest.mark.interop, pytest.mark.integration]

DRIVER = Path(__file__).resolve().parents[1] / "interop" / "orbax_driver.py"
DRIVER_TIMEOUT = 90.0  # the driver's own limit (it exits 124 with a diagnosis)
SETTLE_TIMEOUT = 30.0  # for the daemon to ingest / back up after the driver exits
STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")


# --- helpers ---------------------------------------------------------------------------------


def run_driver(
    ckpt: Path, daemon: DaemonProcess, *, run_name: str, mode: str, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Run the driver to completion; return its JSON line (fail with both sides' logs)."""
    cmd = [
        sys.executable,
        str(DRIVER),
        "--dir",
        str(ckpt),
        "--run-name",
        run_name,
        "--mode",
        mode,
        "--timeout",
        str(DRIVER_TIMEOUT),
        *extra,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=DRIVER_TIMEOUT + 30, check=False
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"driver {mode} exited {proc.returncode}\n--- stderr (tail) ---\n"
            f"{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}\n"
            f"--- daemon log (tail) ---\n{daemon.log()[-6000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def top_level_steps(ckpt: Path) -> dict[str, Path]:
    """Workload-visible step entries (real dirs or symlinks named by digits only)."""
    return {p.name: p for p in ckpt.iterdir() if STEP_NAME.match(p.name)}


def stored_steps(ckpt: Path) -> set[int]:
    """Steps the daemon's store holds, whatever its layout: Orbax writes into every step's
    ``commit_success.txt`` "Checkpoint commit was successful to <dir>/<N>". A step in
    ``ingest/`` may move while this walks; the caller polls, so it is seen next time."""
    steps: set[int] = set()
    store = store_root(ckpt)
    if not store.is_dir():
        return steps
    for dirpath, _dirs, files in os.walk(store):
        if "commit_success.txt" in files and "_CHECKPOINT_METADATA" in files:
            try:
                text = (Path(dirpath) / "commit_success.txt").read_text(errors="replace")
            except FileNotFoundError:  # ingest moved the step on while we walked: look again
                continue
            text = text.strip()
            m = re.search(r"/([0-9]+)$", text)
            if m:
                steps.add(int(m.group(1)))
    return steps


def backup_committed_steps(backup: Path, job: str) -> set[int]:
    """Steps with a COMMIT object under ``<backup>/.../<job>/<step>/...``."""
    steps: set[int] = set()
    for dirpath, _dirs, files in os.walk(backup):
        if not any(f.startswith("COMMIT") for f in files):
            continue
        parts = Path(dirpath).relative_to(backup).parts
        if job in parts:
            after = parts[parts.index(job) + 1 :]
            if after and STEP_NAME.match(after[0]):
                steps.add(int(after[0]))
    return steps


def wait_ingested(ckpt: Path, daemon: DaemonProcess, last_step: int) -> None:
    """No ``<N>/`` left at the top level and the newest step is in the store."""

    def done() -> bool:
        real_dirs = [p for p in top_level_steps(ckpt).values() if not p.is_symlink()]
        return not real_dirs and last_step in stored_steps(ckpt)

    wait_until(
        done,
        f"step dirs ingested into the store (newest {last_step})",
        daemon=daemon,
        timeout=SETTLE_TIMEOUT,
    )


def read_prerestore(ckpt: Path) -> Any:
    return yaml.safe_load((ckpt / "replicator.prerestore").read_text())


def assert_restored_through_relative_marker(ckpt: Path, result: dict[str, Any], step: int) -> None:
    assert result["restored_step"] == step, result
    assert result["checksum"] == result["expected_checksum"], result
    assert result["checksum"] is not None
    target = result["step_dir_symlink"]
    assert target is not None, f"<{step}> was not a symlink (the renamed marker): {result}"
    assert not os.path.isabs(target), f"marker target must be relative, got {target!r}"
    resolved = (ckpt / target).resolve()
    assert resolved.is_relative_to(ckpt.resolve()), f"marker escapes CHECKPOINT_DIR: {target}"
    for name in ("_CHECKPOINT_METADATA", "process_metadata", "state"):
        assert (resolved / name).exists(), f"{name} missing behind the marker ({resolved})"
    # Orbax renamed the marker to <step> and deleted every other marker.
    assert not list(ckpt.glob("*.restore")), sorted(os.listdir(ckpt))
    assert set(top_level_steps(ckpt)) == {str(step)}, sorted(os.listdir(ckpt))
    assert (ckpt / str(step)).is_symlink()


def assert_clean_handshake(ckpt: Path) -> None:
    names = set(os.listdir(ckpt))
    assert "replicator.yaml" not in names
    assert "replicator.failed" not in names
    assert "jax-init-info.txt" in names, "the daemon must never delete jax-init-info.txt"


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def daemon(ckpt: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(ckpt).start()
    try:
        yield d
    finally:
        if d.running:
            d.stop()


# --- tests -----------------------------------------------------------------------------------


def test_fresh_start_saves_are_ingested(ckpt: Path, daemon: DaemonProcess) -> None:
    result = run_driver(
        ckpt,
        daemon,
        run_name="orbax-fresh",
        mode="train",
        extra=("--steps", "5", "--save-every", "2", "--backup-interval-minutes", "30"),
    )
    assert result["restored_step"] is None, result
    assert result["steps_seen_at_start"] == [], result
    assert result["saved_steps"] == [0, 2, 4], result
    assert read_prerestore(ckpt) == {}
    assert_clean_handshake(ckpt)
    assert not list(ckpt.glob("*.restore")), "Orbax deletes the no-checkpoint marker"

    wait_ingested(ckpt, daemon, last_step=4)
    assert not [p for p in ckpt.iterdir() if "orbax-checkpoint-tmp" in p.name]


def test_restart_restores_last_step_through_relative_marker(
    ckpt: Path, daemon: DaemonProcess
) -> None:
    job = "orbax-restart"
    train = run_driver(
        ckpt,
        daemon,
        run_name=job,
        mode="train",
        extra=("--steps", "4", "--save-every", "1", "--backup-interval-minutes", "30"),
    )
    last = train["saved_steps"][-1]
    assert last == 3, train
    wait_ingested(ckpt, daemon, last_step=last)

    # The job restarts on the same node; the daemon keeps running.
    resumed = run_driver(ckpt, daemon, run_name=job, mode="resume")
    assert_restored_through_relative_marker(ckpt, resumed, last)
    assert resumed["checksum"] == train["saved_checksums"][str(last)]
    assert read_prerestore(ckpt)["restore-step"] == last
    assert_clean_handshake(ckpt)

    # The daemon restarts too (its store survives); the stale <last> symlink of the previous
    # incarnation must not confuse it, and the job restores the same step again.
    daemon.stop()
    daemon.start()
    again = run_driver(ckpt, daemon, run_name=job, mode="resume")
    assert_restored_through_relative_marker(ckpt, again, last)


def test_restore_from_file_backup_after_store_loss(tmp_path: Path, ckpt: Path) -> None:
    job = "orbax-backup"
    backup = tmp_path / "backup"
    backup.mkdir()
    daemon = DaemonProcess(ckpt, backup=backup.as_uri()).start()
    try:
        train = run_driver(
            ckpt,
            daemon,
            run_name=job,
            mode="train",
            extra=(
                "--steps",
                "3",
                "--save-every",
                "1",
                "--backup-interval-steps",
                "1",
                "--step-sleep",
                "0.3",
            ),
        )
        last = train["saved_steps"][-1]
        assert last == 2, train
        wait_ingested(ckpt, daemon, last_step=last)
        wait_until(
            lambda: last in backup_committed_steps(backup, job),
            f"a committed backup of step {last} under {backup}",
            daemon=daemon,
            timeout=SETTLE_TIMEOUT,
        )

        # Lose the node's local tier: stop the daemon, wipe its store, start it again.
        daemon.stop()
        shutil.rmtree(store_root(ckpt))
        for p in top_level_steps(ckpt).values():
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p)
        daemon.start()

        resumed = run_driver(ckpt, daemon, run_name=job, mode="resume")
        assert_restored_through_relative_marker(ckpt, resumed, last)
        assert resumed["checksum"] == train["saved_checksums"][str(last)]
        prerestore = read_prerestore(ckpt)
        assert prerestore["restore-step"] == last
        assert prerestore.get("restore-source", "backup") == "backup", prerestore
        assert_clean_handshake(ckpt)
    finally:
        if daemon.running:
            daemon.stop()
