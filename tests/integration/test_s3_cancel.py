"""A backup cancelled while botocore sends a body: the meter raises ``Cancelled`` from the
body's ``read``, botocore wraps it as an ``HTTPClientError``, which its retry modes take for
a broken connection. The upload must end at once with ``Cancelled``, not after botocore's
retries (each one re-reading the body and cancelled again) as a transient storage error."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import Cancelled
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.storage.s3 import MIN_PART_SIZE, S3ObjectStore
from tests.storage_servers import Bucket, FaultProxy


@pytest.mark.parametrize("size", [1000, 2 * MIN_PART_SIZE + 1], ids=["single", "multipart"])
def test_a_cancelled_upload_ends_at_once_as_cancelled(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, size: int
) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "4")
    proxy = FaultProxy(s3_bucket.endpoint).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        store = S3ObjectStore.from_url(s3_bucket.url, part_size=MIN_PART_SIZE, workers=2)
        store.head("warm")  # the bucket check, before the clock starts
        (tmp_path / "f").write_bytes(os.urandom(size))
        before = len(proxy.requests("PUT"))
        t0 = time.monotonic()
        with Pacer().transfer(Traffic.BACKUP, lambda: True) as meter, pytest.raises(Cancelled):
            store.put_file("job/1/0-0/f", tmp_path / "f", meter=meter)
        assert time.monotonic() - t0 < 1.0
        puts = proxy.requests("PUT")[before:]
        # Each request at most begun (its headers, no body), and none tried again.
        assert all(r.body == b"" for r in puts)
        assert all("attempt=1;" in (r.header("amz-sdk-request") or "") for r in puts)
        if size > MIN_PART_SIZE:  # the multipart upload is aborted, not left billed
            assert [r for r in proxy.requests("DELETE") if "uploadId" in r.query]
    finally:
        proxy.stop()
