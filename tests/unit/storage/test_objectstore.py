"""The ObjectStore contract, run against every backend that needs no server.

``FileObjectStore`` on ``tmp_path`` and ``MemoryObjectStore`` must behave alike; the cloud
backends run this same class against real servers in
``tests/integration/test_objectstore_contract.py``.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import google_crc32c
import pytest

from mtc_replicator.core.retry import RetryPolicy, RetryState
from mtc_replicator.local import hashing
from mtc_replicator.local.fsutil import TMP_PREFIX
from mtc_replicator.storage import objectstore as objectstore_mod
from mtc_replicator.storage.objectstore import (
    ChecksumMismatch,
    FileObjectStore,
    MemoryObjectStore,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    TransientError,
    split_bucket_url,
)
from mtc_replicator.storage.parts import (
    b64_crc32c,
    crc32c_b64,
    upload_parts,
    verified_chunks,
)
from mtc_replicator.storage.probe import PROBE_BODY, PROBE_KEY, probe
from mtc_replicator.storage.stores import open_object_store

SMALL_CHUNK = 1000

BACKENDS: dict[str, Callable[[Path], ObjectStore]] = {
    "file": lambda tmp: FileObjectStore(tmp / "bucket"),
    "memory": lambda tmp: MemoryObjectStore(),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exercise multi-chunk paths with small data: both modules imported CHUNK by value."""
    monkeypatch.setattr(hashing, "CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(objectstore_mod, "CHUNK", SMALL_CHUNK)


@pytest.fixture(params=sorted(BACKENDS))
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return BACKENDS[request.param](tmp_path)


class TestObjectStoreContract:
    def test_put_file_and_read_chunks_round_trip(
        self, objects: ObjectStore, tmp_path: Path
    ) -> None:
        data = os.urandom(SMALL_CHUNK * 5 + 123)
        src = tmp_path / "src"
        src.write_bytes(data)
        objects.put_file("job/1/0-0/state/shard", src)
        chunks = list(objects.read_chunks("job/1/0-0/state/shard"))
        assert b"".join(chunks) == data
        assert len(chunks) == 6
        assert all(len(c) <= SMALL_CHUNK for c in chunks)
        assert objects.get_bytes("job/1/0-0/state/shard") == data
        assert src.read_bytes() == data  # the source is left alone

    def test_put_file_of_an_empty_file(self, objects: ObjectStore, tmp_path: Path) -> None:
        src = tmp_path / "empty"
        src.write_bytes(b"")
        objects.put_file("e", src)
        assert b"".join(objects.read_chunks("e")) == b""
        info = objects.head("e")
        assert info is not None
        assert info.size == 0

    def test_put_file_overwrites(self, objects: ObjectStore, tmp_path: Path) -> None:
        src = tmp_path / "src"
        src.write_bytes(b"one")
        objects.put_file("k", src)
        src.write_bytes(b"two!")
        objects.put_file("k", src)
        assert objects.get_bytes("k") == b"two!"

    def test_put_file_with_its_crc32c(self, objects: ObjectStore, tmp_path: Path) -> None:
        data = os.urandom(SMALL_CHUNK * 3 + 7)
        src = tmp_path / "src"
        src.write_bytes(data)
        objects.put_file("k", src, crc32c=google_crc32c.value(data))
        assert objects.get_bytes("k") == data

    def test_put_file_refuses_a_source_that_changed(
        self, objects: ObjectStore, tmp_path: Path
    ) -> None:
        """A file that no longer matches its manifest's crc32c is never uploaded."""
        objects.put_bytes("k", b"old")
        src = tmp_path / "src"
        src.write_bytes(os.urandom(SMALL_CHUNK * 3 + 7))
        with pytest.raises(ChecksumMismatch, match="changed"):
            objects.put_file("k", src, crc32c=google_crc32c.value(b"what the manifest saw"))
        with pytest.raises(ChecksumMismatch):
            objects.put_file("new", src, crc32c=0)
        assert objects.get_bytes("k") == b"old"
        assert objects.head("new") is None
        assert [o.key for o in objects.list("")] == ["k"]  # no temp left behind

    def test_put_bytes_and_get_bytes(self, objects: ObjectStore) -> None:
        objects.put_bytes("a/b.json", b'{"x": 1}')
        assert objects.get_bytes("a/b.json") == b'{"x": 1}'
        objects.put_bytes("a/b.json", b"replaced")
        assert objects.get_bytes("a/b.json") == b"replaced"

    def test_if_absent_is_create_only(self, objects: ObjectStore) -> None:
        objects.put_bytes("job/5/COMMIT", b"first", if_absent=True)
        with pytest.raises(PreconditionFailed):
            objects.put_bytes("job/5/COMMIT", b"second", if_absent=True)
        assert objects.get_bytes("job/5/COMMIT") == b"first"
        assert [o.key for o in objects.list("job/")] == ["job/5/COMMIT"]  # no temp left

    def test_if_absent_refuses_over_an_ordinary_put(self, objects: ObjectStore) -> None:
        objects.put_bytes("k", b"plain")
        with pytest.raises(PreconditionFailed):
            objects.put_bytes("k", b"create-only", if_absent=True)
        assert objects.get_bytes("k") == b"plain"

    def test_the_start_up_probe_creates_one_object_once(self, objects: ObjectStore) -> None:
        """The daemon's probe (``storage.probe``) writes its object create-only: the first
        probe creates it, every later one finds it there, which means writable too."""
        probe(objects)
        probe(objects)
        assert [o.key for o in objects.list("")] == [PROBE_KEY]
        assert objects.get_bytes(PROBE_KEY) == PROBE_BODY

    def test_head(self, objects: ObjectStore) -> None:
        assert objects.head("nothing") is None
        objects.put_bytes("dir/obj", b"12345")
        info = objects.head("dir/obj")
        assert info is not None
        assert (info.key, info.size) == ("dir/obj", 5)
        assert objects.head("dir/ob") is None

    def test_head_of_a_prefix_is_not_an_object(self, objects: ObjectStore) -> None:
        objects.put_bytes("job/5/0-0/f", b"x")
        assert objects.head("job/5") is None
        assert objects.head("job/5/0-0") is None

    def test_list_by_prefix_in_key_order(self, objects: ObjectStore) -> None:
        keys = ["job/2/b", "job/10/a", "job/2/a/x", "job/1/z", "jobx/1/a", "other/1"]
        for i, key in enumerate(keys):
            objects.put_bytes(key, b"x" * i)
        assert [o.key for o in objects.list("job/")] == sorted(k for k in keys if k[:4] == "job/")
        assert [o.key for o in objects.list("job")] == sorted(keys[:5])
        assert [o.key for o in objects.list("job/2/")] == ["job/2/a/x", "job/2/b"]
        assert [o.key for o in objects.list("job/2/a")] == ["job/2/a/x"]
        assert [o.key for o in objects.list("")] == sorted(keys)
        assert list(objects.list("missing/")) == []
        sizes = {o.key: o.size for o in objects.list("")}
        assert sizes == {k: i for i, k in enumerate(keys)}

    def test_list_prefixes_is_one_level_of_directories(self, objects: ObjectStore) -> None:
        keys = ["job/2/b", "job/10/a", "job/2/a/x", "job/1/z", "job/top", "jobx/1/a", "other/1"]
        for key in keys:
            objects.put_bytes(key, b"x")
        assert list(objects.list_prefixes("job/")) == ["job/1/", "job/10/", "job/2/"]
        assert list(objects.list_prefixes("job/1")) == ["job/1/", "job/10/"]
        assert list(objects.list_prefixes("job/2/")) == ["job/2/a/"]
        assert list(objects.list_prefixes("job")) == ["job/", "jobx/"]
        assert list(objects.list_prefixes("")) == ["job/", "jobx/", "other/"]
        assert list(objects.list_prefixes("job/2/a/")) == []
        assert list(objects.list_prefixes("missing/")) == []

    def test_list_prefixes_only_where_objects_are(self, objects: ObjectStore) -> None:
        objects.put_bytes("job/1/a", b"x")
        objects.put_bytes("job/2/deep/a", b"x")
        objects.delete("job/1/a")  # a pruned step: the file store keeps its directory
        assert list(objects.list_prefixes("job/")) == ["job/2/"]

    def test_list_prefixes_never_leaves_the_store(
        self, objects: ObjectStore, tmp_path: Path
    ) -> None:
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "secret").write_bytes(b"secret")
        objects.put_bytes("in/x", b"x")
        for prefix in ("../", "../out", "/", "a//"):
            assert list(objects.list_prefixes(prefix)) == []

    def test_list_skips_temp_files(self, objects: ObjectStore, tmp_path: Path) -> None:
        objects.put_bytes("job/1/a", b"x")
        if isinstance(objects, FileObjectStore):
            # What a writer that crashed mid-put leaves behind.
            (objects.root / "job" / "1" / f"{TMP_PREFIX}1234-b").write_bytes(b"partial")
        assert [o.key for o in objects.list("job/")] == ["job/1/a"]

    def test_delete_is_idempotent(self, objects: ObjectStore) -> None:
        objects.put_bytes("k", b"x")
        objects.delete("k")
        assert objects.head("k") is None
        objects.delete("k")
        objects.delete("never/there")
        with pytest.raises(ObjectNotFound):
            objects.get_bytes("k")

    def test_missing_keys_raise_object_not_found(self, objects: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            objects.get_bytes("nope")
        with pytest.raises(ObjectNotFound):
            list(objects.read_chunks("nope"))
        objects.put_bytes("a", b"x")
        with pytest.raises(ObjectNotFound):
            objects.get_bytes("a/b")  # below an object, not an object
        objects.put_bytes("d/e", b"x")
        with pytest.raises(ObjectNotFound):
            objects.get_bytes("d")  # a prefix, not an object
        assert objects.head("a/b") is None

    @pytest.mark.parametrize(
        "key", ["../x", "/abs", "a//b", "", "a/../b", "./a", "a/", "a/.", "..", "a/.."]
    )
    def test_unsafe_keys_are_refused(self, objects: ObjectStore, key: str, tmp_path: Path) -> None:
        src = tmp_path / "src"
        src.write_bytes(b"x")
        with pytest.raises(ValueError, match="unsafe"):
            objects.put_bytes(key, b"x")
        with pytest.raises(ValueError, match="unsafe"):
            objects.put_bytes(key, b"x", if_absent=True)
        with pytest.raises(ValueError, match="unsafe"):
            objects.put_file(key, src)
        with pytest.raises(ValueError, match="unsafe"):
            objects.get_bytes(key)
        with pytest.raises(ValueError, match="unsafe"):
            list(objects.read_chunks(key))
        with pytest.raises(ValueError, match="unsafe"):
            objects.head(key)
        with pytest.raises(ValueError, match="unsafe"):
            objects.delete(key)
        assert list(objects.list("")) == []

    def test_list_never_leaves_the_store(self, objects: ObjectStore, tmp_path: Path) -> None:
        (tmp_path / "outside").write_bytes(b"secret")
        objects.put_bytes("in", b"x")
        for prefix in ("../", "../out", "/", "a//"):
            assert [o.key for o in objects.list(prefix)] == []


def test_file_store_writes_files_under_its_root(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "bucket")
    store.put_bytes("job/1/COMMIT", b"c", if_absent=True)
    assert (tmp_path / "bucket" / "job" / "1" / "COMMIT").read_bytes() == b"c"
    assert sorted(p.name for p in (tmp_path / "bucket" / "job" / "1").iterdir()) == ["COMMIT"]


def test_file_store_reads_in_chunks_of_the_real_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the real CHUNK: a file bigger than one real chunk
    data = os.urandom(hashing.CHUNK * 2 + 1)
    src = tmp_path / "big"
    src.write_bytes(data)
    store = FileObjectStore(tmp_path / "bucket")
    store.put_file("big", src)
    chunks = list(store.read_chunks("big"))
    assert [len(c) for c in chunks] == [hashing.CHUNK, hashing.CHUNK, 1]
    assert b"".join(chunks) == data


def test_file_store_refuses_a_source_that_grew_while_it_was_put(tmp_path: Path) -> None:
    """Without a crc32c too: the put takes the source's size as it begins, and a byte past
    it at the end fails the put, the key left as it was and no temporary file behind."""
    src = tmp_path / "src"
    src.write_bytes(os.urandom(3 * 1024))
    store = FileObjectStore(tmp_path / "bucket")
    store.put_bytes("k", b"old")

    class GrowsWhileSent:
        """A meter whose first slice is let through after the source grew."""

        def paced(self, data: bytes) -> Iterator[memoryview]:
            with open(src, "ab") as out:
                out.write(b"late")
            yield memoryview(data)

    with pytest.raises(ChecksumMismatch, match="longer than 3072 bytes"):
        store.put_file("k", src, meter=GrowsWhileSent())  # type: ignore[arg-type]
    assert store.get_bytes("k") == b"old"
    assert [o.key for o in store.list("")] == ["k"]
    assert not [p for p in (tmp_path / "bucket").iterdir() if p.name.startswith(TMP_PREFIX)]


# --- open_object_store -------------------------------------------------------------------------


def test_open_file_url(tmp_path: Path) -> None:
    url = (tmp_path / "b").as_uri()
    store = open_object_store(url)
    assert isinstance(store, FileObjectStore)
    assert store.root == tmp_path / "b"
    assert store.url == url
    store.put_bytes("k", b"v")
    assert (tmp_path / "b" / "k").read_bytes() == b"v"


def test_open_file_url_with_localhost_and_escapes(tmp_path: Path) -> None:
    store = open_object_store(f"file://localhost{tmp_path}/with%20space")
    assert isinstance(store, FileObjectStore)
    assert store.root == tmp_path / "with space"


def test_open_plain_absolute_path(tmp_path: Path) -> None:
    store = open_object_store(str(tmp_path / "b"))
    assert isinstance(store, FileObjectStore)
    assert store.root == tmp_path / "b"
    assert store.url == (tmp_path / "b").as_uri()


@pytest.mark.parametrize("url", ["relative/dir", "file://relative/dir", "file:relative", "."])
def test_open_relative_path_is_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="absolute"):
        open_object_store(url)


def test_open_s3_url_does_no_io(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    from mtc_replicator.storage.s3 import S3ObjectStore

    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
    store = open_object_store("s3://bucket/some/prefix/")
    assert isinstance(store, S3ObjectStore)
    assert (store.bucket, store.prefix, store.url) == (
        "bucket",
        "some/prefix/",
        "s3://bucket/some/prefix/",
    )


def test_open_gs_url_does_no_io(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("google.cloud.storage")
    from mtc_replicator.storage.gcs import GcsObjectStore

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent")  # made on first use
    store = open_object_store("gs://bucket")
    assert isinstance(store, GcsObjectStore)
    assert (store.bucket_name, store.prefix, store.url) == ("bucket", "", "gs://bucket")


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("s3://bucket/p", "boto3", "mtc-replicator[s3]"),
        ("gs://bucket/p", "google.cloud", "mtc-replicator[gcs]"),
    ],
)
def test_a_missing_sdk_names_the_extra(
    url: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # None makes the import fail
    monkeypatch.delitem(sys.modules, "mtc_replicator.storage.s3", raising=False)
    monkeypatch.delitem(sys.modules, "mtc_replicator.storage.gcs", raising=False)
    with pytest.raises(ValueError, match=re.escape(extra)):
        open_object_store(url)


@pytest.mark.parametrize(
    ("url", "scheme", "expected"),
    [
        ("s3://b", "s3", ("b", "")),
        ("s3://b/", "s3", ("b", "")),
        ("s3://b/p", "s3", ("b", "p/")),
        ("gs://b/p/q/", "gs", ("b", "p/q/")),
    ],
)
def test_split_bucket_url(url: str, scheme: str, expected: tuple[str, str]) -> None:
    assert split_bucket_url(url, scheme) == expected


@pytest.mark.parametrize(
    "url", ["s3:///prefix", "gs://b/p", "s3://b/../x", "s3://b/p//q", "s3://b/p?x=1", "s3://b#f"]
)
def test_bad_bucket_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match=r"expected|unsafe|query"):
        split_bucket_url(url, "s3")


@pytest.mark.parametrize("url", ["http://example.com/x", "ftp://host/x", "memory://"])
def test_open_unknown_scheme_is_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="unsupported storage URL"):
        open_object_store(url)


# --- the cloud backends' shared transfer helpers (no server needed) ---------------------------


def test_upload_parts_in_order_with_a_bounded_window(tmp_path: Path) -> None:
    src = tmp_path / "src"
    data = os.urandom(10 * 1000 + 1)
    src.write_bytes(data)
    lock = threading.Lock()
    active = peak = 0

    def upload(number: int, part: bytes) -> tuple[int, bytes]:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.01)  # long enough for parts to overlap if the window lets them
        with lock:
            active -= 1
        return number, part

    results, size, crc = upload_parts(src, 1000, 3, upload)
    assert [n for n, _ in results] == list(range(1, 12))
    assert b"".join(p for _, p in results) == data
    assert (size, crc) == (len(data), google_crc32c.value(data))
    assert 1 < peak <= 3


def test_upload_parts_stops_reading_after_a_failure(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom(100 * 1000))
    started: list[int] = []

    def upload(number: int, part: bytes) -> int:
        started.append(number)
        if number == 2:
            raise TransientError("part 2 failed")
        time.sleep(0.005)
        return number

    with pytest.raises(TransientError, match="part 2"):
        upload_parts(src, 1000, 2, upload)
    assert max(started) < 10  # not all 100 parts were read and sent


def test_verified_chunks_resume_and_verify() -> None:
    data = os.urandom(5000)
    failures = [TransientError("reset")]

    def open_at(offset: int) -> Iterator[bytes]:
        for i in range(offset, len(data), 1000):
            if i == 3000 and failures:
                raise failures.pop()
            yield data[i : i + 1000]

    backoff = RetryState(RetryPolicy(first_delay=0.0), lambda e: True, sleep=lambda _: None)
    got = verified_chunks(
        open_at, what="k", size=len(data), crc32c=google_crc32c.value(data), backoff=backoff
    )
    assert b"".join(got) == data
    with pytest.raises(ChecksumMismatch, match="crc32c"):
        list(verified_chunks(open_at, what="k", size=len(data), crc32c=1, backoff=backoff))
    with pytest.raises(ChecksumMismatch, match="5000 bytes"):
        list(verified_chunks(open_at, what="k", size=6000, crc32c=None, backoff=backoff))


def test_a_long_download_resumes_after_each_cut_that_made_progress() -> None:
    """Each stretch without progress has its own deadline and tries, not the whole download.

    A slow stream (its consumer takes 10 s a chunk) runs far past the 30 s deadline and is
    cut more often than the 3 tries allow; every cut came after new bytes, so it resumes.
    """
    data = os.urandom(10_000)
    now = [0.0]
    cut_at = {2000, 4000, 6000, 8000}

    def open_at(offset: int) -> Iterator[bytes]:
        for i in range(offset, len(data), 1000):
            if i in cut_at:
                cut_at.discard(i)
                raise TransientError(f"reset at {i}")
            now[0] += 10.0
            yield data[i : i + 1000]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    backoff = RetryState(
        RetryPolicy(attempts=3, first_delay=1.0, deadline=30.0),
        lambda e: True,
        clock=lambda: now[0],
        sleep=sleep,
    )
    got = verified_chunks(
        open_at, what="k", size=len(data), crc32c=google_crc32c.value(data), backoff=backoff
    )
    assert b"".join(got) == data
    assert now[0] > 100.0


def test_a_download_stuck_at_one_byte_still_gives_up() -> None:
    """Cuts with no bytes between them share one budget: the tries stay bounded."""
    data = os.urandom(5000)
    opened: list[int] = []

    def open_at(offset: int) -> Iterator[bytes]:
        opened.append(offset)
        if offset < 2000:
            yield data[offset : offset + 1000]
        raise TransientError("reset")

    backoff = RetryState(
        RetryPolicy(attempts=3, first_delay=0.0), lambda e: True, sleep=lambda _: None
    )
    with pytest.raises(TransientError, match="reset"):
        list(verified_chunks(open_at, what="k", size=len(data), crc32c=None, backoff=backoff))
    # Two cuts after new bytes, then the 3 tries of a stretch (the cut one included).
    assert opened == [0, 1000, 2000, 2000]


def test_crc32c_wire_form() -> None:
    crc = google_crc32c.value(b"hello")
    assert b64_crc32c(crc32c_b64(crc)) == crc
    assert crc32c_b64(0) == "AAAAAA=="
    for bad in (None, "", "not base64!", "AAAA"):
        assert b64_crc32c(bad) is None
