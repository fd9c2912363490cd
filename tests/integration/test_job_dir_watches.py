"""More job directories than the kernel's default inotify instances (128 a user), served by
one real daemon: every one is watched, on one instance, and a handshake in the last one is
taken at its file event, not at the next rescan."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess
from tests.integration.helpers import config_text, wait_until, write_yaml_atomic

pytestmark = pytest.mark.integration

JOB_DIRS = 140
RESCAN = 60.0
"""Long: within the test, only a file event can make the daemon look at a directory."""


def _inotify_instances(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd) == "anon_inode:inotify"
        except OSError:
            continue  # closed meanwhile
    return count


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    d = DaemonProcess(ckpt, extra_args=("--rescan-seconds", str(RESCAN))).start()
    try:
        yield d
    finally:
        d.stop()


def test_every_job_directory_is_watched_past_the_instance_limit(daemon: DaemonProcess) -> None:
    ckpt = daemon.checkpoint_dir
    names = [f"job-{i:03d}" for i in range(JOB_DIRS)]
    for name in names:
        (ckpt / "jobs" / name).mkdir(parents=True)
    (ckpt / "wake").write_bytes(b"")  # an event at the root: the daemon scans jobs/ now
    last = names[-1]
    wait_until(
        lambda: f"serving the job directory jobs/{last}" in daemon.log(),
        f"jobs/{last} served",
        daemon=daemon,
        timeout=30,
    )
    assert daemon.log().count("serving the job directory jobs/") == JOB_DIRS
    assert "no file events from" not in daemon.log()
    assert daemon.proc is not None
    assert _inotify_instances(daemon.proc.pid) == 1

    where = ckpt / "jobs" / last
    started = time.monotonic()
    write_yaml_atomic(where, config_text(last))
    wait_until(
        lambda: f"accepted replicator.yaml: job={last}" in daemon.log(),
        f"{last}'s handshake taken",
        daemon=daemon,
        timeout=RESCAN / 4,
    )
    assert time.monotonic() - started < RESCAN / 4
