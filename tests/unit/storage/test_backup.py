"""Tests for ``mtc_replicator.storage.backup.BackupStore`` on the in-memory and the file object
stores.

Uploads, create-only commits, listing and verified downloads; every way a backup object
can differ from what its COMMIT pinned must surface as ``CorruptItem``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import (
    LAYOUT_V1,
    CommitRecord,
    commit_key,
    data_key,
    manifest_key,
    shard,
)
from mtc_replicator.core.manifest import CorruptItem, ItemId, ItemKind, Manifest, ManifestError
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.storage.backup import LEFTOVER_SKEW, BackupStore
from mtc_replicator.storage.objectstore import (
    FileObjectStore,
    IncompleteUpload,
    MemoryObjectStore,
    ObjectInfo,
    ObjectStore,
    PermissionDenied,
    PreconditionFailed,
)
from tests.forge import same_crc32c

JOB = "job"
DIR_ITEM = ItemId(JOB, 100, 0, 0)
FILE_ITEM = ItemId(JOB, 100, 1, 0)

BACKENDS: dict[str, Callable[[Path], ObjectStore]] = {
    "file": lambda tmp: FileObjectStore(tmp / "bucket"),
    "memory": lambda tmp: MemoryObjectStore(),
}


@pytest.fixture(params=sorted(BACKENDS))
def backup(request: pytest.FixtureRequest, tmp_path: Path) -> BackupStore:
    return BackupStore(BACKENDS[request.param](tmp_path))


def make_dir_item(path: Path) -> Path:
    (path / "state" / "d").mkdir(parents=True)
    (path / "empty").mkdir()
    (path / "_CHECKPOINT_METADATA").write_bytes(b'{"step": 100}')
    (path / "state" / "d" / "chunk").write_bytes(os.urandom(3000))
    (path / "state" / "zero").write_bytes(b"")
    return path


def make_file_item(path: Path) -> Path:
    path.write_bytes(os.urandom(5000))
    return path


class Uploaded:
    """Two items of one step, uploaded and committed."""

    def __init__(self, backup: BackupStore, tmp_path: Path) -> None:
        self.dir_data = make_dir_item(tmp_path / "src-dir")
        self.file_data = make_file_item(tmp_path / "src-file")
        self.dir_manifest = build_manifest(DIR_ITEM, self.dir_data)
        self.file_manifest = build_manifest(FILE_ITEM, self.file_data)
        backup.upload_item(self.dir_manifest, self.dir_data)
        backup.upload_item(self.file_manifest, self.file_data)
        record = backup.try_commit(JOB, 100, ["0-0", "1-0"], now=1234.5)
        assert record is not None
        self.record = record
        self.staging = tmp_path / "staging"
        self.staging.mkdir()

    def fresh_staging(self) -> Path:
        path = self.staging / str(len(list(self.staging.iterdir())))
        path.mkdir()
        return path


@pytest.fixture
def uploaded(backup: BackupStore, tmp_path: Path) -> Uploaded:
    return Uploaded(backup, tmp_path)


def flip_object_byte(objects: ObjectStore, key: str, offset: int) -> None:
    data = bytearray(objects.get_bytes(key))
    data[offset] ^= 0x80
    objects.put_bytes(key, bytes(data))


# --- round trip ---------------------------------------------------------------------------------


def test_upload_commit_list_fetch_round_trip(backup: BackupStore, uploaded: Uploaded) -> None:
    record = uploaded.record
    assert record.job == JOB
    assert record.step == 100
    assert record.created == 1234.5
    assert record.items == {
        "0-0": uploaded.dir_manifest.digest,
        "1-0": uploaded.file_manifest.digest,
    }
    assert backup.committed_steps(JOB) == {100: record}
    assert backup.read_commit(JOB, 100) == record

    staged = uploaded.fresh_staging()
    got = backup.fetch_item(record, DIR_ITEM, staged)
    assert got == uploaded.dir_manifest
    verify_item(got, staged / "data")
    assert (staged / "data" / "empty").is_dir()  # empty dirs survive the trip
    for entry in got.files:
        assert (staged / "data" / entry.path).read_bytes() == (
            uploaded.dir_data / entry.path
        ).read_bytes()

    staged = uploaded.fresh_staging()
    got = backup.fetch_item(record, FILE_ITEM, staged)
    assert got.kind is ItemKind.FILE
    assert (staged / "data").read_bytes() == uploaded.file_data.read_bytes()


def test_layout_in_the_bucket(backup: BackupStore, uploaded: Uploaded) -> None:
    keys = [o.key for o in backup.objects.list(f"{JOB}/")]
    # Layout v2: each item below two hex digits of its key's sha256.
    assert keys == [
        "job/100/22/0-0.manifest.json",
        "job/100/22/0-0/_CHECKPOINT_METADATA",
        "job/100/22/0-0/state/d/chunk",
        "job/100/22/0-0/state/zero",
        "job/100/COMMIT",
        "job/100/a3/1-0.manifest.json",
        "job/100/a3/1-0/data",
    ]
    assert uploaded.record.layout == 2
    assert json.loads(backup.objects.get_bytes(commit_key(JOB, 100)))["layout"] == 2
    assert backup.objects.get_bytes(manifest_key(DIR_ITEM)) == uploaded.dir_manifest.to_json()


def test_commit_record_json_round_trip(uploaded: Uploaded) -> None:
    assert CommitRecord.from_json(uploaded.record.to_json()) == uploaded.record


# --- committing ---------------------------------------------------------------------------------


def test_try_commit_waits_for_every_item(backup: BackupStore, tmp_path: Path) -> None:
    items = [ItemId(JOB, 7, rank, 0) for rank in range(3)]
    keys = [i.key for i in items]
    manifests = []
    for item in items:
        data = make_file_item(tmp_path / f"src-{item.rank}")
        manifests.append((build_manifest(item, data), data))
    # Ranks upload at their own pace; the coordinator polls.
    for manifest, data in manifests[:2]:
        backup.upload_item(manifest, data)
        assert backup.try_commit(JOB, 7, keys) is None
        assert backup.objects.head(commit_key(JOB, 7)) is None
        assert backup.committed_steps(JOB) == {}
    backup.upload_item(*manifests[2])
    record = backup.try_commit(JOB, 7, keys)
    assert record is not None
    assert set(record.items) == set(keys)
    assert backup.committed_steps(JOB) == {7: record}


@pytest.mark.parametrize("step", ["²", "\u0661\u0662"])
def test_a_commit_under_a_non_ascii_digit_step_is_ignored(
    backup: BackupStore, uploaded: Uploaded, step: str
) -> None:
    """A bucket writer's ``job/²/COMMIT``: ``"²".isdigit()`` is true and ``int("²")`` fails;
    the listing skips it instead of failing every restore."""
    before = backup.committed_steps(uploaded.record.job)
    backup.objects.put_bytes(f"{uploaded.record.job}/{step}/COMMIT", uploaded.record.to_json())
    assert backup.committed_steps(uploaded.record.job) == before


def test_try_commit_never_overwrites_commit(backup: BackupStore, uploaded: Uploaded) -> None:
    before = backup.objects.get_bytes(commit_key(JOB, 100))
    again = backup.try_commit(JOB, 100, ["0-0"], now=9999.0)
    assert again == uploaded.record
    assert backup.objects.get_bytes(commit_key(JOB, 100)) == before


def test_racing_commit_returns_the_winner(backup: BackupStore, tmp_path: Path) -> None:
    data = make_file_item(tmp_path / "f")
    item = ItemId(JOB, 8, 0, 0)
    manifest = build_manifest(item, data)
    backup.upload_item(manifest, data)
    winner = CommitRecord(JOB, 8, {"0-0": manifest.digest}, created=1.0)
    real_read = backup.read_commit
    calls: list[int] = []

    def read_commit_after_the_race(job: str, step: int) -> CommitRecord | None:
        # The first read (before writing) finds nothing; another writer commits right after.
        if not calls:
            calls.append(1)
            backup.objects.put_bytes(commit_key(job, step), winner.to_json(), if_absent=True)
            return None
        return real_read(job, step)

    backup.read_commit = read_commit_after_the_race  # type: ignore[method-assign]
    assert backup.try_commit(JOB, 8, ["0-0"], now=2.0) == winner
    assert CommitRecord.from_json(backup.objects.get_bytes(commit_key(JOB, 8))) == winner


def test_upload_after_commit_is_refused(backup: BackupStore, uploaded: Uploaded) -> None:
    manifest_before = backup.objects.get_bytes(manifest_key(DIR_ITEM))
    other = make_dir_item(uploaded.staging / "other")
    with pytest.raises(PreconditionFailed):
        backup.upload_item(build_manifest(DIR_ITEM, other), other)
    assert backup.objects.get_bytes(manifest_key(DIR_ITEM)) == manifest_before


def test_upload_before_commit_may_be_repeated(backup: BackupStore, tmp_path: Path) -> None:
    data = make_dir_item(tmp_path / "d")
    manifest = build_manifest(DIR_ITEM, data)
    backup.upload_item(manifest, data)
    backup.upload_item(manifest, data)
    record = backup.try_commit(JOB, 100, ["0-0"])
    assert record is not None
    staged = tmp_path / "staged"
    staged.mkdir()
    assert backup.fetch_item(record, DIR_ITEM, staged) == manifest


def test_step_without_commit_is_not_listed(backup: BackupStore, tmp_path: Path) -> None:
    data = make_file_item(tmp_path / "f")
    backup.upload_item(build_manifest(ItemId(JOB, 5, 0, 0), data), data)
    assert backup.committed_steps(JOB) == {}
    assert backup.read_commit(JOB, 5) is None


def test_committed_steps_of_one_job_only(backup: BackupStore, tmp_path: Path) -> None:
    data = make_file_item(tmp_path / "f")
    for job, step in [("job", 1), ("job", 20), ("job2", 3), ("jo", 4)]:
        item = ItemId(job, step, 0, 0)
        backup.upload_item(build_manifest(item, data), data)
        assert backup.try_commit(job, step, ["0-0"]) is not None
    assert sorted(backup.committed_steps("job")) == [1, 20]
    assert sorted(backup.committed_steps("job2")) == [3]
    assert backup.committed_steps("none") == {}


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"not json", id="not JSON"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'{"job": "job", "step": 6, "items": {}}', id="no timestamp"),
        pytest.param(
            b'{"job": "job", "step": 6, "items": {"0-0": "nothex"}, "created": 1}',
            id="bad digest",
        ),
        pytest.param(
            b'{"job": "job", "step": 6, "items": {"../x": "' + b"0" * 64 + b'"}, "created": 1}',
            id="bad item key",
        ),
        pytest.param(b'{"job": "job", "step": 7, "items": {}, "created": 1}', id="wrong step"),
        pytest.param(b'{"job": "other", "step": 6, "items": {}, "created": 1}', id="wrong job"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply nested"),
    ],
)
def test_garbage_commit_is_skipped_with_a_warning(
    backup: BackupStore, uploaded: Uploaded, garbage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    backup.objects.put_bytes(commit_key(JOB, 6), garbage)
    with caplog.at_level(logging.WARNING, logger="mtc_replicator.storage.backup"):
        steps = backup.committed_steps(JOB)
    assert steps == {100: uploaded.record}
    assert any("job/6/COMMIT" in r.getMessage() for r in caplog.records)
    with pytest.raises(ManifestError):
        backup.read_commit(JOB, 6)


# --- verified download ---------------------------------------------------------------------------


def test_fetch_detects_a_flipped_byte(backup: BackupStore, uploaded: Uploaded) -> None:
    flip_object_byte(backup.objects, data_key(DIR_ITEM, "state/d/chunk"), 1500)
    with pytest.raises(CorruptItem, match="state/d/chunk"):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_flipped_byte_in_a_file_item(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    flip_object_byte(backup.objects, data_key(FILE_ITEM, ""), 0)
    with pytest.raises(CorruptItem, match="data"):
        backup.fetch_item(uploaded.record, FILE_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_truncated_object(backup: BackupStore, uploaded: Uploaded) -> None:
    key = data_key(DIR_ITEM, "state/d/chunk")
    backup.objects.put_bytes(key, backup.objects.get_bytes(key)[:-1])
    with pytest.raises(CorruptItem, match="size 2999"):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())


def test_fetch_detects_an_extended_object(backup: BackupStore, uploaded: Uploaded) -> None:
    key = data_key(FILE_ITEM, "")
    backup.objects.put_bytes(key, backup.objects.get_bytes(key) + b"tail")
    with pytest.raises(CorruptItem):
        backup.fetch_item(uploaded.record, FILE_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_missing_object(backup: BackupStore, uploaded: Uploaded) -> None:
    backup.objects.delete(data_key(DIR_ITEM, "state/zero"))
    with pytest.raises(CorruptItem, match="missing"):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_missing_manifest(backup: BackupStore, uploaded: Uploaded) -> None:
    backup.objects.delete(manifest_key(FILE_ITEM))
    with pytest.raises(CorruptItem, match="missing"):
        backup.fetch_item(uploaded.record, FILE_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_manifest_modified_after_commit(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    # A valid manifest that also matches a modified object: only the pinned digest catches it.
    key = data_key(FILE_ITEM, "")
    backup.objects.put_bytes(key, b"evil")
    evil = uploaded.staging / "evil"
    evil.write_bytes(b"evil")
    backup.objects.put_bytes(manifest_key(FILE_ITEM), build_manifest(FILE_ITEM, evil).to_json())
    with pytest.raises(CorruptItem, match="modified after its COMMIT"):
        backup.fetch_item(uploaded.record, FILE_ITEM, uploaded.fresh_staging())


def test_fetch_detects_a_manifest_naming_another_item(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    # The file item's manifest copied over the dir item's: valid, but not this item's.
    backup.objects.put_bytes(
        manifest_key(DIR_ITEM), backup.objects.get_bytes(manifest_key(FILE_ITEM))
    )
    with pytest.raises(CorruptItem):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())


def test_fetch_detects_an_unparsable_manifest(backup: BackupStore, uploaded: Uploaded) -> None:
    raw = json.loads(backup.objects.get_bytes(manifest_key(DIR_ITEM)))
    raw["files"][0][0] = "../../escape"
    backup.objects.put_bytes(manifest_key(DIR_ITEM), json.dumps(raw).encode())
    staged = uploaded.fresh_staging()
    with pytest.raises(CorruptItem, match="invalid"):
        backup.fetch_item(uploaded.record, DIR_ITEM, staged)
    assert list(staged.iterdir()) == []  # nothing touched the disk


def test_fetch_of_an_item_not_in_the_commit(backup: BackupStore, uploaded: Uploaded) -> None:
    for item in (ItemId(JOB, 100, 2, 0), ItemId(JOB, 99, 0, 0), ItemId("other", 100, 0, 0)):
        with pytest.raises(CorruptItem, match="not in the committed backup"):
            backup.fetch_item(uploaded.record, item, uploaded.fresh_staging())


def test_fetch_refuses_a_manifest_the_commit_does_not_pin(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    """An item uploaded after the COMMIT cannot sneak into it."""
    data = make_file_item(uploaded.staging / "late")
    late = ItemId(JOB, 100, 2, 0)
    backup.objects.put_bytes(manifest_key(late), build_manifest(late, data).to_json())
    backup.objects.put_file(data_key(late, ""), data)
    with pytest.raises(CorruptItem):
        backup.fetch_item(uploaded.record, late, uploaded.fresh_staging())


def test_an_empty_manifest_is_not_trusted(backup: BackupStore, uploaded: Uploaded) -> None:
    manifest = Manifest.from_json(backup.objects.get_bytes(manifest_key(DIR_ITEM)))
    assert manifest == uploaded.dir_manifest
    backup.objects.put_bytes(manifest_key(DIR_ITEM), b"")
    with pytest.raises(CorruptItem):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())


@pytest.mark.parametrize(
    "created", ["1" + "0" * 400, "NaN", "Infinity", "-Infinity", "true", '"now"'], ids=repr
)
def test_a_commit_with_a_hostile_timestamp_is_a_manifest_error(created: str) -> None:
    raw = f'{{"job": "{JOB}", "step": 1, "items": {{}}, "created": {created}}}'.encode()
    with pytest.raises(ManifestError, match="bad timestamp"):
        CommitRecord.from_json(raw)


# --- requests per listing and per fetch; layout v1 --------------------------------------------


class CountingStore(MemoryObjectStore):
    """A memory store that counts what a caller asked of it: listings and object reads."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.calls.append(("list", prefix))
        yield from super().list(prefix)

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        self.calls.append(("list_prefixes", prefix))
        yield from super().list_prefixes(prefix)

    def get_bytes(self, key: str) -> bytes:
        self.calls.append(("get", key))
        return super().get_bytes(key)

    def read_chunks(self, key: str) -> Iterator[bytes]:
        self.calls.append(("get", key))
        yield super().get_bytes(key)  # the base streams through get_bytes: count once


def upload_files(backup: BackupStore, tmp_path: Path, step: int, ranks: int) -> CommitRecord:
    keys = []
    for rank in range(ranks):
        item = ItemId(JOB, step, rank, 0)
        data = make_file_item(tmp_path / f"src-{step}-{rank}")
        backup.upload_item(build_manifest(item, data), data)
        keys.append(item.key)
    record = backup.try_commit(JOB, step, keys)
    assert record is not None
    return record


@pytest.mark.parametrize("ranks", [2, 40])
def test_listing_committed_steps_costs_the_same_at_any_number_of_items(
    tmp_path: Path, ranks: int
) -> None:
    """One delimiter listing of ``<job>/`` and one COMMIT read per step: never a walk over
    every object of every step (which grows with ranks x files x steps)."""
    objects = CountingStore()
    backup = BackupStore(objects)
    records = {step: upload_files(backup, tmp_path, step, ranks) for step in (10, 20, 30)}
    objects.put_bytes(f"{JOB}/40/{shard('0-0')}/0-0.manifest.json", b"{}")  # still uploading
    objects.calls.clear()
    assert backup.committed_steps(JOB) == records
    assert objects.calls == [
        ("list_prefixes", f"{JOB}/"),
        *(("get", commit_key(JOB, step)) for step in (10, 20, 30, 40)),
    ]


def test_fetch_pinned_reads_the_manifest_and_the_data_only(tmp_path: Path) -> None:
    """What a restoring rank asks of the bucket, given the plan's digest: the item's
    manifest and its files, no listing and no COMMIT."""
    objects = CountingStore()
    backup = BackupStore(objects)
    uploaded = Uploaded(backup, tmp_path)
    objects.calls.clear()
    got = backup.fetch_pinned(DIR_ITEM, uploaded.dir_manifest.digest, uploaded.fresh_staging())
    assert got == uploaded.dir_manifest
    assert objects.calls == [
        ("get", manifest_key(DIR_ITEM)),
        *(("get", data_key(DIR_ITEM, e.path)) for e in uploaded.dir_manifest.files),
    ]


def test_fetch_pinned_refuses_what_the_plan_did_not_pin(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    before = {o.key: backup.objects.get_bytes(o.key) for o in backup.objects.list("")}
    with pytest.raises(CorruptItem, match="modified after its COMMIT"):
        backup.fetch_pinned(DIR_ITEM, "0" * 64, uploaded.fresh_staging())
    # Another item's genuine manifest, under this item's digest: its item id differs.
    with pytest.raises(CorruptItem, match="modified after its COMMIT"):
        backup.fetch_pinned(FILE_ITEM, uploaded.dir_manifest.digest, uploaded.fresh_staging())
    with pytest.raises(CorruptItem, match="missing"):
        backup.fetch_pinned(ItemId(JOB, 100, 7, 0), "0" * 64, uploaded.fresh_staging())
    flip_object_byte(backup.objects, data_key(FILE_ITEM, ""), 0)
    with pytest.raises(CorruptItem, match="does not match"):
        backup.fetch_pinned(FILE_ITEM, uploaded.file_manifest.digest, uploaded.fresh_staging())
    after = {o.key: backup.objects.get_bytes(o.key) for o in backup.objects.list("")}
    assert after.keys() == before.keys(), "a refused fetch deletes nothing"
    assert {k: v for k, v in after.items() if k != data_key(FILE_ITEM, "")} == {
        k: v for k, v in before.items() if k != data_key(FILE_ITEM, "")
    }


def upload_v1(backup: BackupStore, tmp_path: Path, step: int) -> CommitRecord:
    """A step as versions before layout v2 wrote it, by hand: no ``<hh>/``, no ``layout``."""
    keys = {}
    for item, data in (
        (ItemId(JOB, step, 0, 0), make_dir_item(tmp_path / f"v1-{step}-dir")),
        (ItemId(JOB, step, 1, 0), make_file_item(tmp_path / f"v1-{step}-file")),
    ):
        manifest = build_manifest(item, data)
        for entry in manifest.files:
            src = data / entry.path if entry.path else data
            backup.objects.put_file(data_key(item, entry.path, LAYOUT_V1), src)
        backup.objects.put_bytes(manifest_key(item, LAYOUT_V1), manifest.to_json())
        keys[item.key] = manifest.digest
    record = CommitRecord(JOB, step, keys, 1.0, LAYOUT_V1)
    backup.objects.put_bytes(commit_key(JOB, step), record.to_json(), if_absent=True)
    return record


def test_a_v1_backup_still_lists_and_restores(
    backup: BackupStore, uploaded: Uploaded, tmp_path: Path
) -> None:
    old = upload_v1(backup, tmp_path, 50)
    assert b"layout" not in backup.objects.get_bytes(commit_key(JOB, 50))
    assert backup.committed_steps(JOB) == {50: old, 100: uploaded.record}
    for item in (ItemId(JOB, 50, 0, 0), ItemId(JOB, 50, 1, 0)):
        by_record = backup.fetch_item(old, item, uploaded.fresh_staging())
        staged = uploaded.fresh_staging()
        by_digest = backup.fetch_pinned(item, old.items[item.key], staged)
        assert by_record == by_digest
        verify_item(by_digest, staged / "data")


def test_a_download_is_a_restore_for_the_pacer(backup: BackupStore, uploaded: Uploaded) -> None:
    """While it downloads, this node's uploads trickle (a restore is idle GPUs), and nothing
    it reads is booked against the rate limit."""
    seen: list[int] = []
    objects = backup.objects
    read_chunks = objects.read_chunks

    def watched(key: str) -> Iterator[bytes]:
        seen.append(backup.pacer.active(Traffic.RESTORE))
        yield from read_chunks(key)

    objects.read_chunks = watched  # type: ignore[method-assign]
    backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())
    assert seen
    assert set(seen) == {1}
    assert backup.pacer.active(Traffic.RESTORE) == 0
    assert backup.pacer.sent[Traffic.RESTORE] == 0


# --- uploads a killed daemon left ----------------------------------------------------------


class WithUploads(MemoryObjectStore):
    """An in-memory store that also keeps incomplete multipart uploads, as S3 does."""

    def __init__(self, keys: list[str], *, denied: bool = False) -> None:
        super().__init__()
        self.uploads = [IncompleteUpload(k, f"id-{i}", 0.0) for i, k in enumerate(keys)]
        self.denied = denied

    def incomplete_uploads(self, prefix: str) -> Iterator[IncompleteUpload]:
        if self.denied:
            raise PermissionDenied("list multipart uploads: 403 AccessDenied")
        return iter([u for u in self.uploads if u.key.startswith(prefix)])

    def abort_upload(self, upload: IncompleteUpload) -> None:
        self.uploads.remove(upload)


def test_only_the_ranks_own_leftover_uploads_are_aborted() -> None:
    own = [data_key(ItemId("j", 4, 1, 0), "a"), data_key(ItemId("j", 9, 1, 0), "", LAYOUT_V1)]
    others = [
        data_key(ItemId("j", 4, 2, 0), "a"),  # another rank's, maybe under way
        data_key(ItemId("k", 4, 1, 0), "a"),  # another job's
        "j/4/COMMIT",
    ]
    objects = WithUploads([*own, *others])
    assert BackupStore(objects).abort_leftover_uploads("j", {"1-0"}) == 2
    assert [u.key for u in objects.uploads] == others


def test_uploads_begun_after_this_daemon_started_are_never_aborted() -> None:
    """During a reschedule the old node's daemon may still upload the same items: only
    uploads begun before this store started (less a clock-skew margin) are leftovers."""
    key = data_key(ItemId("j", 4, 1, 0), "a")
    started = time.time()
    objects = WithUploads([])
    objects.uploads = [
        IncompleteUpload(key, "old", started - LEFTOVER_SKEW - 1),
        IncompleteUpload(key, "skew", started - LEFTOVER_SKEW + 5),  # within the margin
        IncompleteUpload(key, "live", started + 30),  # the other daemon's, under way
    ]
    backup = BackupStore(objects)
    assert backup.abort_leftover_uploads("j", {"1-0"}) == 1
    assert [u.upload_id for u in objects.uploads] == ["skew", "live"]


def test_leftover_uploads_that_cannot_be_listed_cost_a_warning_not_the_backup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backup = BackupStore(WithUploads([data_key(ItemId("j", 4, 1, 0), "a")], denied=True))
    with caplog.at_level(logging.WARNING):
        assert backup.abort_leftover_uploads("j", {"1-0"}) == 0
        assert backup.abort_leftover_uploads("j", {"1-0"}) == 0
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "AccessDenied" in caplog.records[0].getMessage()


def test_fetch_refuses_an_object_of_the_same_size_and_crc32c(
    backup: BackupStore, uploaded: Uploaded
) -> None:
    """A bucket writer forges the object's crc32c (the COMMIT and manifest stay genuine):
    the manifest's BLAKE3 digest, hashed as the bytes come down, refuses it."""
    key = data_key(DIR_ITEM, "state/d/chunk")
    backup.objects.put_bytes(key, same_crc32c(backup.objects.get_bytes(key)))
    with pytest.raises(CorruptItem, match=r"state/d/chunk does not match .*: content digest"):
        backup.fetch_item(uploaded.record, DIR_ITEM, uploaded.fresh_staging())
    digest = uploaded.record.items[DIR_ITEM.key]
    with pytest.raises(CorruptItem, match="content digest"):
        backup.fetch_pinned(DIR_ITEM, digest, uploaded.fresh_staging())


def test_a_backup_written_before_digests_is_fetched_on_its_crc32c(
    backup: BackupStore, tmp_path: Path
) -> None:
    data = make_file_item(tmp_path / "old")
    built = build_manifest(FILE_ITEM, data)
    old = Manifest(
        FILE_ITEM, built.kind, (dataclasses.replace(built.files[0], blake3=None),), version=1
    )
    backup.upload_item(old, data)
    record = backup.try_commit(JOB, 100, ["1-0"], now=1.0)
    assert record is not None
    staged = tmp_path / "staged"
    staged.mkdir()
    fetched = backup.fetch_item(record, FILE_ITEM, staged)
    assert fetched.unverifiable
    assert (staged / "data").read_bytes() == data.read_bytes()
