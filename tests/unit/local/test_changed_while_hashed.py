"""A pod that kept a descriptor into its handed-over data writes it while the
daemon hashes it. The ingest must notice (and leave the data to hash again), never commit a
manifest the bytes on disk do not match: such an item counts as the newest complete step,
and retention then deletes the older, good one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import CorruptItem, ItemId
from mtc_replicator.local import hashing
from mtc_replicator.local.store import LocalStore

ITEM = ItemId("job", 10, 0, 0)
SIZE = 3 * hashing.CHUNK + 123  # several reads, so a write can land between two


@pytest.fixture
def store(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    s = LocalStore(ckpt)
    s.open()
    yield s
    s.close()


def _writer_after_first_read(path_of_file):
    """A ``cancelled`` check (called after every read) that, once, has the 'pod' rewrite the
    file's first bytes, already hashed, through a descriptor it kept."""
    done = []

    def cancelled() -> bool:
        if not done:
            done.append(True)
            fd = os.open(path_of_file(), os.O_WRONLY)
            try:
                os.pwrite(fd, b"\xff" * 4096, 0)
            finally:
                os.close(fd)
        return False

    return cancelled


@pytest.mark.parametrize("kind", ["file", "dir"])
def test_a_file_written_while_hashed_is_not_committed(store: LocalStore, kind: str) -> None:
    ckpt = store.checkpoint_dir
    if kind == "file":
        src = ckpt / "job-10-0-0.save"
        src.write_bytes(os.urandom(SIZE))
        rel = ""
    else:
        src = ckpt / "10"
        src.mkdir()
        (src / "shard").write_bytes(os.urandom(SIZE))
        rel = "shard"
    store.take(src, ITEM)
    data = store.ingest_root / "job" / "10" / "0-0" / "data"
    target = (lambda: data) if kind == "file" else (lambda: data / rel)

    try:
        manifest = store.commit_ingested(ITEM, _writer_after_first_read(target))
    except OSError:
        # Noticed: nothing committed, the taken data kept to hash again.
        assert store.get(ITEM) is None
        assert store.pending_ingest() == [ITEM]
        manifest = store.commit_ingested(ITEM)  # the writer is done: now it commits
        store.verify(ITEM)
        return
    # Not noticed: the committed manifest does not describe the committed bytes.
    with pytest.raises(CorruptItem):
        store.verify(ITEM)
    pytest.fail(f"{manifest.item} committed with a manifest its bytes do not match")


def test_a_file_added_to_a_directory_while_hashed_is_not_committed(store: LocalStore) -> None:
    ckpt = store.checkpoint_dir
    src = ckpt / "10"
    src.mkdir()
    (src / "a").write_bytes(os.urandom(SIZE))
    store.take(src, ITEM)
    data = store.ingest_root / "job" / "10" / "0-0" / "data"
    done = []

    def cancelled() -> bool:
        if not done:
            done.append(True)
            (data / "late").write_bytes(b"written after the walk")
        return False

    try:
        store.commit_ingested(ITEM, cancelled)
    except OSError:
        assert store.get(ITEM) is None
        assert store.pending_ingest() == [ITEM]
        store.commit_ingested(ITEM)
        store.verify(ITEM)
        return
    with pytest.raises(CorruptItem):
        store.verify(ITEM)
    pytest.fail("committed with a file list the directory does not match")
