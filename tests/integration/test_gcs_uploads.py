"""GCS uploads by size, on the emulator behind a recording proxy: one resumable upload
streamed from the open file (its crc32c checked first and declared so the server refuses
other bytes), its whole content in one data request up to ``single_limit`` and in chunks
above it (``core.uploads``); never a temporary object, never a delete.

The GCS emulator has no XML multipart API (only ``PUT``/``GET`` of ``/bucket/object``), so
google-cloud-storage's ``transfer_manager.upload_chunks_concurrently`` cannot run here; why
we do not use it on GCS either: docs/performance.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest

from mtc_replicator.storage import gcs as gcs_mod
from mtc_replicator.storage.gcs import GcsObjectStore
from mtc_replicator.storage.objectstore import ChecksumMismatch, ObjectStoreError
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Reply,
    Request,
    answer,
    fault_proxy,
    gcs_create_only,
    gcs_error,
)

KiB = 1024
MiB = 1024 * KiB
PART = 64 * KiB
LIMIT = 12 * MiB  # above gcs.SDK_MULTIPART_MAX: a resumable upload
CHUNK = 256 * KiB  # PART, rounded up to what GCS takes


@pytest.fixture
def proxy(gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with fault_proxy(gcs_bucket.endpoint, [gcs_create_only]) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy


@pytest.fixture
def store(gcs_bucket: Bucket, proxy: FaultProxy) -> GcsObjectStore:
    return GcsObjectStore.from_url(gcs_bucket.url, part_size=PART, single_limit=LIMIT, timeout=20.0)


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


def test_a_file_above_the_limit_goes_up_in_chunks_of_one_upload(
    store: GcsObjectStore, proxy: FaultProxy, tmp_path: Path
) -> None:
    data = os.urandom(LIMIT + 1)
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert store.get_bytes("job/1/f") == data
    chunks = -(-len(data) // CHUNK)
    sizes = [CHUNK] * (chunks - 1) + [len(data) - CHUNK * (chunks - 1)]
    assert uploads(proxy) == ["POST resumable"] + [f"PUT resumable {n}" for n in sizes]
    assert raw_names(store) == ["backups/job/1/f"]


def test_a_chunked_upload_makes_no_temporary_object_and_deletes_nothing(
    gcs_bucket: Bucket, proxy: FaultProxy, store: GcsObjectStore, tmp_path: Path
) -> None:
    """No object but the final one exists at any time (the bucket is listed as each chunk
    arrives, and after), and no request deletes anything: the upload needs no delete
    permission (the emulator checks none, so the proxy refuses every DELETE as GCS would
    for such a principal)."""
    seen: list[list[str]] = []

    def list_at_each_chunk(req: Request, proxy: FaultProxy) -> Reply | None:
        if req.method == "PUT" and "upload_id" in req.query:
            listing = proxy.forward(
                Request("GET", f"/storage/v1/b/{gcs_bucket.name}/o?prefix=", [], b"")
            )
            seen.append(sorted(item["name"] for item in json.loads(listing.body).get("items", [])))
        return None

    forbidden = gcs_error(403, "forbidden", "no storage.objects.delete permission")
    proxy.rules[:0] = [
        list_at_each_chunk,
        answer(403, forbidden, "application/json", match=lambda r: r.method == "DELETE"),
    ]
    data = os.urandom(LIMIT + 3 * CHUNK + 7)
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert len(seen) >= 4
    assert all(names == [] for names in seen), seen
    assert raw_names(store) == ["backups/job/1/f"]
    assert store.get_bytes("job/1/f") == data
    assert proxy.requests("DELETE") == []


def test_a_chunk_that_fails_is_retried_by_the_sdk(
    store: GcsObjectStore, proxy: FaultProxy, tmp_path: Path
) -> None:
    busy = gcs_error(503, "backendError", "injected")
    proxy.rules[:0] = [
        answer(
            503,
            busy,
            "application/json",
            times=1,
            match=lambda r: r.method == "PUT" and "upload_id" in r.query,
        )
    ]
    data = os.urandom(LIMIT + CHUNK)
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert store.get_bytes("job/1/f") == data
    assert proxy.statuses().count(503) == 1
    assert [u for u in uploads(proxy) if u.startswith("POST")] == ["POST resumable"]


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
    monkeypatch.setattr(gcs_mod, "_stream_crc32c", lambda f, block: expected)
    store.put_bytes("job/1/other", b"committed")
    with pytest.raises(ObjectStoreError):
        store.put_file("job/1/f", tmp_path / "f", crc32c=expected)
    assert store.head("job/1/f") is None
    assert raw_names(store) == ["backups/job/1/other"]
    assert store.get_bytes("job/1/other") == b"committed"
