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
from tests.integration.cluster import Cluster, running
from tests.integration.helpers import FAST_ARGS, mount_tmpfs, unmount
from tests.storage_servers import (
    S3_UNSET,
    Bucket,
    ServerProcess,
    create_gcs_bucket,
    create_s3_bucket,
    gcs_env,
    s3_env,
    start_gcs_emulator,
    start_moto,
    unique_bucket_name,
)

DEFAULT_TMPFS = "256m"

StartDaemon = Callable[..., DaemonProcess]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "tmpfs_size(size): size of the tmpfs holding CHECKPOINT_DIR (default 256m)"
    )


@pytest.fixture
def ckpt(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """CHECKPOINT_DIR: a directory of a tmpfs as in production when we are root (else of a
    plain directory), so that the daemon's default store, its sibling, shares the tmpfs."""
    ram = tmp_path / "ram"
    ram.mkdir()
    marker = request.node.get_closest_marker("tmpfs_size")
    mounted = mount_tmpfs(ram, marker.args[0] if marker else DEFAULT_TMPFS)
    try:
        (ram / "ckpt").mkdir()
        yield ram / "ckpt"
    finally:
        if mounted:
            unmount(ram)


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
    with running(Cluster(tmp_path, job, cluster_extra, backup=cluster_backup)) as c:
        yield c


# --- storage servers (tests/storage_servers.py): one process per session, a bucket per test --


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """moto's S3 server, a separate process shared by the session."""
    server = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The GCS emulator (in memory), a separate process shared by the session."""
    server = start_gcs_emulator(tmp_path_factory.mktemp("gcs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(moto_server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on moto; this process's environment points boto3 at it."""
    name = unique_bucket_name()
    create_s3_bucket(moto_server.url, name)
    env = s3_env(moto_server.url)
    for key in S3_UNSET:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Bucket(f"s3://{name}/backups", name, moto_server.url, env)


@pytest.fixture
def gcs_bucket(gcs_emulator: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket on the GCS emulator; this process's environment points the SDK at it."""
    name = unique_bucket_name()
    create_gcs_bucket(gcs_emulator.url, name)
    env = gcs_env(gcs_emulator.url)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return Bucket(f"gs://{name}/backups", name, gcs_emulator.url, env)
