"""Fixtures for integration tests: a fresh CHECKPOINT_DIR (a real tmpfs when we are root),
a ``file://`` backup directory, a unique job name, and real daemon processes that are
always stopped (and their logs printed) at teardown.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster
from tests.integration.helpers import FAST_ARGS, mount_tmpfs, unmount

DEFAULT_TMPFS = "256m"

StartDaemon = Callable[..., DaemonProcess]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "tmpfs_size(size): size of the tmpfs mounted as CHECKPOINT_DIR (default 256m)"
    )


@pytest.fixture
def ckpt(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """CHECKPOINT_DIR: a tmpfs as in production when we are root, else a plain directory."""
    path = tmp_path / "ckpt"
    path.mkdir()
    marker = request.node.get_closest_marker("tmpfs_size")
    mounted = mount_tmpfs(path, marker.args[0] if marker else DEFAULT_TMPFS)
    try:
        yield path
    finally:
        if mounted:
            unmount(path)


@pytest.fixture
def backup_dir(tmp_path: Path) -> Path:
    path = tmp_path / "backup"
    path.mkdir()
    return path


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A fresh, safe job name per test (parametrized ids included)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name.removeprefix("test_"))[:40]
    return f"{base.strip('-.')}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def start_daemon(ckpt: Path) -> Iterator[StartDaemon]:
    """Start a real daemon on ``ckpt``: ``start_daemon(backup=None, extra=())``.

    Every daemon started is stopped at teardown (killed if it does not stop), before the
    tmpfs is unmounted, and its log is printed so a failure shows what the daemon did.
    """
    started: list[DaemonProcess] = []

    def start(*, backup: Path | None = None, extra: tuple[str, ...] = ()) -> DaemonProcess:
        daemon = DaemonProcess(
            ckpt,
            backup=backup.as_uri() if backup else None,
            extra_args=(*FAST_ARGS, *extra),
        )
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        if daemon.running:
            with contextlib.suppress(subprocess.TimeoutExpired):  # stop() killed it
                daemon.stop(timeout=10)
    if started:
        print(f"--- daemon log {started[0].log_path} ---\n{started[0].log()[-20000:]}")


@pytest.fixture
def cluster_extra() -> tuple[str, ...]:
    """Extra daemon arguments; a test overrides it with ``pytest.mark.parametrize``."""
    return ()


@pytest.fixture
def cluster_backup() -> bool:
    """Whether the cluster has a backup; a test overrides it with ``parametrize``."""
    return True


@pytest.fixture
def cluster(
    tmp_path: Path, job: str, cluster_extra: tuple[str, ...], cluster_backup: bool
) -> Iterator[Cluster]:
    """Four real daemons (started), stopped at teardown with their logs printed."""
    c = Cluster(tmp_path, job, cluster_extra, backup=cluster_backup)
    for r in range(NODES):
        c.start(r)
    try:
        yield c
    finally:
        c.stop_all()
        for r in range(NODES):
            log = tmp_path / f"node{r}.log"
            if log.exists():
                print(f"--- node {r} ---\n{log.read_text()[-6000:]}")
