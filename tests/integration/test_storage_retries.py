"""Retries by the SDKs themselves, bounded by one deadline, on the real servers.

S3 retries are botocore's own retry modes (``standard`` unless ``AWS_RETRY_MODE`` or the AWS
config file says otherwise; ``AWS_MAX_ATTEMPTS`` counts the tries); GCS retries are
google-cloud-storage's ``Retry``. Every store takes ``timeout``: the most seconds one storage
request spends with its retries. Each server runs behind a ``FaultProxy`` that fails
requests and counts them (``tests/storage_servers.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtc_replicator.storage.gcs import GcsObjectStore
from mtc_replicator.storage.objectstore import (
    ObjectNotFound,
    ObjectStore,
    PermissionDenied,
    StorageTimeout,
    TransientError,
)
from mtc_replicator.storage.s3 import S3ObjectStore
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Request,
    Rule,
    answer,
    gcs_create_only,
    gcs_error,
    s3_error,
)

S3_SLOWDOWN = s3_error("SlowDown", "injected SlowDown")
S3_INTERNAL = s3_error("InternalError", "injected InternalError")
GCS_503 = gcs_error(503, "backendError", "injected backendError")


def s3_503(*, times: int | None = None) -> Rule:
    return answer(503, S3_SLOWDOWN, times=times)


def gcs_503(*, times: int | None = None, match: Callable[[Request], bool] = lambda _: True) -> Rule:
    return answer(503, GCS_503, "application/json", times=times, match=match)


def is_bucket_metadata(req: Request) -> bool:
    """google-cloud-storage 3.x reads the bucket's metadata from a background thread for
    its telemetry: that request is not ours to count."""
    path = req.path.split("?")[0]
    return req.method == "GET" and path.startswith("/storage/v1/b/") and "/o" not in path


def ours(proxy: FaultProxy) -> list[Request]:
    return [r for r in proxy.requests() if not is_bucket_metadata(r)]


@pytest.fixture
def s3_proxied(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[FaultProxy, S3ObjectStore]]]:
    proxies: list[FaultProxy] = []

    def make(rules: list[Rule], **kwargs: float) -> tuple[FaultProxy, S3ObjectStore]:
        proxy = FaultProxy(s3_bucket.endpoint, rules).start()
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        return proxy, S3ObjectStore.from_url(s3_bucket.url, **kwargs)

    yield make
    for proxy in proxies:
        proxy.stop()


@pytest.fixture
def gcs_proxied(
    gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., tuple[FaultProxy, GcsObjectStore]]]:
    proxies: list[FaultProxy] = []

    def make(rules: list[Rule], **kwargs: float) -> tuple[FaultProxy, GcsObjectStore]:
        proxy = FaultProxy(gcs_bucket.endpoint, [*rules, gcs_create_only]).start()
        proxies.append(proxy)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        return proxy, GcsObjectStore.from_url(gcs_bucket.url, **kwargs)

    yield make
    for proxy in proxies:
        proxy.stop()


# --- S3: botocore's retry modes --------------------------------------------------------------


def test_aws_max_attempts_sets_the_number_of_tries(
    s3_proxied: Callable[..., tuple[FaultProxy, S3ObjectStore]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    proxy, store = s3_proxied([s3_503()])
    with pytest.raises(TransientError, match="SlowDown"):
        store.put_bytes("k", b"x")
    assert len(proxy.requests()) == 2


def test_the_aws_config_file_sets_the_retry_mode_and_tries(
    s3_proxied: Callable[..., tuple[FaultProxy, S3ObjectStore]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """What ``~/.aws/config`` says applies too (here through ``AWS_CONFIG_FILE``)."""
    config = tmp_path / "aws-config"
    config.write_text("[default]\nretry_mode = standard\nmax_attempts = 4\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    proxy, store = s3_proxied([s3_503()])
    with pytest.raises(TransientError, match="SlowDown"):
        store.head("k")
    assert len(proxy.requests()) == 4


def test_the_default_mode_retries_transient_errors_and_succeeds(
    s3_proxied: Callable[..., tuple[FaultProxy, S3ObjectStore]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    proxy, store = s3_proxied([s3_503(times=1), answer(500, S3_INTERNAL, times=1)])
    store.put_bytes("k", b"payload")
    assert store.get_bytes("k") == b"payload"
    assert proxy.statuses().count(503) == 1
    assert proxy.statuses().count(500) == 1


def test_each_retry_is_logged_with_its_reason(
    s3_proxied: Callable[..., tuple[FaultProxy, S3ObjectStore]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, store = s3_proxied([s3_503(times=1)])
    with caplog.at_level(logging.DEBUG, logger="mtc_replicator"):
        store.put_bytes("k", b"x")
    retried = [r for r in caplog.records if r.levelno == logging.WARNING and "retry" in r.message]
    assert len(retried) == 1, caplog.text
    assert "SlowDown" in retried[0].message or "503" in retried[0].message


def test_what_botocore_does_not_retry_is_sent_again_by_us(
    s3_proxied: Callable[..., tuple[FaultProxy, S3ObjectStore]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 asks for a retry of a conditional write that met a concurrent one (409
    ConditionalRequestConflict); botocore's modes do not retry it, so we do."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    conflict = s3_error("ConditionalRequestConflict", "a concurrent conditional write")
    proxy, store = s3_proxied([answer(409, conflict, times=1, match=lambda r: r.method == "PUT")])
    store.put_bytes("job/1/COMMIT", b"commit", if_absent=True)
    assert store.get_bytes("job/1/COMMIT") == b"commit"
    assert [r.status for r in proxy.requests("PUT")] == [409, 200]


# --- GCS: google-cloud-storage's Retry --------------------------------------------------------


def test_gcs_retries_a_transient_error_on_upload_and_download(
    gcs_proxied: Callable[..., tuple[FaultProxy, GcsObjectStore]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy, store = gcs_proxied(
        [
            gcs_503(times=1, match=lambda r: r.method == "POST"),
            gcs_503(times=1, match=lambda r: r.method == "GET" and "alt=media" in r.path),
        ]
    )
    with caplog.at_level(logging.WARNING, logger="mtc_replicator"):
        store.put_bytes("k", b"payload")
        assert store.get_bytes("k") == b"payload"
    assert proxy.statuses().count(503) == 2
    retried = [r for r in caplog.records if "retry" in r.message and "503" in r.message]
    assert len(retried) == 2, caplog.text


# --- both: the overall deadline, and errors no retry can fix ---------------------------------


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_the_storage_timeout_bounds_a_server_that_always_fails(
    backend: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1000")  # only the deadline can stop it
    bound = 4.0
    make = request.getfixturevalue(f"{backend}_proxied")
    proxy, store = make([s3_503() if backend == "s3" else gcs_503()], timeout=bound)
    t0 = time.monotonic()
    with pytest.raises(StorageTimeout, match=r"storage timeout") as raised:
        store.put_bytes("k", b"x")
    elapsed = time.monotonic() - t0
    assert elapsed < bound + 3.0, f"took {elapsed:.1f}s for a {bound}s bound"
    assert len(ours(proxy)) >= 2  # it did retry before the deadline
    assert "503" in str(raised.value) or "SlowDown" in str(raised.value)


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_permission_denied_and_not_found_are_not_retried(
    backend: str, request: pytest.FixtureRequest
) -> None:
    make = request.getfixturevalue(f"{backend}_proxied")
    forbidden = (
        answer(403, s3_error("AccessDenied", "no"), times=1)
        if backend == "s3"
        else answer(
            403,
            gcs_error(403, "forbidden", "no"),
            "application/json",
            times=1,
            match=lambda r: not is_bucket_metadata(r),  # the SDK's telemetry must not take it
        )
    )
    proxy, store = make([forbidden])
    store_: ObjectStore = store
    with pytest.raises(PermissionDenied):
        store_.put_bytes("k", b"x")
    assert len(ours(proxy)) == 1
    before = len(ours(proxy))
    with pytest.raises(ObjectNotFound):
        store_.get_bytes("missing")
    # GCS checks the bucket again first (its first check was refused): one listing, one GET.
    assert len(ours(proxy)) - before == (1 if backend == "s3" else 2)
