"""The ObjectStore contract on real servers: ``file://``, S3 on moto's server mode and GCS on
the gcp-storage-emulator, each server a separate process (fixtures in ``conftest.py``).

``TestObjectStoreContract`` inherits every assertion of the server-less suite
(``tests/unit/storage/test_objectstore.py``); the classes below add what only large or remote
objects show: parallel part uploads in bounded memory, retries, and faults injected by a
proxy in front of the real server (``tests/storage_servers.py``).

Where an emulator does not do what the real service does, a test says so by name:

- The GCS emulator ignores generation preconditions
  (``test_gcs_emulator_ignores_generation_preconditions``): the GCS store therefore runs
  behind a proxy that enforces ``ifGenerationMatch=0`` as GCS does.
- The GCS emulator checks no credentials: a proxy answering 403 stands in for GCS.
- moto verifies no upload checksum (``test_moto_does_not_verify_upload_checksums``): our
  comparison of the ETag moto computes with the MD5 we sent is what catches damaged bytes.
- Neither moto (check then write, no lock) nor the proxy-backed emulator makes concurrent
  create-only writes a test of the service: that race runs on ``file://`` only.
"""

from __future__ import annotations

import os
import re
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import google_crc32c
import pytest

from mtc_replicator.local import hashing
from mtc_replicator.local.fsutil import TMP_PREFIX
from mtc_replicator.storage import objectstore as objectstore_mod
from mtc_replicator.storage.gcs import SDK_MULTIPART_MAX, GcsObjectStore
from mtc_replicator.storage.objectstore import (
    BucketNotFound,
    ChecksumMismatch,
    FileObjectStore,
    ObjectStore,
    PermissionDenied,
    PreconditionFailed,
    TransientError,
)
from mtc_replicator.storage.s3 import MIN_PART_SIZE, S3ObjectStore
from mtc_replicator.storage.stores import open_object_store
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Match,
    ReplyRule,
    Request,
    Rule,
    ServerProcess,
    answer,
    anything,
    corrupt_reply,
    corrupt_request,
    create_s3_bucket,
    cut_reply,
    enable_moto_auth,
    fault_proxy,
    gcs_create_only,
    gcs_error,
    s3_error,
    start_moto,
    unique_bucket_name,
)
from tests.unit.storage.test_objectstore import SMALL_CHUNK
from tests.unit.storage.test_objectstore import TestObjectStoreContract as ServerlessContract

S3_PART = MIN_PART_SIZE  # S3's smallest part: multipart paths with a few MiB
GCS_PART = 64 * 1024  # the smallest chunk is 256 KiB: larger files take many chunks
WORKERS = 3


def s3_store(url: str, **kwargs: object) -> S3ObjectStore:
    options: dict[str, object] = {
        "part_size": S3_PART,
        "workers": WORKERS,
        "chunk_size": SMALL_CHUNK,
        **kwargs,
    }
    return S3ObjectStore.from_url(url, **options)


def gcs_store(url: str, **kwargs: object) -> GcsObjectStore:
    options: dict[str, object] = {
        "part_size": GCS_PART,
        "single_limit": GCS_PART,  # larger files go in chunks, as above 150 MiB
        "chunk_size": SMALL_CHUNK,
        "range_size": 64 * SMALL_CHUNK,
        **kwargs,
    }
    return GcsObjectStore.from_url(url, **options)


@pytest.fixture(autouse=True)
def more_s3_attempts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests inject up to 5 faults in a row: botocore's 3 tries would not get through."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "6")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in the server-less suite; cloud stores get ``chunk_size`` instead."""
    monkeypatch.setattr(hashing, "CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(objectstore_mod, "CHUNK", SMALL_CHUNK)


@pytest.fixture(params=["file", "s3", "gcs"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def objects(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ObjectStore]:
    if backend == "file":
        yield FileObjectStore(tmp_path / "bucket")
    elif backend == "s3":
        bucket: Bucket = request.getfixturevalue("s3_bucket")
        yield s3_store(bucket.url)
    else:
        bucket = request.getfixturevalue("gcs_bucket")
        # The emulator ignores ifGenerationMatch=0; this proxy enforces it as GCS does.
        with fault_proxy(bucket.endpoint, [gcs_create_only]) as proxy:
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
            yield gcs_store(bucket.url)


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


class TestObjectStoreContract(ServerlessContract):
    """Every assertion of the server-less contract, on file://, S3 and GCS."""

    def test_list_skips_writer_temp_objects(self, objects: ObjectStore) -> None:
        # What a crashed writer leaves: a temp file (file://); older versions' composite
        # parts (GCS).
        objects.put_bytes(f"job/1/{TMP_PREFIX}abc-data.000001", b"part")
        objects.put_bytes("job/1/data", b"x")
        assert [o.key for o in objects.list("job/")] == ["job/1/data"]

    def test_create_only_race_has_one_winner(self, objects: ObjectStore, backend: str) -> None:
        if backend == "s3":
            pytest.skip("moto checks If-None-Match, then writes, without a lock: not atomic")
        if backend == "gcs":
            pytest.skip("the GCS emulator ignores ifGenerationMatch; the proxy is the lock")
        outcomes: list[str] = []
        start = threading.Barrier(8)

        def writer(i: int) -> None:
            start.wait()
            try:
                objects.put_bytes("job/9/COMMIT", f"writer {i}".encode(), if_absent=True)
                outcomes.append(f"writer {i}")
            except PreconditionFailed:
                outcomes.append("refused")

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [o for o in outcomes if o != "refused"]
        assert len(winners) == 1
        assert objects.get_bytes("job/9/COMMIT") == winners[0].encode()


class TestLargeObjects:
    """Files of many parts or chunks: verified, and never whole in memory."""

    def size(self, backend: str) -> int:
        if backend == "gcs":
            return SDK_MULTIPART_MAX + 123  # a resumable upload of 33 chunks
        return S3_PART * 2 + 12345  # three parts on S3; one streamed file on file://

    def test_round_trip(self, objects: ObjectStore, backend: str, tmp_path: Path) -> None:
        src = tmp_path / "big"
        data = random_file(src, self.size(backend))
        objects.put_file("job/1/0-0/shard", src, crc32c=google_crc32c.value(data))
        assert b"".join(objects.read_chunks("job/1/0-0/shard")) == data
        info = objects.head("job/1/0-0/shard")
        assert info is not None
        assert info.size == len(data)
        assert [o.key for o in objects.list("")] == ["job/1/0-0/shard"]  # no parts left

    def test_overwrite_with_a_smaller_file(
        self, objects: ObjectStore, backend: str, tmp_path: Path
    ) -> None:
        src = tmp_path / "big"
        random_file(src, self.size(backend))
        objects.put_file("k", src)
        small = random_file(tmp_path / "small", 10)
        objects.put_file("k", tmp_path / "small")
        assert objects.get_bytes("k") == small

    def test_changed_source_leaves_nothing(
        self, objects: ObjectStore, backend: str, tmp_path: Path
    ) -> None:
        src = tmp_path / "big"
        random_file(src, self.size(backend))
        with pytest.raises(ChecksumMismatch):
            objects.put_file("k", src, crc32c=12345)
        assert objects.head("k") is None
        if isinstance(objects, S3ObjectStore):
            uploads = objects.client.list_multipart_uploads(Bucket=objects.bucket)
            assert uploads.get("Uploads", []) == []  # aborted, not left to bill
        if isinstance(objects, GcsObjectStore):
            raw = objects._get_bucket().list_blobs()  # temp parts included
            assert [b.name for b in raw] == []

    def test_memory_stays_bounded(
        self,
        objects: ObjectStore,
        backend: str,
        tmp_path: Path,
        request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Peak Python memory of a put_file and a read_chunks, against the file's size.

        Bounds are (parts in flight) x (copies the SDK makes of each): boto3 sends our
        buffer as is; google-cloud-storage sends one chunk at a time (with ~2 copies).
        """
        if backend == "file":
            pytest.skip("file:// streams one chunk at a time; nothing is held in parts")
        if backend == "s3":
            part, parts, bound = S3_PART, 12, WORKERS + 2
        else:
            # Straight to the emulator: the proxy's buffers would count in this process.
            bucket: Bucket = request.getfixturevalue("gcs_bucket")
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", bucket.endpoint)
            part, parts, bound = 1024 * 1024, 24, 4
            objects = gcs_store(objects.url, part_size=part, range_size=part)
        src = tmp_path / "big"
        data = random_file(src, part * parts + 5)
        crc = google_crc32c.value(data)
        del data
        tracemalloc.start()
        try:
            objects.put_file("big", src, crc32c=crc)
            _, upload_peak = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            got = 0
            for chunk in objects.read_chunks("big"):
                got = google_crc32c.extend(got, chunk)
            _, download_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert got == crc
        assert upload_peak < bound * part, f"{upload_peak / part:.1f} parts of {parts}"
        # One range (GCS) or a few chunks (S3), with the SDK's copy of it.
        assert download_peak < 4 * part, f"{download_peak / part:.1f} parts of {parts}"


# --- faults, injected by a proxy in front of the real server ------------------------------------


@dataclass
class Remote:
    """One cloud backend under test, reachable directly or through a fault proxy."""

    backend: str
    bucket: Bucket
    monkeypatch: pytest.MonkeyPatch

    def store(self, url: str | None = None, **kwargs: object) -> ObjectStore:
        if self.backend == "s3":
            kwargs.pop("range_size", None)  # S3 streams one GET; only GCS reads in ranges
            return s3_store(url or self.bucket.url, **kwargs)
        return gcs_store(url or self.bucket.url, **kwargs)

    def point_at(self, endpoint: str) -> None:
        variable = "AWS_ENDPOINT_URL_S3" if self.backend == "s3" else "STORAGE_EMULATOR_HOST"
        self.monkeypatch.setenv(variable, endpoint)

    def error(
        self,
        status: int,
        s3_code: str,
        gcs_reason: str,
        *,
        times: int | None = None,
        match: Match = anything,
    ) -> Rule:
        """A rule answering ``status`` in the words of this service."""
        if self.backend == "s3":
            body, kind = s3_error(s3_code, f"injected {s3_code}"), "application/xml"
        else:
            body, kind = gcs_error(status, gcs_reason, f"injected {gcs_reason}"), "application/json"
        return answer(status, body, kind, times=times, match=match)

    def is_upload(self, req: Request) -> bool:
        return req.method == ("PUT" if self.backend == "s3" else "POST")

    def ours(self, proxy: FaultProxy) -> list[Request]:
        """The requests our code made. google-cloud-storage 3.x also reads the bucket's
        metadata from a background thread, for its telemetry: that one is not counted."""
        return [
            r
            for r in proxy.requests()
            if not re.fullmatch(r"GET /storage/v1/b/[^/?]+(\?.*)?", f"{r.method} {r.path}")
        ]

    def is_object_read(self, req: Request) -> bool:
        if req.method != "GET":
            return False
        if self.backend == "s3":
            return "list-type=" not in req.path  # not a listing
        return "alt=media" in req.path  # not a metadata read


@pytest.fixture(params=["s3", "gcs"])
def remote(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Remote:
    backend = str(request.param)
    bucket = request.getfixturevalue("s3_bucket" if backend == "s3" else "gcs_bucket")
    return Remote(backend, bucket, monkeypatch)


Proxied = Callable[..., tuple[FaultProxy, ObjectStore]]


@pytest.fixture
def proxied(remote: Remote) -> Iterator[Proxied]:
    """``proxied(rules, reply_rules, **store_options)``: a store whose requests pass a
    fault proxy in front of the real server; the proxy records every request."""
    proxies: list[FaultProxy] = []

    def make(
        rules: list[Rule] | None = None,
        reply_rules: list[ReplyRule] | None = None,
        url: str | None = None,
        **kwargs: object,
    ) -> tuple[FaultProxy, ObjectStore]:
        proxy = FaultProxy(remote.bucket.endpoint, rules, reply_rules).start()
        proxies.append(proxy)
        remote.point_at(proxy.url)
        return proxy, remote.store(url, **kwargs)

    yield make
    for proxy in proxies:
        proxy.stop()


def exercise(store: ObjectStore, tmp_path: Path, big: int) -> None:
    """Every operation once, small and multipart, checking the bytes that come back."""
    src = tmp_path / "src"
    data = random_file(src, big)
    store.put_file("job/1/0-0/big", src, crc32c=google_crc32c.value(data))
    store.put_bytes("job/1/COMMIT", b"commit", if_absent=True)
    assert store.get_bytes("job/1/COMMIT") == b"commit"
    assert b"".join(store.read_chunks("job/1/0-0/big")) == data
    assert [o.key for o in store.list("job/")] == ["job/1/0-0/big", "job/1/COMMIT"]
    info = store.head("job/1/COMMIT")
    assert info is not None
    assert info.size == 6
    store.delete("job/1/COMMIT")
    assert store.head("job/1/COMMIT") is None


def big_size(remote: Remote) -> int:
    """Three parts on S3; one request on GCS (below ``SDK_MULTIPART_MAX``)."""
    return S3_PART * 2 + 1 if remote.backend == "s3" else GCS_PART * 3 + 1


class TestFaults:
    def test_throttling_is_retried(self, remote: Remote, proxied: Proxied, tmp_path: Path) -> None:
        """503s (SlowDown on S3) and 429s on uploads: every operation still succeeds, after
        exactly as many extra requests as answers were injected."""
        proxy, store = proxied(
            [
                remote.error(503, "SlowDown", "backendError", times=3),
                remote.error(
                    429, "TooManyRequests", "rateLimitExceeded", times=2, match=remote.is_upload
                ),
            ]
        )
        exercise(store, tmp_path, big_size(remote))
        statuses = proxy.statuses()
        assert statuses.count(503) == 3
        assert statuses.count(429) == 2

    def test_endless_throttling_gives_up_with_a_transient_error(
        self, remote: Remote, proxied: Proxied
    ) -> None:
        """S3 after ``AWS_MAX_ATTEMPTS`` tries; GCS (no such setting) at the timeout. S3's
        timeout leaves room for all three: at 3 s, a third try came only when botocore's
        jittered first wait (up to 1 s) and both requests fit before our planned 2 s wait."""
        remote.monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
        timeout = 10.0 if remote.backend == "s3" else 3.0
        proxy, store = proxied([remote.error(503, "SlowDown", "backendError")], timeout=timeout)
        with pytest.raises(TransientError):
            store.head("k")
        if remote.backend == "s3":
            assert len(remote.ours(proxy)) == 3
        else:
            assert len(remote.ours(proxy)) >= 2

    def test_permission_denied_fails_at_once(
        self, remote: Remote, proxied: Proxied, tmp_path: Path
    ) -> None:
        """A permanent 403 (the GCS emulator checks no credentials: the proxy answers)."""
        proxy, store = proxied([remote.error(403, "AccessDenied", "forbidden")])
        src = tmp_path / "src"
        random_file(src, 100)
        operations: list[Callable[[], object]] = [
            lambda: store.head("k"),
            lambda: store.get_bytes("k"),
            lambda: store.put_bytes("k", b"x"),
            lambda: store.put_file("k", src),
            lambda: list(store.list("")),
            lambda: store.delete("k"),
        ]
        for operation in operations:
            with pytest.raises(PermissionDenied, match=r"403|AccessDenied"):
                operation()
        assert len(remote.ours(proxy)) == len(operations)  # one request each: no retries

    def test_missing_bucket_is_reported_at_once(self, remote: Remote, proxied: Proxied) -> None:
        scheme = "s3" if remote.backend == "s3" else "gs"
        proxy, store = proxied(url=f"{scheme}://{unique_bucket_name()}/backups")
        operations: list[Callable[[], object]] = [
            lambda: store.head("k"),
            lambda: store.get_bytes("k"),
            lambda: store.put_bytes("k", b"x", if_absent=True),
            lambda: list(store.list("")),
        ]
        for operation in operations:
            with pytest.raises(BucketNotFound, match="does not exist"):
                operation()
        assert len(remote.ours(proxy)) == len(operations)

    def test_unreachable_endpoint_is_transient_and_bounded(self, remote: Remote) -> None:
        with fault_proxy(remote.bucket.endpoint) as proxy:
            closed = proxy.url  # nothing listens there once the proxy is gone
        remote.point_at(closed)
        remote.monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
        store = remote.store(timeout=3.0)
        t0 = time.monotonic()
        with pytest.raises(TransientError):
            store.head("k")
        assert time.monotonic() - t0 < 10

    def test_damaged_upload_is_sent_again(
        self, remote: Remote, proxied: Proxied, tmp_path: Path
    ) -> None:
        """A byte flipped on the way in, once for a small object and once for a part.
        moto stores it, and the ETag it answers is not our MD5; the GCS emulator refuses
        it by the crc32c we declared, as GCS does. Either way the bytes are sent again."""
        proxy, store = proxied([corrupt_request(times=2, match=remote.is_upload, at=0.6)])
        data = os.urandom(20_000)
        store.put_bytes("small", data)
        assert store.get_bytes("small") == data
        src = tmp_path / "big"
        big = random_file(src, big_size(remote))
        store.put_file("big", src)
        assert store.get_bytes("big") == big
        uploads = [r for r in proxy.requests() if remote.is_upload(r)]
        # One small object, then the parts (GCS: one request), plus the two resent.
        expected = 1 + 3 + 2 if remote.backend == "s3" else 1 + 1 + 2
        assert len(uploads) == expected

    def test_damaged_download_is_never_returned(self, remote: Remote, proxied: Proxied) -> None:
        _, store = proxied(reply_rules=[corrupt_reply(times=None, match=remote.is_object_read)])
        store.put_bytes("k", os.urandom(5_000))
        with pytest.raises(ChecksumMismatch, match="crc32c"):
            list(store.read_chunks("k"))
        with pytest.raises(ChecksumMismatch):
            store.get_bytes("k")

    def test_cut_download_resumes_where_it_stopped(self, remote: Remote, proxied: Proxied) -> None:
        proxy, store = proxied(
            reply_rules=[cut_reply(2_500, match=remote.is_object_read)], range_size=4_000
        )
        data = os.urandom(10_000)
        store.put_bytes("k", data)
        assert b"".join(store.read_chunks("k")) == data
        reads = [r for r in proxy.requests("GET") if remote.is_object_read(r)]
        ranges = [r.header("Range") for r in reads]
        if remote.backend == "s3":
            # The second GET continues where the first broke off, and only the same version.
            assert len(ranges) == 2
            assert ranges[0] is None
            assert re.fullmatch(r"bytes=[1-9][0-9]*-", ranges[1] or "")
            assert reads[1].header("If-Match") is not None
        else:
            # Ranges of 4000 bytes: the SDK's retry reads the cut one on from where it broke
            # off, then the rest; every read is of the version first seen.
            assert ranges == [
                "bytes=0-3999",
                "bytes=2500-3999",
                "bytes=4000-7999",
                "bytes=8000-9999",
            ]
            assert len({r.query.get("ifGenerationMatch", [""])[0] for r in reads}) == 1
            assert reads[0].query.get("ifGenerationMatch")

    def test_object_replaced_while_downloading(self, remote: Remote, proxied: Proxied) -> None:
        """Bytes of two versions are never spliced into one download. S3 (moto) refuses
        the resumed GET by its If-Match; the GCS emulator serves the new bytes despite the
        pinned generation (real GCS would not), and the crc32c check catches them."""
        _, store = proxied(
            reply_rules=[cut_reply(2_500, match=remote.is_object_read)], range_size=4_000
        )
        store.put_bytes("k", os.urandom(10_000))
        chunks = store.read_chunks("k")
        next(chunks)
        store.put_bytes("k", os.urandom(10_000))
        expected = "changed while downloading" if remote.backend == "s3" else "crc32c"
        with pytest.raises(ChecksumMismatch, match=expected):
            list(chunks)

    def test_parts_are_uploaded_in_parallel(
        self, remote: Remote, proxied: Proxied, tmp_path: Path
    ) -> None:
        if remote.backend == "gcs":
            pytest.skip("a GCS file is one resumable upload: its chunks go one after another")
        proxy, store = proxied()
        src = tmp_path / "big"
        data = random_file(src, S3_PART * 6)
        store.put_file("big", src)
        assert store.get_bytes("big") == data
        assert len(proxy.requests("PUT")) == 6
        assert proxy.max_in_flight > 1


# --- credentials and endpoints from the standard chains -----------------------------------------


def test_s3_with_only_the_generic_endpoint_variable(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_bucket.endpoint)
    exercise(open_object_store(s3_bucket.url), tmp_path, 3000)


def test_gcs_with_only_the_emulator_host(
    gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT")
    assert set(gcs_bucket.env) >= {"STORAGE_EMULATOR_HOST"}
    store = open_object_store(gcs_bucket.url)
    src = tmp_path / "src"
    data = random_file(src, 3000)
    store.put_file("job/1/0-0/f", src)
    assert store.get_bytes("job/1/0-0/f") == data


def test_s3_without_credentials_is_denied_without_a_request(
    s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(PermissionDenied, match="credentials"):
        s3_store(s3_bucket.url).head("k")


@pytest.fixture(scope="module")
def moto_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, str]]:
    """A moto server of its own that checks credentials (it knows none, so all are wrong)."""
    server = start_moto(tmp_path_factory.mktemp("moto-auth"))
    name = unique_bucket_name()
    create_s3_bucket(server.url, name)
    enable_moto_auth(server.url)
    try:
        yield server, name
    finally:
        server.stop()


def test_s3_wrong_credentials_fail_at_once(
    moto_with_auth: tuple[ServerProcess, str],
    s3_bucket: Bucket,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, name = moto_with_auth
    with fault_proxy(server.url) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
        store = s3_store(f"s3://{name}/backups")
        with pytest.raises(PermissionDenied, match="InvalidAccessKeyId"):
            store.put_bytes("k", b"x")
        assert proxy.statuses() == [403]


# --- what the emulators cannot do, shown so the workarounds above stay honest -------------------


def test_gcs_emulator_ignores_generation_preconditions(gcs_bucket: Bucket) -> None:
    """Why the GCS contract runs behind ``gcs_create_only``: straight to the emulator, a
    create-only write replaces an existing object. If this fails, the emulator learned
    preconditions and the proxy can go."""
    store = gcs_store(gcs_bucket.url)
    store.put_bytes("COMMIT", b"first", if_absent=True)
    store.put_bytes("COMMIT", b"second", if_absent=True)  # real GCS: 412
    assert store.get_bytes("COMMIT") == b"second"


def test_moto_does_not_verify_upload_checksums(s3_bucket: Bucket) -> None:
    """Why our ETag comparison matters on moto: it stores a body whose Content-MD5 and
    x-amz-checksum-crc32c are wrong (real S3 answers 400 BadDigest)."""
    store = s3_store(s3_bucket.url)
    store.put_bytes("probe", b"x")  # checks the bucket
    response = store.client.put_object(
        Bucket=s3_bucket.name,
        Key="backups/wrong",
        Body=b"hello",
        ContentMD5="AAAAAAAAAAAAAAAAAAAAAA==",
        ChecksumAlgorithm="CRC32C",
        ChecksumCRC32C="AAAAAA==",
    )
    assert response["ETag"].strip('"') == "5d41402abc4b2a76b9719d911017c592"  # md5("hello")
