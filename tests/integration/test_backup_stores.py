"""``BackupStore`` (mtc_replicator/backup.py) on every backend: ``file://``, S3 on moto's server
and GCS on the emulator (behind the proxy that enforces create-only writes, which the
emulator ignores; see ``test_objectstore_contract.py``).

Each fault a backup can meet gives a clear error or a safe fallback, and no restore ever
uses bytes that were not verified: a partial backup is not restorable, and a truncated,
damaged, replaced or missing object makes ``fetch_item`` raise ``CorruptItem``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.core.backup_layout import CommitRecord, commit_key, data_key, manifest_key
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest, ManifestError
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import (
    ChecksumMismatch,
    FileObjectStore,
    ObjectStore,
    PreconditionFailed,
    SmallFilesSideBySide,
)
from tests.flight import Flight
from tests.integration.test_objectstore_contract import (
    GCS_PART,
    S3_PART,
    gcs_store,
    s3_store,
)
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Request,
    Rule,
    corrupt_reply,
    fault_proxy,
    gcs_create_only,
)

JOB = "job"
STEP = 100
DIR_ITEM = ItemId(JOB, STEP, 0, 0)
FILE_ITEM = ItemId(JOB, STEP, 1, 0)
BIG = {"file": S3_PART + 1, "s3": S3_PART + 12345, "gcs": GCS_PART * 3 + 7}
"""A file of several parts on each backend."""


@pytest.fixture(params=["file", "s3", "gcs"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def proxy(
    backend: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[FaultProxy | None]:
    """The proxy every request of the cloud backends passes (None for file://)."""
    if backend == "file":
        yield None
        return
    bucket: Bucket = request.getfixturevalue(f"{backend}_bucket")
    # Create-only writes as GCS does them (the emulator ignores them); S3's are moto's own.
    rules: list[Rule] = [gcs_create_only] if backend == "gcs" else []
    with fault_proxy(bucket.endpoint, rules) as p:
        variable = "AWS_ENDPOINT_URL_S3" if backend == "s3" else "STORAGE_EMULATOR_HOST"
        monkeypatch.setenv(variable, p.url)
        yield p


OpenStore = Callable[[], ObjectStore]


@pytest.fixture
def open_store(
    backend: str, proxy: FaultProxy | None, request: pytest.FixtureRequest, tmp_path: Path
) -> OpenStore:
    """``open_store()``: a writer's own handle on the backup location (through ``proxy``)."""

    def make() -> ObjectStore:
        if backend == "file":
            return FileObjectStore(tmp_path / "bucket")
        bucket: Bucket = request.getfixturevalue(f"{backend}_bucket")
        return s3_store(bucket.url) if backend == "s3" else gcs_store(bucket.url)

    return make


@pytest.fixture
def backup(open_store: OpenStore) -> BackupStore:
    return BackupStore(open_store())


def make_items(root: Path, big: int) -> tuple[Path, Path]:
    """A directory item (a multipart file, a small one, an empty one, an empty dir) and a
    file item."""
    d = root / "dir-item"
    (d / "state" / "shards").mkdir(parents=True)
    (d / "empty-dir").mkdir()
    (d / "state" / "shards" / "big").write_bytes(os.urandom(big))
    (d / "_CHECKPOINT_METADATA").write_bytes(b'{"step": 100}')
    (d / "state" / "zero").write_bytes(b"")
    f = root / "file-item"
    f.write_bytes(os.urandom(big // 2 + 3))
    return d, f


class Uploaded:
    """Two items of one step, uploaded and committed."""

    def __init__(self, backup: BackupStore, root: Path, big: int) -> None:
        self.backup = backup
        self.dir_data, self.file_data = make_items(root, big)
        self.dir_manifest = build_manifest(DIR_ITEM, self.dir_data)
        self.file_manifest = build_manifest(FILE_ITEM, self.file_data)
        backup.upload_item(self.dir_manifest, self.dir_data)
        backup.upload_item(self.file_manifest, self.file_data)
        record = backup.try_commit(JOB, STEP, ["0-0", "1-0"], now=1234.5)
        assert record is not None
        self.record = record
        self.staging = root / "staging"
        self.staging.mkdir()

    def fetch(self, item: ItemId) -> Manifest:
        staged = self.staging / str(len(list(self.staging.iterdir())))
        staged.mkdir()
        return self.backup.fetch_item(self.record, item, staged)


@pytest.fixture
def uploaded(backup: BackupStore, backend: str, tmp_path: Path) -> Uploaded:
    return Uploaded(backup, tmp_path, BIG[backend])


def replace(objects: ObjectStore, key: str, change: Callable[[bytes], bytes]) -> None:
    objects.put_bytes(key, change(objects.get_bytes(key)))


def flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[len(out) // 2] ^= 0x80
    return bytes(out)


# --- the happy path ----------------------------------------------------------------------------


def test_round_trip_of_multipart_items(uploaded: Uploaded, tmp_path: Path) -> None:
    backup = uploaded.backup
    assert backup.committed_steps(JOB) == {STEP: uploaded.record}
    for item, data, manifest in [
        (DIR_ITEM, uploaded.dir_data, uploaded.dir_manifest),
        (FILE_ITEM, uploaded.file_data, uploaded.file_manifest),
    ]:
        staged = tmp_path / f"restore-{item.key}"
        staged.mkdir()
        assert backup.fetch_item(uploaded.record, item, staged) == manifest
        verify_item(manifest, staged / "data")
        for entry in manifest.files:
            source = data / entry.path if entry.path else data
            target = staged / "data" / entry.path if entry.path else staged / "data"
            assert target.read_bytes() == source.read_bytes()
    assert (tmp_path / "restore-0-0" / "data" / "empty-dir").is_dir()
    keys = [o.key for o in backup.objects.list(f"{JOB}/")]
    assert keys == [  # layout v2: each item below two hex digits of its key's sha256
        "job/100/22/0-0.manifest.json",
        "job/100/22/0-0/_CHECKPOINT_METADATA",
        "job/100/22/0-0/state/shards/big",
        "job/100/22/0-0/state/zero",
        "job/100/COMMIT",
        "job/100/a3/1-0.manifest.json",
        "job/100/a3/1-0/data",
    ]


def test_an_item_of_many_files_round_trips_with_its_small_files_side_by_side(
    backup: BackupStore, backend: str, tmp_path: Path
) -> None:
    data = tmp_path / "many"
    data.mkdir()
    for i in range(24):
        (data / f"shard_{i:02}").write_bytes(os.urandom(1000 + i))
    (data / "big").write_bytes(os.urandom(BIG[backend]))
    manifest = build_manifest(DIR_ITEM, data)
    objects = backup.objects
    cloud = backend != "file"  # a filesystem copies ranges instead (test_backup_parallel.py)
    puts, gets = Flight(2), Flight(2)  # each first call waits for a second to begin
    if cloud:
        assert isinstance(objects, SmallFilesSideBySide)
        real_put, real_read = objects.put_file, objects.read_chunks

        def put_file(key: str, src: Path, **kwargs: Any) -> None:
            with puts.call(key):
                real_put(key, src, **kwargs)

        files = {data_key(DIR_ITEM, entry.path) for entry in manifest.files}

        def read_chunks(key: str) -> Iterator[bytes]:
            if key not in files:  # the COMMIT and the manifest, read before any file
                yield from real_read(key)
                return
            with gets.call(key):
                yield from real_read(key)

        objects.put_file = put_file  # type: ignore[method-assign]
        objects.read_chunks = read_chunks  # type: ignore[method-assign]
    backup.upload_item(manifest, data)
    if cloud:
        assert 2 <= puts.most <= objects.small_file_workers()
    record = backup.try_commit(JOB, STEP, ["0-0"])
    assert record is not None
    staged = tmp_path / "restored"
    staged.mkdir()
    assert backup.fetch_item(record, DIR_ITEM, staged) == manifest
    verify_item(manifest, staged / "data")
    if cloud:
        assert 2 <= gets.most <= objects.small_file_workers()


# --- commits ---------------------------------------------------------------------------------


def test_two_writers_never_replace_a_commit(uploaded: Uploaded, open_store: OpenStore) -> None:
    other = BackupStore(open_store())
    before = uploaded.backup.objects.get_bytes(commit_key(JOB, STEP))
    late = CommitRecord(JOB, STEP, dict(uploaded.record.items), created=9999.0)
    with pytest.raises(PreconditionFailed):
        other.objects.put_bytes(commit_key(JOB, STEP), late.to_json(), if_absent=True)
    assert other.try_commit(JOB, STEP, ["0-0", "1-0"], now=9999.0) == uploaded.record
    assert other.objects.get_bytes(commit_key(JOB, STEP)) == before


def test_partial_backup_without_commit_is_not_restorable(
    backup: BackupStore, backend: str, tmp_path: Path
) -> None:
    dir_data, _ = make_items(tmp_path, BIG[backend])
    backup.upload_item(build_manifest(DIR_ITEM, dir_data), dir_data)  # rank 1 never uploads
    assert backup.try_commit(JOB, STEP, ["0-0", "1-0"]) is None
    assert backup.read_commit(JOB, STEP) is None
    assert backup.committed_steps(JOB) == {}
    assert backup.objects.head(commit_key(JOB, STEP)) is None


def test_a_source_changed_after_its_manifest_is_not_uploaded(
    backup: BackupStore, backend: str, tmp_path: Path
) -> None:
    dir_data, _ = make_items(tmp_path, BIG[backend])
    manifest = build_manifest(DIR_ITEM, dir_data)
    big = dir_data / "state" / "shards" / "big"
    big.write_bytes(flip(big.read_bytes()))  # the writer was not done after all
    with pytest.raises(ChecksumMismatch, match="changed"):
        backup.upload_item(manifest, dir_data)
    assert backup.objects.head(data_key(DIR_ITEM, "state/shards/big")) is None
    assert backup.objects.head(manifest_key(DIR_ITEM)) is None


@pytest.mark.parametrize("swapped", ["state/shards/big", "_CHECKPOINT_METADATA"])
def test_a_source_swapped_for_a_fifo_is_refused_not_waited_on(
    backup: BackupStore, backend: str, tmp_path: Path, swapped: str
) -> None:
    # A pod that still holds a directory of the data it handed over can put a FIFO where a
    # file was: an upload must refuse it at once (an open of a FIFO waits for a writer).
    dir_data, _ = make_items(tmp_path, BIG[backend])
    manifest = build_manifest(DIR_ITEM, dir_data)
    (dir_data / swapped).unlink()
    os.mkfifo(dir_data / swapped)
    raised: list[BaseException] = []

    def upload() -> None:
        try:
            backup.upload_item(manifest, dir_data)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=upload, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the upload waits on the FIFO"
    assert len(raised) == 1
    assert isinstance(raised[0], ManifestError | ChecksumMismatch), raised[0]
    assert backup.objects.head(data_key(DIR_ITEM, swapped)) is None
    assert backup.objects.head(manifest_key(DIR_ITEM)) is None


# --- what a restore must refuse --------------------------------------------------------------


def test_commit_naming_a_missing_object(uploaded: Uploaded) -> None:
    uploaded.backup.objects.delete(data_key(DIR_ITEM, "state/shards/big"))
    with pytest.raises(CorruptItem, match="missing"):
        uploaded.fetch(DIR_ITEM)
    uploaded.backup.objects.delete(manifest_key(FILE_ITEM))
    with pytest.raises(CorruptItem, match="missing"):
        uploaded.fetch(FILE_ITEM)


def test_truncated_object(uploaded: Uploaded) -> None:
    replace(uploaded.backup.objects, data_key(FILE_ITEM, ""), lambda b: b[:-1])
    with pytest.raises(CorruptItem, match="does not match its manifest"):
        uploaded.fetch(FILE_ITEM)


def test_corrupted_object(uploaded: Uploaded) -> None:
    replace(uploaded.backup.objects, data_key(DIR_ITEM, "state/shards/big"), flip)
    with pytest.raises(CorruptItem, match="state/shards/big"):
        uploaded.fetch(DIR_ITEM)


def test_object_and_manifest_modified_after_commit(uploaded: Uploaded, tmp_path: Path) -> None:
    """A consistent replacement (new bytes and a manifest that matches them) is caught by
    the manifest digest the COMMIT pinned."""
    objects = uploaded.backup.objects
    evil = tmp_path / "evil"
    evil.write_bytes(b"evil")
    objects.put_bytes(data_key(FILE_ITEM, ""), b"evil")
    objects.put_bytes(manifest_key(FILE_ITEM), build_manifest(FILE_ITEM, evil).to_json())
    with pytest.raises(CorruptItem, match="modified after its COMMIT"):
        uploaded.fetch(FILE_ITEM)


def test_bytes_damaged_on_the_way_down(
    uploaded: Uploaded, backend: str, proxy: FaultProxy | None
) -> None:
    """The store's own checksum catches what arrives damaged; fetch_item says CorruptItem."""
    if proxy is None:
        pytest.skip("file:// has no network to damage bytes on")

    def big_object_read(req: Request) -> bool:
        return req.method == "GET" and (
            "0-0/state/shards/big" in req.path
            or ("0-0%2Fstate%2Fshards%2Fbig" in req.path and "alt=media" in req.path)
        )

    proxy.reply_rules.append(corrupt_reply(times=None, match=big_object_read))
    with pytest.raises(CorruptItem, match="crc32c"):
        uploaded.fetch(DIR_ITEM)
    assert uploaded.fetch(FILE_ITEM) == uploaded.file_manifest  # other objects are fine
