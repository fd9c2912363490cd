"""An item's upload to a cloud store, and its restore (``SmallFilesSideBySide``): its small
files move several at once, since each waits on a round trip; larger ones after them, one
at a time; still one paced transfer, the manifest only once every file is there, and every
byte fetched checked against its digest."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import LAYOUT, data_key, manifest_key
from mtc_replicator.core.manifest import Cancelled, CorruptItem, ItemId, Manifest
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Meter
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import (
    ChecksumMismatch,
    MemoryObjectStore,
    SmallFilesSideBySide,
)
from tests.flight import Flight

ITEM = ItemId("job", 7, 0, 0)
LIMIT = 4096
SMALL = 9


class Cloudy(MemoryObjectStore):
    """An in-memory store that says it moves small files side by side, and what it saw."""

    def __init__(self, workers: int) -> None:
        super().__init__()
        self.workers = workers
        self.puts = Flight(workers)
        self.gets = Flight(workers)
        self.transfers: list[int] = []
        self.backup: BackupStore | None = None

    @property
    def order(self) -> list[str]:
        return self.puts.order

    def small_file_workers(self) -> int:
        return self.workers

    def side_by_side_limit(self) -> int:
        return LIMIT

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        if self.backup is not None:
            self.transfers.append(self.backup.pacer.active(Traffic.BACKUP))
        with self.puts.call(key):
            super().put_file(key, src, crc32c=crc32c, meter=meter)

    def read_chunks(self, key: str) -> Iterator[bytes]:
        with self.gets.call(key):
            yield from super().read_chunks(key)


def an_item(tmp_path: Path) -> tuple[Manifest, Path]:
    data = tmp_path / "item"
    data.mkdir()
    (data / "a_large").write_bytes(os.urandom(LIMIT + 1))
    for i in range(SMALL):
        (data / f"small_{i}").write_bytes(os.urandom(100 + i))
    (data / "z_large").write_bytes(os.urandom(3 * LIMIT))
    return build_manifest(ITEM, data), data


def test_small_files_go_side_by_side_then_the_large_one_at_a_time(tmp_path: Path) -> None:
    manifest, data = an_item(tmp_path)
    objects = Cloudy(workers=3)
    assert isinstance(objects, SmallFilesSideBySide)
    backup = BackupStore(objects)
    objects.backup = backup
    backup.upload_item(manifest, data)
    assert 2 <= objects.puts.most <= 3  # side by side, never more than the store's workers
    larges = [data_key(ITEM, name, LAYOUT) for name in ("a_large", "z_large")]
    assert objects.order[-2:] == larges  # after every small file, in the item's order
    assert set(objects.transfers) == {1}  # one transfer at the pacer, whatever its threads
    for entry in manifest.files:
        assert (
            objects.get_bytes(data_key(ITEM, entry.path, LAYOUT))
            == (data / entry.path).read_bytes()
        )
    assert objects.head(manifest_key(ITEM, LAYOUT)) is not None


def test_a_small_file_changed_since_it_was_taken_stops_the_item(tmp_path: Path) -> None:
    manifest, data = an_item(tmp_path)
    body = bytearray((data / "small_0").read_bytes())
    body[7] ^= 0x04  # the same size: the store's crc32c check is what refuses it
    (data / "small_0").write_bytes(bytes(body))
    objects = Cloudy(workers=2)
    with pytest.raises(ChecksumMismatch, match="changed since its checksum was taken"):
        BackupStore(objects).upload_item(manifest, data)
    assert objects.head(manifest_key(ITEM, LAYOUT)) is None
    assert objects.head(data_key(ITEM, "small_0", LAYOUT)) is None
    # Nothing large begun: the small files' failure ends the item first.
    assert not any(key.endswith("large") for key in objects.order)


def test_a_small_file_grown_since_it_was_taken_is_refused_before_it_is_sent(
    tmp_path: Path,
) -> None:
    # Sent as small, it would go in parts on every worker at once: past the memory bound.
    manifest, data = an_item(tmp_path)
    (data / "small_3").write_bytes(os.urandom(2 * LIMIT))
    objects = Cloudy(workers=2)
    with pytest.raises(ChecksumMismatch, match="is not the 103 bytes taken"):
        BackupStore(objects).upload_item(manifest, data)
    assert data_key(ITEM, "small_3", LAYOUT) not in objects.order  # never handed to the store
    assert objects.head(manifest_key(ITEM, LAYOUT)) is None


def test_one_worker_or_a_cancel_keeps_the_old_ways(tmp_path: Path) -> None:
    manifest, data = an_item(tmp_path)
    serial = Cloudy(workers=1)
    BackupStore(serial).upload_item(manifest, data)
    assert serial.puts.most == 1
    assert serial.order == [data_key(ITEM, e.path, LAYOUT) for e in manifest.files]
    cancelled = Cloudy(workers=3)
    with pytest.raises(Cancelled):
        BackupStore(cancelled).upload_item(manifest, data, cancelled=lambda: True)
    assert cancelled.order == []


def committed(tmp_path: Path, objects: Cloudy) -> tuple[BackupStore, Manifest, Path]:
    manifest, data = an_item(tmp_path)
    backup = BackupStore(objects)
    backup.upload_item(manifest, data)
    assert backup.try_commit(ITEM.job, ITEM.step, [ITEM.key]) is not None
    return backup, manifest, data


def test_a_restore_fetches_small_files_side_by_side_every_byte_checked(tmp_path: Path) -> None:
    objects = Cloudy(workers=3)
    backup, manifest, data = committed(tmp_path, objects)
    record = backup.read_commit(ITEM.job, ITEM.step)
    assert record is not None
    staged = tmp_path / "staged"
    staged.mkdir()
    heard: list[int] = []
    assert backup.fetch_item(record, ITEM, staged, progress=heard.append) == manifest
    assert 2 <= objects.gets.most <= 3
    larges = [data_key(ITEM, name, LAYOUT) for name in ("a_large", "z_large")]
    assert objects.gets.order[-2:] == larges
    assert sum(heard) == sum(e.size for e in manifest.files)
    for entry in manifest.files:
        assert (staged / "data" / entry.path).read_bytes() == (data / entry.path).read_bytes()


def test_a_small_file_damaged_in_the_bucket_fails_the_restore(tmp_path: Path) -> None:
    objects = Cloudy(workers=3)
    backup, _, _ = committed(tmp_path, objects)
    key = data_key(ITEM, "small_4", LAYOUT)
    body = bytearray(objects.get_bytes(key))
    body[len(body) // 2] ^= 0x10
    objects.put_bytes(key, bytes(body))  # same size: only the digest tells
    record = backup.read_commit(ITEM.job, ITEM.step)
    assert record is not None
    staged = tmp_path / "staged"
    staged.mkdir()
    with pytest.raises(CorruptItem, match="small_4 does not match its manifest"):
        backup.fetch_item(record, ITEM, staged)
    assert not any(key.endswith("large") for key in objects.gets.order)  # nothing large begun
