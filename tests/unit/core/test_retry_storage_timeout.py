"""``--storage-timeout`` (``MTC_STORAGE_TIMEOUT``) on ``mtc-replicator`` and ``mtc backups``:
seconds one object-store request may take with its retries; a bad value is a usage error."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.core.retry import DEFAULT_STORAGE_TIMEOUT, parse_storage_timeout
from mtc_replicator.node.options import parse_args
from mtc_replicator.storage.gcs import GcsObjectStore
from mtc_replicator.storage.s3 import S3ObjectStore
from mtc_replicator.storage.stores import open_object_store
from mtc_replicator.tools import cli

BAD = ["abc", "0", "-5", "nan", "inf", "1e9", ""]


@pytest.mark.parametrize(("text", "seconds"), [("300", 300.0), ("0.5", 0.5), ("86400", 86400.0)])
def test_good_values(text: str, seconds: float) -> None:
    assert parse_storage_timeout(text) == seconds


@pytest.mark.parametrize("text", BAD)
def test_bad_values_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match=r"seconds|more than 0"):
        parse_storage_timeout(text)


def test_the_daemon_takes_the_flag_the_variable_and_a_default() -> None:
    base = ["--checkpoint-dir", "/x"]
    assert parse_args(base, {}).storage_timeout == DEFAULT_STORAGE_TIMEOUT
    assert parse_args(base, {"MTC_STORAGE_TIMEOUT": "45"}).storage_timeout == 45.0
    flagged = parse_args([*base, "--storage-timeout", "12.5"], {"MTC_STORAGE_TIMEOUT": "45"})
    assert flagged.storage_timeout == 12.5


@pytest.mark.parametrize("text", BAD)
def test_the_daemon_refuses_a_bad_value_as_a_usage_error(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, env in (
        (["--checkpoint-dir", "/x", "--storage-timeout", text], {}),
        (["--checkpoint-dir", "/x"], {"MTC_STORAGE_TIMEOUT": text}),
    ):
        with pytest.raises(SystemExit) as exited:
            parse_args(argv, env)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "--storage-timeout" in err
        assert "Traceback" not in err


def test_mtc_backups_takes_the_flag_and_refuses_a_bad_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bucket").mkdir()
    url = (tmp_path / "bucket").as_uri()
    assert cli.main(["backups", "list", url, "--storage-timeout", "30"]) == 0
    with pytest.raises(SystemExit) as exited:
        cli.main(["backups", "list", url, "--storage-timeout", "soon"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--storage-timeout" in err
    assert "expected seconds" in err
    monkeypatch.setenv("MTC_STORAGE_TIMEOUT", "-1")
    with pytest.raises(SystemExit) as exited:
        cli.main(["backups", "list", url])
    assert exited.value.code == 2


def test_the_cloud_stores_get_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a store does no I/O: the timeout is only wired through."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3 = open_object_store("s3://bucket/prefix", timeout=7.0)
    gcs = open_object_store("gs://bucket/prefix", timeout=8.0)
    assert isinstance(s3, S3ObjectStore)
    assert isinstance(gcs, GcsObjectStore)
    assert s3.timeout == 7.0
    assert s3.client.meta.config.read_timeout == 7.0
    assert gcs.storage_timeout == 8.0
    assert gcs.timeout == (8.0, 8.0)


def test_gcs_errors_never_carry_a_resumable_session_id() -> None:
    """A resumable upload's URL holds its upload_id, a credential for that session."""
    import google.api_core.exceptions as gapi
    import requests

    from mtc_replicator.storage.gcs import translate

    url = "http://127.0.0.1:9/upload/storage/v1/b/b/o?uploadType=resumable&upload_id=SECRET123"
    for exc in (
        requests.ConnectionError(f"HTTPConnectionPool: Max retries exceeded with url: {url}"),
        gapi.ServiceUnavailable(f"PUT {url}: backend error"),
    ):
        err = translate(exc, "put b/k")
        assert err is not None
        assert "SECRET123" not in str(err)
        assert "upload_id" not in str(err)
