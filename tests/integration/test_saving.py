"""Steady-state saving against a real daemon: several steps landing at once, and the
``pytorch`` framework's per-worker ``.save`` files."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    backup_commits,
    config_text,
    holds,
    ingested_order,
    item_dir,
    make_step,
    payload,
    read_prerestore,
    read_tree,
    stored_steps,
    top_level_step_dirs,
    wait_ingested,
    wait_markers,
    wait_until,
    write_big_step_tmp,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration


def test_steps_landing_together_are_ingested_in_order(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    assert daemon.proc is not None

    # Freeze the daemon so all three renames land between two of its scans; publish them
    # out of numeric order.
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        for step in (30, 10, 20):
            make_step(ckpt, step, payload(step, seed=job))
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)

    wait_until(
        lambda: not top_level_step_dirs(ckpt) and len(ingested_order(daemon, job)) == 3,
        "all three steps ingested",
        daemon=daemon,
    )
    assert ingested_order(daemon, job) == [10, 20, 30]
    wait_until(lambda: stored_steps(ckpt, job) == {30}, "retention keeps step 30 only")
    assert read_tree(item_dir(ckpt, job, 30) / "data") == payload(30, seed=job)

    # Retention never deleted a step newer than the one being processed.
    current = -1
    for line in daemon.log().splitlines():
        if m := re.search(rf"ingested {re.escape(job)}/s(\d+)/", line):
            current = int(m.group(1))
        elif m := re.search(rf"deleted {re.escape(job)}/s(\d+)/.*\(retention\)", line):
            assert int(m.group(1)) < current, f"deleted step {m.group(1)} while at {current}"


def _write_save_file(path: Path, data: bytes, *, pause: float = 0.0) -> None:
    """Written in place, like ``torch.save(obj, path)``: complete once closed."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        if pause:
            time.sleep(pause)
        f.write(data[len(data) // 2 :])


def test_pytorch_save_files_one_item_per_worker(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    # --settle-seconds 2: the "only one worker's file exists" window below must not end by
    # the settle fallback; the closes are what make each file count as finished.
    daemon = start_daemon(extra=("--settle-seconds", "2"))
    yaml_text = config_text(job, framework="pytorch", workers_per_node=2)
    write_yaml_atomic(ckpt, yaml_text)
    for m in wait_markers(ckpt, job, 0, daemon, workers=2):
        assert m.is_file()
        assert not m.is_symlink()
        assert m.stat().st_size == 0

    w0, w1 = (ckpt / f"{job}-s5-n0-w{w}.save" for w in (0, 1))
    data0, data1 = os.urandom(70_000), os.urandom(50_001)
    _write_save_file(w0, data0)
    # One worker's file is finished, the step is not: it must stay where it is.
    holds(w0.exists, "w0.save untouched while w1.save is missing", 1.0, daemon=daemon)
    assert stored_steps(ckpt, job, worker=0) == set()
    _write_save_file(w1, data1, pause=0.2)
    wait_until(
        lambda: (
            not w0.exists()
            and not w1.exists()
            and 5 in stored_steps(ckpt, job, worker=0)
            and 5 in stored_steps(ckpt, job, worker=1)
        ),
        "both .save files taken as step 5",
        daemon=daemon,
    )
    assert (item_dir(ckpt, job, 5, worker=0) / "data").read_bytes() == data0
    assert (item_dir(ckpt, job, 5, worker=1) / "data").read_bytes() == data1

    # Restart: each worker's marker is a relative link to its own file.
    assert daemon.stop() == 0
    daemon = start_daemon(extra=("--settle-seconds", "2"))
    write_yaml_atomic(ckpt, yaml_text)
    m0, m1 = wait_markers(ckpt, job, 5, daemon, workers=2)
    assert read_prerestore(ckpt)["restore-step"] == 5
    for marker, data in ((m0, data0), (m1, data1)):
        assert marker.is_symlink()
        assert not os.path.isabs(os.readlink(marker))
        assert marker.resolve().is_file()
        assert marker.resolve().is_relative_to((ckpt / ".mtc" / "views").resolve())
        assert marker.read_bytes() == data


@pytest.mark.tmpfs_size("512m")
def test_keep_steps_keeps_the_newest_n_steps_on_the_ram_disk(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """``--keep-steps 3``: the newest three complete steps stay (before: no such setting,
    one step was all a one-node job kept); restarted without it, the next ingest keeps the
    newest alone again."""
    daemon = start_daemon(extra=("--keep-steps", "3"))
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    for step in range(1, 6):
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
    wait_until(lambda: stored_steps(ckpt, job) == {3, 4, 5}, "steps 3-5 kept", daemon=daemon)
    holds(lambda: stored_steps(ckpt, job) == {3, 4, 5}, "steps 3-5 kept", 1.0, daemon=daemon)
    assert daemon.stop() == 0

    again = start_daemon()
    make_step(ckpt, 6, payload(6, seed=job))
    wait_ingested(ckpt, job, 6, again)
    wait_until(lambda: stored_steps(ckpt, job) == {6}, "only step 6 kept", daemon=again)


def test_steps_the_job_asks_to_keep_outlive_retention(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """``replicator.keep`` (our Tune client names the steps of checkpoints Tune may still
    hand out: PopulationBasedTraining clones an older one): those steps stay however many
    saves follow; once the file no longer names one, the next ingest drops it. A symlink
    at that name, or a file of junk, keeps nothing."""
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 1, payload(1, seed=job))
    wait_ingested(ckpt, job, 1, daemon)
    (ckpt / "replicator.keep").write_text("1\n")
    for step in (2, 3):
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
    wait_until(lambda: stored_steps(ckpt, job) == {1, 3}, "steps 1 and 3 kept", daemon=daemon)
    elsewhere = ckpt.parent / "keep-elsewhere"
    elsewhere.write_text("1\n")
    (ckpt / "replicator.keep").unlink()
    (ckpt / "replicator.keep").symlink_to(elsewhere)
    make_step(ckpt, 4, payload(4, seed=job))
    wait_ingested(ckpt, job, 4, daemon)
    wait_until(lambda: stored_steps(ckpt, job) == {4}, "step 1 let go", daemon=daemon)


def test_retention_drops_a_step_once_its_upload_is_done(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    """A step kept only because it was being uploaded goes when the upload ends, not at
    some later save: the RAM disk holds the newest step, plus what is in flight."""
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    wait_markers(ckpt, job, 0, daemon)

    tmp, _ = write_big_step_tmp(ckpt, 1, 2, 100)
    os.rename(tmp, ckpt / "1")
    wait_until(
        lambda: _upload_started(backup_dir, job, 1), "upload of step 1 started", daemon=daemon
    )
    make_step(ckpt, 2, payload(2, seed=job))
    wait_ingested(ckpt, job, 2, daemon)
    # Step 1 is protected while its upload runs...
    if 1 not in backup_commits(backup_dir, job):
        assert 1 in stored_steps(ckpt, job)
    wait_until(
        lambda: {1, 2} <= backup_commits(backup_dir, job), "COMMITs of 1 and 2", daemon=daemon
    )
    # ...and dropped once it is done, with no further save to trigger it.
    wait_until(lambda: stored_steps(ckpt, job) == {2}, "step 1 dropped", daemon=daemon)


def _upload_started(backup: Path, job: str, step: int) -> bool:
    return (backup / job / str(step)).is_dir()
