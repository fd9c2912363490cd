"""An item's upload to a filesystem store uses the node's cores: its files, and the ranges of
a large one, are copied side by side (``ParallelPuts``), still one paced transfer, every
file checked against its crc32c, and its manifest written only once every file is there."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import pytest

from mtc_replicator.core.backup_layout import LAYOUT, data_key, manifest_key
from mtc_replicator.core.manifest import Cancelled, ItemId, Manifest
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.local import fsutil
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Meter
from mtc_replicator.storage import backup as backup_module
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import (
    MAX_PUT_WORKERS,
    ChecksumMismatch,
    FileObjectStore,
    ObjectStoreError,
    ParallelPuts,
    RangedPut,
)
from tests.flight import Flight

ITEM = ItemId("job", 100, 0, 0)
FILES = 6


class Watched(FileObjectStore):
    """A filesystem store that copies ``workers`` ranges at once, and says what it saw:
    how many were in flight together, and what was published when."""

    def __init__(self, root: Path, workers: int, meet: int = 0) -> None:
        super().__init__(root)
        self.workers = workers
        self.meet = threading.Barrier(meet, timeout=10) if meet else None
        """Copies wait here until ``meet`` of them are in flight: serial copies never pass."""
        self.lock = threading.Lock()
        self.flight = Flight()
        self.events: list[str] = []
        self.copied: list[tuple[str, int, int]] = []
        self.transfers: list[int] = []
        self.pacer_of: BackupStore | None = None

    def put_workers(self) -> int:
        return self.workers

    def open_put(self, key: str, src: Path, *, size: int, crc32c: int | None) -> RangedPut:
        return WatchedPut(self, key, super().open_put(key, src, size=size, crc32c=crc32c))

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        with self.lock:
            self.events.append(key)
        super().put_bytes(key, data, if_absent=if_absent)


class WatchedPut:
    def __init__(self, store: Watched, key: str, put: RangedPut) -> None:
        self.store, self.key, self.put = store, key, put

    def copy(self, offset: int, length: int, meter: Meter | None) -> None:
        store = self.store
        with store.lock:
            store.copied.append((self.key, offset, length))
            if store.pacer_of is not None:
                store.transfers.append(store.pacer_of.pacer.active(Traffic.BACKUP))
        with store.flight.call(self.key):
            if store.meet is not None:
                store.meet.wait()
            self.put.copy(offset, length, meter)

    def finish(self) -> None:
        self.put.finish()
        with self.store.lock:
            self.store.events.append(self.key)

    def abort(self) -> None:
        self.put.abort()


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
    assert objects.flight.most == 2  # never more than the store's workers
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


PIECE = 64 * 1024
"""The pieces these tests split files into (``storage.backup.PIECE``, 32 MiB in the
daemon), so that a file of a few hundred KiB is several ranges."""


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backup_module, "PIECE", PIECE)


def one_file_item(tmp_path: Path, size: int) -> tuple[Manifest, Path]:
    data = tmp_path / "model.distcp"
    data.write_bytes(os.urandom(size))
    return build_manifest(ITEM, data), data


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(f"{fsutil.TMP_PREFIX}*"))


@pytest.mark.usefixtures("small_pieces")
def test_one_large_file_is_copied_in_ranges_side_by_side(tmp_path: Path) -> None:
    # A PyTorch rank's checkpoint is one file: its pieces must go on every core too. Two
    # ranges of the one file must be in flight together to pass the barrier.
    size = 5 * PIECE + 123
    manifest, data = one_file_item(tmp_path, size)
    objects = Watched(tmp_path / "bucket", workers=2, meet=2)
    backup = BackupStore(objects)
    objects.pacer_of = backup
    backup.upload_item(manifest, data)
    key = data_key(ITEM, "", LAYOUT)
    assert sorted(o for _, o, _ in objects.copied) == [i * PIECE for i in range(6)]
    assert {k for k, _, _ in objects.copied} == {key}
    assert objects.flight.most == 2
    assert set(objects.transfers) == {1}  # one paced transfer, whatever its threads
    assert objects.events == [key, manifest_key(ITEM, LAYOUT)]
    assert objects.get_bytes(key) == data.read_bytes()
    assert leftovers(objects.root) == []


@pytest.mark.usefixtures("small_pieces")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b[: len(b) - PIECE - 7], "source ends at"),
        (lambda b: b + b"more", "source is longer than"),
        (lambda b: b[:PIECE] + bytes([b[PIECE] ^ 1]) + b[PIECE + 1 :], "changed since"),
    ],
    ids=["shrank", "grew", "one-bit"],
)
def test_a_large_file_changed_since_it_was_taken_is_not_published(
    tmp_path: Path, change: Callable[[bytes], bytes], message: str
) -> None:
    manifest, data = one_file_item(tmp_path, 4 * PIECE + 5)
    data.write_bytes(change(data.read_bytes()))
    objects = Watched(tmp_path / "bucket", workers=3)
    with pytest.raises(ChecksumMismatch, match=message):
        BackupStore(objects).upload_item(manifest, data)
    assert objects.head(data_key(ITEM, "", LAYOUT)) is None
    assert objects.head(manifest_key(ITEM, LAYOUT)) is None
    assert leftovers(objects.root) == []  # every temporary file removed


@pytest.mark.usefixtures("small_pieces")
def test_a_range_that_fails_stops_the_rest_and_leaves_each_key_as_it_was(
    tmp_path: Path,
) -> None:
    manifest, data = an_item(tmp_path)  # six files of one 64 KiB+ range and one short one
    objects = Watched(tmp_path / "bucket", workers=2)
    broken = data_key(ITEM, "shard_2", LAYOUT)
    real_copy = WatchedPut.copy

    def copy(self: WatchedPut, offset: int, length: int, meter: Meter | None) -> None:
        if self.key == broken and offset:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_copy(self, offset, length, meter)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WatchedPut, "copy", copy)
        with pytest.raises(OSError, match="No space left"):
            BackupStore(objects).upload_item(manifest, data)
    assert objects.head(broken) is None
    assert objects.head(manifest_key(ITEM, LAYOUT)) is None
    assert leftovers(objects.root) == []
    # The pieces after it were not begun (four more lie between it and shard_5's first).
    assert not any(k.endswith("shard_5") for k, _, _ in objects.copied)


def test_a_file_put_takes_its_ranges_in_any_order_and_checks_they_cover_it(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    body = os.urandom(10_000)
    src.write_bytes(body)
    store = FileObjectStore(tmp_path / "bucket")
    put = store.open_put("k", src, size=len(body), crc32c=google_crc32c.value(body))
    for offset in (6000, 0, 3000):
        put.copy(offset, min(3000, len(body) - offset) if offset < 9000 else 1000, None)
    put.copy(9000, 1000, None)
    put.finish()
    assert store.get_bytes("k") == body
    # A range missing (3000..6000): refused, nothing published, nothing left behind.
    gap = store.open_put("g", src, size=len(body), crc32c=google_crc32c.value(body))
    gap.copy(0, 3000, None)
    gap.copy(6000, 4000, None)
    with pytest.raises(ValueError, match="do not cover"):
        gap.finish()
    assert store.head("g") is None
    # Aborted midway: the same; and a put that ended takes no more ranges.
    half = store.open_put("h", src, size=len(body), crc32c=None)
    half.copy(0, 5000, None)
    half.abort()
    assert store.head("h") is None
    assert leftovers(store.root) == []
    with pytest.raises(ObjectStoreError, match="has ended"):
        half.copy(5000, 5000, None)


def test_an_item_of_directories_alone_is_uploaded(tmp_path: Path) -> None:
    data = tmp_path / "dirs"
    (data / "a" / "b").mkdir(parents=True)
    manifest = build_manifest(ITEM, data)
    assert manifest.files == ()
    objects = Watched(tmp_path / "bucket", workers=4)
    BackupStore(objects).upload_item(manifest, data)
    assert objects.events == [manifest_key(ITEM, LAYOUT)]


class Interrupted(BaseException):
    """What the test's signal handler raises in the main thread, as Ctrl-C would."""


@pytest.mark.usefixtures("small_pieces")
def test_an_interrupted_upload_waits_for_its_copies_then_leaves_nothing(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread, and this test runs on another")
    manifest, data = one_file_item(tmp_path, 8 * PIECE)
    objects = Watched(tmp_path / "bucket", workers=2)
    real_copy = WatchedPut.copy
    ended: list[int] = []

    def slow_copy(self: WatchedPut, offset: int, length: int, meter: Meter | None) -> None:
        time.sleep(0.5)  # 8 pieces on 2 threads: 2 s at least, the interrupt at 0.25
        real_copy(self, offset, length, meter)
        ended.append(offset)

    def interrupt(*_: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    timer = threading.Timer(
        0.25, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1)
    )
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(WatchedPut, "copy", slow_copy)
            timer.start()
            with pytest.raises(Interrupted):
                BackupStore(objects).upload_item(manifest, data)
            # Every copy begun has ended before the interrupt went on, and no more began.
            assert objects.flight.now == 0
            assert len(ended) == len(objects.copied) < 8
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert objects.head(data_key(ITEM, "", LAYOUT)) is None
    assert leftovers(objects.root) == []


def test_an_empty_file_is_one_empty_range(tmp_path: Path) -> None:
    manifest, data = one_file_item(tmp_path, 0)
    objects = Watched(tmp_path / "bucket", workers=4)
    BackupStore(objects).upload_item(manifest, data)
    assert objects.get_bytes(data_key(ITEM, "", LAYOUT)) == b""
    assert objects.copied == [(data_key(ITEM, "", LAYOUT), 0, 0)]
