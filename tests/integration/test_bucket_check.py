"""The backup bucket checked at start and in readiness, against real stores (moto's S3
server, the GCS emulator) and real daemons.

Before: with ``--backup s3://...`` and no credentials the daemon said ``daemon ready``,
``/readyz`` answered 200, and a fresh job's handshake hung (a misleading hint after 60 s,
the client gave up at 300 s). Now a refusal (credentials, permission, no bucket) makes the
daemon not ready with the reason and refuses a job at once in ``replicator.failed``; an
unreachable store makes it not ready and is retried with backoff while jobs run as before.
"""

from __future__ import annotations

import contextlib
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mtc_replicator.storage.probe import PROBE_KEY
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    CONFIG,
    FAILED,
    config_text,
    mount_tmpfs,
    read_text,
    unmount,
    wait_until,
    write_yaml_atomic,
)
from tests.storage_servers import (
    S3_UNSET,
    Bucket,
    ServerProcess,
    answer,
    create_s3_bucket,
    fault_proxy,
    gcs_env,
    gcs_error,
    gcs_upload_name,
    s3_env,
    unique_bucket_name,
)

pytestmark = pytest.mark.integration

METRICS = ("--metrics", "127.0.0.1:0", "--storage-timeout", "2")
NO_AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", *S3_UNSET)


def readyz(daemon: DaemonProcess) -> tuple[int, str]:
    assert daemon.metrics is not None
    try:
        with urllib.request.urlopen(f"http://{daemon.metrics}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_ready_says(daemon: DaemonProcess, words: str, status: int = 503) -> str:
    def said() -> str | None:
        code, body = readyz(daemon)
        return body if code == status and words in body else None

    body = wait_until(said, f"/readyz {status} saying {words!r}", daemon=daemon, timeout=30)
    assert body is not None
    return body


def daemon_on(
    tmp_path: Path, backup: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> DaemonProcess:
    for key in NO_AWS_CREDENTIALS:
        monkeypatch.delenv(key, raising=False)
    return DaemonProcess(tmp_path / "ckpt", backup=backup, extra_args=METRICS, env=env)


def test_s3_without_credentials_is_not_ready_and_refuses_a_job_at_once(
    tmp_path: Path, moto_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique_bucket_name()
    create_s3_bucket(moto_server.url, name)
    env = {k: v for k, v in s3_env(moto_server.url).items() if not k.startswith("AWS_SECRET")} | {
        "AWS_ACCESS_KEY_ID": ""
    }
    env.pop("AWS_ACCESS_KEY_ID")
    with daemon_on(tmp_path, f"s3://{name}/backups", env, monkeypatch) as daemon:
        # No credentials at all: said so, with the sources tried, and no permission named
        # (before: "no usable AWS credentials (...) ... it needs s3:ListBucket").
        body = wait_ready_says(daemon, "no AWS credentials found")
        assert f"backup s3://{name}/backups refused" in body
        assert "AWS_WEB_IDENTITY_TOKEN_FILE" in body
        assert "s3:ListBucket" not in body
        assert "docs/permissions.md" in body
        assert "refused: bucket" in daemon.log()
        ckpt = tmp_path / "ckpt"
        write_yaml_atomic(ckpt, config_text("nocreds"))
        wait_until((ckpt / FAILED).exists, FAILED, daemon=daemon, timeout=10)
        failed = read_text(ckpt / FAILED)
        assert "no AWS credentials found" in failed
        assert "s3:ListBucket" not in failed
        assert "docs/permissions.md" in failed
        assert not (ckpt / CONFIG).exists()


def test_gcs_bucket_that_does_not_exist_is_not_ready_and_refuses_a_job(
    tmp_path: Path, gcs_emulator: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = unique_bucket_name()
    env = gcs_env(gcs_emulator.url)
    with daemon_on(tmp_path, f"gs://{missing}/backups", env, monkeypatch) as daemon:
        wait_ready_says(daemon, "does not exist")
        ckpt = tmp_path / "ckpt"
        write_yaml_atomic(ckpt, config_text("nobucket"))
        wait_until((ckpt / FAILED).exists, FAILED, daemon=daemon, timeout=10)
        assert "does not exist" in read_text(ckpt / FAILED)


def test_gcs_that_refuses_the_probe_write_is_not_ready_and_refuses_a_job(
    tmp_path: Path, gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The emulator checks no permissions: a proxy answers the probe's upload as GCS does
    a principal without ``storage.objects.create`` (S3's own denial, from moto's policy
    engine, is in ``test_bucket_permissions.py``). Before: the daemon said ready."""
    forbidden = gcs_error(403, "forbidden", "caller does not have storage.objects.create access")
    deny = answer(
        403,
        forbidden,
        "application/json",
        match=lambda r: r.method == "POST" and PROBE_KEY in gcs_upload_name(r),
    )
    with fault_proxy(gcs_bucket.endpoint, [deny]) as proxy:
        env = gcs_env(proxy.url)
        with daemon_on(tmp_path, gcs_bucket.url, env, monkeypatch) as daemon:
            body = wait_ready_says(daemon, "refused")
            assert "may not write under the prefix: it needs storage.objects.create" in body
            ckpt = tmp_path / "ckpt"
            write_yaml_atomic(ckpt, config_text("nocreate"))
            wait_until((ckpt / FAILED).exists, FAILED, daemon=daemon, timeout=10)
            assert "storage.objects.create" in read_text(ckpt / FAILED)
        assert proxy.requests("POST"), "the probe tried to write"


def fill(directory: Path) -> Path:
    """Fill ``directory``'s filesystem to the last byte; the file that holds it all."""
    filler = directory / "filler"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as out:  # ENOSPC
        while True:
            out.write(b"x" * 4096)
    return filler


def test_a_full_file_backup_disk_is_retried_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's write is refused only when denied: a full disk may heal, so it is retried
    and jobs start; once the probe object exists a full disk no longer matters to it (a
    create-only write of an existing name writes nothing)."""
    fs = tmp_path / "backup-fs"
    fs.mkdir()
    if not mount_tmpfs(fs, "256k"):
        pytest.skip("needs root: a tmpfs of its own, never a real disk filled")
    try:
        backup = fs / "backup"
        backup.mkdir()
        filler = fill(fs)
        with daemon_on(tmp_path, backup.as_uri(), {}, monkeypatch) as daemon:
            body = wait_ready_says(daemon, "unreachable, retrying")
            assert "No space left on device" in body, body
            _accepted_while_retried(
                daemon, tmp_path / "ckpt", "fulldisk", "a full disk may be freed"
            )
            filler.unlink()
            wait_ready_says(daemon, "ok", status=200)
        assert (backup / PROBE_KEY).is_file()
        fill(fs)
        with daemon_on(tmp_path, backup.as_uri(), {}, monkeypatch) as daemon:
            wait_ready_says(daemon, "ok", status=200)
    finally:
        unmount(fs)


def _accepted_while_retried(daemon: DaemonProcess, ckpt: Path, job: str, why: str) -> None:
    """A job's handshake is accepted while a location is retried (``why`` it may heal)."""
    write_yaml_atomic(ckpt, config_text(job))
    wait_until(
        lambda: f"accepted {CONFIG}: job={job}" in daemon.log(),
        f"the handshake accepted ({why})",
        daemon=daemon,
        timeout=20,
    )
    assert not (ckpt / FAILED).exists()


def test_s3_with_credentials_is_ready(
    tmp_path: Path, moto_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique_bucket_name()
    create_s3_bucket(moto_server.url, name)
    backup = f"s3://{name}/backups"
    with daemon_on(tmp_path, backup, s3_env(moto_server.url), monkeypatch) as daemon:
        wait_ready_says(daemon, "ok", status=200)
        assert f"backup {backup}: usable" in daemon.log()


def test_an_unreachable_store_is_not_ready_retried_with_backoff_and_jobs_still_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nobody listens once this socket closes
    env = s3_env(f"http://127.0.0.1:{port}") | {"AWS_MAX_ATTEMPTS": "1"}
    with daemon_on(tmp_path, "s3://unreachable/backups", env, monkeypatch) as daemon:
        wait_ready_says(daemon, "unreachable, retrying")
        wait_until(
            lambda: daemon.log().count("unreachable: ") >= 2,
            "a second probe, after a backoff",
            daemon=daemon,
            timeout=30,
        )
        assert "retrying in" in daemon.log()
        _accepted_while_retried(daemon, tmp_path / "ckpt", "waits", "an outage may heal")


def test_a_refused_registry_refuses_cluster_jobs_only(
    tmp_path: Path, moto_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {k: v for k, v in s3_env(moto_server.url).items() if k not in NO_AWS_CREDENTIALS}
    backup = (tmp_path / "backup").as_uri()
    registry = f"s3://{unique_bucket_name()}/registry"
    for key in NO_AWS_CREDENTIALS:
        monkeypatch.delenv(key, raising=False)
    extra = (*METRICS, "--registry", registry)
    with DaemonProcess(tmp_path / "ckpt", backup=backup, extra_args=extra, env=env) as daemon:
        wait_ready_says(daemon, f"registry {registry} refused")
        ckpt = tmp_path / "ckpt"
        write_yaml_atomic(ckpt, config_text("solo"))
        wait_until(
            lambda: f"accepted {CONFIG}: job=solo" in daemon.log(),
            "a one-node job, which needs no registry, accepted",
            daemon=daemon,
            timeout=20,
        )
        assert not (ckpt / FAILED).exists()
        write_yaml_atomic(ckpt, config_text("pair", nodes=2))
        wait_until((ckpt / FAILED).exists, FAILED, daemon=daemon, timeout=10)
        assert f"the registry location {registry} cannot be used" in read_text(ckpt / FAILED)


def test_sigterm_does_not_wait_for_a_probe_of_a_silent_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # connections complete in the backlog, and nothing ever answers
        env = s3_env(f"http://127.0.0.1:{silent.getsockname()[1]}")
        for key in NO_AWS_CREDENTIALS:
            monkeypatch.delenv(key, raising=False)
        daemon = DaemonProcess(
            tmp_path / "ckpt",
            backup="s3://silent/backups",
            extra_args=("--metrics", "127.0.0.1:0"),  # the default 300 s storage timeout
            env=env,
        ).start()
        try:
            wait_ready_says(daemon, "not checked yet")  # the probe is in flight
            assert daemon.stop(timeout=15) == 0
        finally:
            if daemon.running:
                daemon.kill()
