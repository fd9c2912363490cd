"""An item's upload to a filesystem store uses the node's cores: its files are put side by
side (``ParallelPuts``), still one paced transfer, every file checked against its crc32c,
and its manifest written only once every file is there."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import LAYOUT, data_key, manifest_key
from mtc_replicator.core.manifest import Cancelled, ItemId, Manifest
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Meter
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import (
    MAX_PUT_WORKERS,
    ChecksumMismatch,
    FileObjectStore,
    ParallelPuts,
)

ITEM = ItemId("job", 100, 0, 0)
FILES = 6


class Watched(FileObjectStore):
    """A filesystem store that takes ``workers`` files at once, and says what it saw:
    how many puts were in flight together, and what was written when."""

    def __init__(self, root: Path, workers: int, meet: int = 0) -> None:
        super().__init__(root)
        self.workers = workers
        self.meet = threading.Barrier(meet, timeout=10) if meet else None
        """Puts wait here until ``meet`` of them are in flight: serial puts never pass."""
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0
        self.events: list[str] = []
        self.transfers: list[int] = []
        self.pacer_of: BackupStore | None = None

    def put_workers(self) -> int:
        return self.workers

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            if self.pacer_of is not None:
                self.transfers.append(self.pacer_of.pacer.active(Traffic.BACKUP))
        try:
            if self.meet is not None:
                self.meet.wait()
            super().put_file(key, src, crc32c=crc32c, meter=meter)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.events.append(key)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with self.lock:
            self.events.append(key)
        super().put_bytes(key, data, if_absent=if_absent)


def an_item(tmp_path: Path) -> tuple[Manifest, Path]:
    data = tmp_path / "src"
    data.mkdir()
    for i in range(FILES):
        (data / f"shard_{i}").write_bytes(os.urandom(64 * 1024 + i))
    return build_manifest(ITEM, data), data


def test_an_item_s_files_are_put_side_by_side_then_its_manifest(tmp_path: Path) -> None:
    manifest, data = an_item(tmp_path)
    # Two puts must be in flight together to pass the barrier: one at a time, the first
    # waits in vain (BrokenBarrierError).
    objects = Watched(tmp_path / "bucket", workers=2, meet=2)
    backup = BackupStore(objects)
    objects.pacer_of = backup
    backup.upload_item(manifest, data)
    assert objects.most == 2  # never more than the store's workers
    # Still one transfer of the item at the pacer, whatever its threads.
    assert set(objects.transfers) == {1}
    assert backup.pacer.active(Traffic.BACKUP) == 0
    # The manifest last, once every file is there, and every byte as taken.
    assert objects.events[-1] == manifest_key(ITEM, LAYOUT)
    assert len(objects.events) == FILES + 1
    for entry in manifest.files:
        stored = objects.get_bytes(data_key(ITEM, entry.path, LAYOUT))
        assert stored == (data / entry.path).read_bytes()


def test_a_file_changed_since_it_was_taken_fails_the_item_and_no_manifest_is_written(
    tmp_path: Path,
) -> None:
    manifest, data = an_item(tmp_path)
    (data / "shard_1").write_bytes(b"changed after it was hashed")
    objects = Watched(tmp_path / "bucket", workers=3)
    with pytest.raises(ChecksumMismatch, match="changed since its checksum was taken"):
        BackupStore(objects).upload_item(manifest, data)
    assert objects.head(manifest_key(ITEM, LAYOUT)) is None
    assert objects.head(data_key(ITEM, "shard_1", LAYOUT)) is None
    # The files not begun when it failed were never put: no more than the workers in flight.
    assert len([e for e in objects.events if e.endswith("shard_5")]) <= 1


def test_a_cancelled_upload_puts_nothing_more(tmp_path: Path) -> None:
    manifest, data = an_item(tmp_path)
    objects = Watched(tmp_path / "bucket", workers=2)
    with pytest.raises(Cancelled):
        BackupStore(objects).upload_item(manifest, data, cancelled=lambda: True)
    assert objects.events == []


def test_a_filesystem_store_puts_one_file_per_core_it_may_run_on(tmp_path: Path) -> None:
    store = FileObjectStore(tmp_path / "bucket")
    assert isinstance(store, ParallelPuts)
    cores = len(os.sched_getaffinity(0))
    assert store.put_workers() == min(cores, MAX_PUT_WORKERS)
    # Pinned to one core (a thread's own affinity: the process keeps its own), one file.
    seen: list[int] = []

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        seen.append(store.put_workers())

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen == [1]
