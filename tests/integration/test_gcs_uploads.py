"""GCS uploads by size, on the emulator behind a recording proxy: one request up to
``single_limit`` (streamed from the open file, its crc32c checked first and declared so
the server refuses other bytes), composite parts above it (``core.uploads``).

The GCS emulator has no XML multipart API (only ``PUT``/``GET`` of ``/bucket/object``), so
google-cloud-storage's ``transfer_manager.upload_chunks_concurrently`` cannot run here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest

from replicator.core.retry import RetryPolicy
from replicator.storage import gcs as gcs_mod
from replicator.storage.gcs import GcsObjectStore
from replicator.storage.objectstore import ChecksumMismatch, ObjectStoreError
from tests.storage_servers import Bucket, FaultProxy, fault_proxy, gcs_create_only

KiB = 1024
MiB = 1024 * KiB
PART = 64 * KiB
LIMIT = 12 * MiB  # above gcs.SDK_MULTIPART_MAX: a resumable upload
FAST = RetryPolicy(attempts=3, first_delay=0.01, max_delay=0.05, deadline=10.0)


@pytest.fixture
def proxy(gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with fault_proxy(gcs_bucket.endpoint, [gcs_create_only]) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy


@pytest.fixture
def store(gcs_bucket: Bucket, proxy: FaultProxy) -> GcsObjectStore:
    return GcsObjectStore.from_url(
        gcs_bucket.url, part_size=PART, single_limit=LIMIT, workers=3, policy=FAST
    )


def raw_names(store: GcsObjectStore) -> list[str]:
    """Every object under the bucket, temporary composite parts included."""
    return sorted(b.name for b in store._get_bucket().list_blobs())


def uploads(proxy: FaultProxy) -> list[str]:
    """What each upload request did: its upload type (or compose)."""
    done = []
    for r in proxy.seen:
        kind = r.query.get("uploadType", [""])[0]
        if r.path.split("?")[0].endswith("/compose"):
            done.append("compose")
        elif kind or "upload_id" in r.query:
            sent = f" {len(r.body)}" if r.method == "PUT" else ""
            done.append(f"{r.method} {kind or 'upload'}{sent}")
    return done


def test_a_file_up_to_the_limit_goes_up_in_one_data_request(
    store: GcsObjectStore, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = os.urandom(LIMIT)
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert store.get_bytes("job/1/f") == data
    # One session, one request with every byte; no temporary parts, no compose.
    assert uploads(proxy) == ["POST resumable", f"PUT resumable {LIMIT}"]
    assert raw_names(store) == ["backups/job/1/f"]


def test_a_file_above_the_limit_is_a_composite_upload(
    store: GcsObjectStore, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = os.urandom(LIMIT + 1)
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert store.get_bytes("job/1/f") == data
    assert "compose" in uploads(proxy)
    assert raw_names(store) == ["backups/job/1/f"]  # the parts were deleted


def test_a_changed_file_is_refused_before_a_byte_is_sent(
    store: GcsObjectStore, proxy: FaultProxy, tmp_path: Path
) -> None:
    (tmp_path / "f").write_bytes(os.urandom(LIMIT - MiB))
    store.put_bytes("job/1/other", b"committed")
    before = len(proxy.seen)
    with pytest.raises(ChecksumMismatch, match="changed since its checksum"):
        store.put_file("job/1/f", tmp_path / "f", crc32c=12345)
    assert [r for r in proxy.seen[before:] if r.body] == []
    assert store.head("job/1/f") is None
    assert store.get_bytes("job/1/other") == b"committed"


def test_bytes_that_change_after_the_check_are_refused_by_the_server(
    store: GcsObjectStore,
    proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer changes the file between our crc32c check and the send: the crc32c
    declared in the request makes GCS (and the emulator) refuse what arrives."""
    taken = os.urandom(LIMIT - MiB)
    expected = google_crc32c.value(taken)
    (tmp_path / "f").write_bytes(os.urandom(len(taken)))  # what is on disk when sent
    monkeypatch.setattr(gcs_mod, "_stream_crc32c", lambda f: expected)
    store.put_bytes("job/1/other", b"committed")
    with pytest.raises(ObjectStoreError):
        store.put_file("job/1/f", tmp_path / "f", crc32c=expected)
    assert store.head("job/1/f") is None
    assert raw_names(store) == ["backups/job/1/other"]
    assert store.get_bytes("job/1/other") == b"committed"
