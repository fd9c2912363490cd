"""Tests for ``replicator.local.store.LocalStore``: taking, committing, crash recovery and locking.

Real files in ``tmp_path`` (the store's whole point is renames on one filesystem); no
sockets, no subprocesses.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from replicator.core.contract import STORE_DIR
from replicator.core.manifest import CorruptItem, ItemId, ItemKind, Manifest
from replicator.local.hashing import build_manifest
from replicator.local.store import DATA, MANIFEST_FILE, LocalStore, OpenReport, StoreError

ITEM = ItemId("job", 10, 0, 0)


def make_step(path: Path, payload: bytes = b"payload") -> Path:
    (path / "state").mkdir(parents=True)
    (path / "empty").mkdir()
    (path / "_CHECKPOINT_METADATA").write_bytes(b"{}")
    (path / "state" / "shard").write_bytes(payload)
    return path


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


@pytest.fixture
def store(ckpt: Path) -> Iterator[LocalStore]:
    s = LocalStore(ckpt)
    s.open()
    yield s
    s.close()


def reopen(old: LocalStore) -> tuple[LocalStore, OpenReport]:
    old.close()
    new = LocalStore(old.checkpoint_dir)
    return new, new.open()


def ingest(store: LocalStore, item: ItemId, payload: bytes = b"payload") -> Path:
    src = make_step(store.checkpoint_dir / str(item.step), payload)
    store.take(src, item)
    return src


# --- taking and committing ---------------------------------------------------------------------


def test_take_and_commit_move_the_step_by_rename(store: LocalStore, ckpt: Path) -> None:
    src = make_step(ckpt / "10")
    inode = src.stat().st_ino
    shard_inode = (src / "state" / "shard").stat().st_ino
    store.take(src, ITEM)
    assert not src.exists()
    assert store.pending_ingest() == [ITEM]
    assert store.get(ITEM) is None  # taken is not committed

    manifest = store.commit_ingested(ITEM)

    data = store.data_path(ITEM)
    assert data.stat().st_ino == inode
    assert (data / "state" / "shard").stat().st_ino == shard_inode
    assert (data / "state" / "shard").read_bytes() == b"payload"
    assert manifest.kind is ItemKind.DIR
    assert manifest == build_manifest(ITEM, data)
    assert (store.item_dir(ITEM) / MANIFEST_FILE).read_bytes() == manifest.to_json()
    assert store.get(ITEM) == manifest
    assert store.manifests() == {ITEM: manifest}
    assert store.manifests("job") == {ITEM: manifest}
    assert store.manifests("other") == {}
    assert store.pending_ingest() == []
    assert list(store.ingest_root.iterdir()) == []  # emptied step and job dirs are gone
    store.verify(ITEM)


def test_take_a_save_file(store: LocalStore, ckpt: Path) -> None:
    item = ItemId("job", 3, 0, 1)
    src = ckpt / "job-s3-n0-w1.save"
    src.write_bytes(b"torch bytes")
    inode = src.stat().st_ino
    store.take(src, item)
    manifest = store.commit_ingested(item)
    assert manifest.kind is ItemKind.FILE
    assert store.data_path(item).stat().st_ino == inode
    assert store.data_path(item).read_bytes() == b"torch bytes"


def test_take_of_a_missing_source_leaves_no_ingest_entry(store: LocalStore, ckpt: Path) -> None:
    with pytest.raises(FileNotFoundError):
        store.take(ckpt / "10", ITEM)
    assert store.pending_ingest() == []


def test_commit_of_a_tree_with_a_symlink_fails_and_keeps_nothing_committed(
    store: LocalStore, ckpt: Path
) -> None:
    src = make_step(ckpt / "10")
    (src / "link").symlink_to("/etc")
    store.take(src, ITEM)
    with pytest.raises(ValueError, match="link"):
        store.commit_ingested(ITEM)
    assert store.get(ITEM) is None
    assert not store.item_dir(ITEM).exists()
    store.discard_ingest(ITEM)
    assert store.pending_ingest() == []


def test_verify_detects_corruption_of_a_committed_item(store: LocalStore) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    (store.data_path(ITEM) / "state" / "shard").write_bytes(b"PAYLOAD")
    with pytest.raises(CorruptItem):
        store.verify(ITEM)
    with pytest.raises(CorruptItem, match="not in the local store"):
        store.verify(ItemId("job", 99, 0, 0))


def test_marker_target_is_relative_and_resolves_to_the_data(store: LocalStore, ckpt: Path) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    target = store.marker_target(ITEM)
    assert not os.path.isabs(target)
    assert target.startswith(STORE_DIR + "/")
    marker = ckpt / "job-s10-n0-w0.restore"
    marker.symlink_to(target)
    assert marker.resolve() == store.data_path(ITEM).resolve()
    assert (marker / "state" / "shard").read_bytes() == b"payload"
    assert store.owns_link_target(os.readlink(marker))


@pytest.mark.parametrize(
    ("target", "owned"),
    [
        (".mtc/items/job/10/0-0/data", True),
        ("./.mtc/items/job/10/0-0/data", True),
        (".mtc", True),
        ("sub/../.mtc/items/x", True),
        (".mtc/../elsewhere", False),
        (".mtcx/items", False),
        ("other/.mtc/items", False),
        ("../ckpt/.mtc/items", False),
        ("/abs/ckpt/.mtc/items", False),
        ("10", False),
    ],
)
def test_owns_link_target(store: LocalStore, target: str, owned: bool) -> None:
    assert store.owns_link_target(target) is owned


def test_commit_replaces_an_item_of_the_same_id(store: LocalStore) -> None:
    ingest(store, ITEM, b"first")
    first = store.commit_ingested(ITEM)
    ingest(store, ITEM, b"second, longer")
    second = store.commit_ingested(ITEM)
    assert first.digest != second.digest
    assert store.get(ITEM) == second
    assert (store.data_path(ITEM) / "state" / "shard").read_bytes() == b"second, longer"
    store.verify(ITEM)
    assert list(store.trash.iterdir()) == []


def test_commit_staged(store: LocalStore, tmp_path: Path) -> None:
    src = make_step(tmp_path / "elsewhere")
    manifest = build_manifest(ITEM, src)
    staged = store.new_staging()
    src.rename(staged / DATA)
    store.commit_staged(staged, manifest)
    assert store.get(ITEM) == manifest
    assert not staged.exists()
    store.verify(ITEM)


def test_delete_removes_the_item_and_empty_parents(store: LocalStore) -> None:
    a, b = ItemId("job", 10, 0, 0), ItemId("job", 10, 1, 0)
    for item in (a, b):
        ingest(store, item)
        store.commit_ingested(item)
    store.delete(a)
    assert store.get(a) is None
    assert not store.item_dir(a).exists()
    assert store.item_dir(b).is_dir()  # the step still holds b
    store.delete(b)
    assert store.manifests() == {}
    assert list(store.items_root.iterdir()) == []  # step and job dirs are gone too
    assert list(store.trash.iterdir()) == []
    store.delete(b)  # idempotent


# --- crash recovery ----------------------------------------------------------------------------


def test_reopen_indexes_committed_items(store: LocalStore) -> None:
    items = [ItemId("job", 10, 0, 0), ItemId("job", 20, 0, 0), ItemId("other", 5, 1, 2)]
    manifests = {}
    for item in items:
        ingest(store, item)
        manifests[item] = store.commit_ingested(item)
    new, report = reopen(store)
    try:
        assert report.items == 3
        assert report.discarded == ()
        assert new.manifests() == manifests
        for item in items:
            new.verify(item)
    finally:
        new.close()


@pytest.mark.parametrize(("step", "key"), [("²", "0-0"), ("1", "²-0"), ("1", "0-\u0661")])
def test_open_ignores_names_with_non_ascii_digits(store: LocalStore, step: str, key: str) -> None:
    """``"²".isdigit()`` is true and ``int("²")`` fails: such a name, planted by anyone who
    can write the RAM disk, must not crash the daemon at every start."""
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    planted = store.root / "items" / ITEM.job / step / key
    planted.mkdir(parents=True)
    new, report = reopen(store)
    try:
        assert report.items == 1
        assert list(new.manifests(ITEM.job)) == [ITEM]
    finally:
        new.close()


def test_open_discards_an_item_without_manifest(store: LocalStore) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    half = ItemId("job", 20, 0, 0)
    make_step(store.item_dir(half) / DATA)  # a crash before the manifest was written
    new, report = reopen(store)
    try:
        assert str(store.item_dir(half)) in report.discarded
        assert set(new.manifests()) == {ITEM}
        assert not store.item_dir(half).exists()
        assert not store.item_dir(half).parent.exists()  # empty step dir pruned
    finally:
        new.close()


def test_open_discards_a_manifest_naming_another_item(store: LocalStore) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    moved = ItemId("job", 11, 0, 0)
    store.item_dir(moved).parent.mkdir(parents=True)
    store.item_dir(ITEM).rename(store.item_dir(moved))
    new, report = reopen(store)
    try:
        assert str(store.item_dir(moved)) in report.discarded
        assert new.manifests() == {}
        assert not store.item_dir(moved).exists()
    finally:
        new.close()


def test_open_discards_a_garbage_manifest_and_foreign_names(store: LocalStore) -> None:
    bad = store.item_dir(ITEM)
    make_step(bad / DATA)
    (bad / MANIFEST_FILE).write_bytes(b"{not json")
    (store.items_root / "job" / "10" / "not-an-item").mkdir()
    (store.items_root / "job" / "notastep" / "0-0").mkdir(parents=True)
    (store.items_root / "stray-file").write_bytes(b"")
    new, report = reopen(store)
    try:
        assert new.manifests() == {}
        assert len(report.discarded) == 4
        assert list(new.items_root.iterdir()) == []
    finally:
        new.close()


def test_open_reports_pending_ingest_and_commit_works_later(store: LocalStore) -> None:
    ingest(store, ITEM)
    other = ItemId("job", 7, 0, 0)
    ingest(store, other)
    new, report = reopen(store)
    try:
        assert report.pending_ingest == (other, ITEM)
        assert report.items == 0
        manifest = new.commit_ingested(ITEM)
        assert new.get(ITEM) == manifest
        assert new.pending_ingest() == [other]
        new.verify(ITEM)
    finally:
        new.close()


def test_open_discards_ingest_dirs_without_data(store: LocalStore) -> None:
    (store.ingest_root / "job" / "10" / "0-0").mkdir(parents=True)  # crash inside take()
    new, report = reopen(store)
    try:
        assert report.pending_ingest == ()
        assert len(report.discarded) == 1
        assert list(new.ingest_root.iterdir()) == []
    finally:
        new.close()


def test_open_wipes_staging_and_trash(store: LocalStore) -> None:
    staged = store.new_staging()
    make_step(staged / DATA)
    (store.trash / "half-deleted").mkdir()
    (store.trash / "half-deleted" / "f").write_bytes(b"x")
    (store.trash / "file").write_bytes(b"x")
    new, _ = reopen(store)
    try:
        assert list(new.staging_root.iterdir()) == []
        assert list(new.trash.iterdir()) == []
    finally:
        new.close()


def test_open_leaves_the_workload_files_alone(ckpt: Path) -> None:
    make_step(ckpt / "10")
    (ckpt / "jax-init-info.txt").write_text("0\n127.0.0.1:1\n")
    s = LocalStore(ckpt)
    s.open()
    s.close()
    assert sorted(p.name for p in ckpt.iterdir()) == [".mtc", "10", "jax-init-info.txt"]


# --- locking -----------------------------------------------------------------------------------


def test_second_open_of_the_same_store_is_refused(store: LocalStore, ckpt: Path) -> None:
    ingest(store, ITEM)
    staged = store.new_staging()
    second = LocalStore(ckpt)
    with pytest.raises(StoreError, match="another mtc-replicator"):
        second.open()
    # The refused opener touched nothing of the first one's in-flight work.
    assert staged.is_dir()
    assert store.pending_ingest() == [ITEM]
    store.close()
    second.open()  # the lock is free once the first store is closed
    second.close()


def test_close_is_idempotent(ckpt: Path) -> None:
    s = LocalStore(ckpt)
    s.close()
    s.open()
    s.close()
    s.close()


# --- views: hard-link copies that markers point at ----------------------------------------------


def test_expose_makes_a_hard_link_view_the_workload_may_delete(
    store: LocalStore, ckpt: Path
) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    target = store.expose(ITEM, "inc1")
    assert not os.path.isabs(target)
    assert store.owns_link_target(target)
    assert store.item_of_link(target) == ITEM
    view = ckpt / target
    shard = store.data_path(ITEM) / "state" / "shard"
    assert (view / "state" / "shard").stat().st_ino == shard.stat().st_ino
    assert (view / "empty").is_dir()
    assert store.expose(ITEM, "inc1") == target  # idempotent
    # What Orbax's retention does through the <N> link: the committed item survives.
    marker = ckpt / "10"
    marker.symlink_to(target)
    for path in sorted(marker.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    store.verify(ITEM)
    store.drop_views()
    assert list(store.views_root.iterdir()) == []
    store.verify(ITEM)


def test_expose_a_file_item(store: LocalStore, ckpt: Path) -> None:
    item = ItemId("job", 3, 0, 1)
    src = ckpt / "job-s3-n0-w1.save"
    src.write_bytes(b"torch bytes")
    store.take(src, item)
    store.commit_ingested(item)
    target = store.expose(item, "inc1")
    assert (ckpt / target).read_bytes() == b"torch bytes"
    assert (ckpt / target).stat().st_ino == store.data_path(item).stat().st_ino
    store.drop_views(item)
    assert not (ckpt / target).exists()
    store.verify(item)


def test_expose_of_a_missing_item(store: LocalStore) -> None:
    with pytest.raises(StoreError, match="not in the local store"):
        store.expose(ITEM, "inc1")


def test_expose_an_item_whose_manifest_lists_dirs_out_of_order(
    store: LocalStore, tmp_path: Path
) -> None:
    """A peer's manifest need not list parents first; the view must still be built."""
    src = tmp_path / "peer-copy"
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "a" / "b" / "c" / "f").write_bytes(b"x")
    built = build_manifest(ITEM, src)
    assert built.dirs == ("a", "a/b", "a/b/c")
    shuffled = Manifest.from_json(
        Manifest(ITEM, built.kind, built.files, tuple(reversed(built.dirs))).to_json()
    )
    staged = store.new_staging()
    src.rename(staged / DATA)
    store.commit_staged(staged, shuffled)
    store.verify(ITEM)
    target = store.expose(ITEM, "inc1")
    assert (store.checkpoint_dir / target / "a" / "b" / "c" / "f").read_bytes() == b"x"


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (".mtc/items/job/10/0-0/data", ITEM),
        (".mtc/items/job/10/0-0", ITEM),
        (".mtc/views/inc/job/10/0-0/data", ITEM),
        ("./.mtc/views/inc/other/7/2-1/data", ItemId("other", 7, 2, 1)),
        (".mtc/items/job/10", None),
        (".mtc/items/job/x/0-0/data", None),
        (".mtc/items/job/10/0_0/data", None),
        (".mtc/staging/abc/data", None),
        ("elsewhere/items/job/10/0-0/data", None),
        ("/abs/.mtc/items/job/10/0-0/data", None),
    ],
)
def test_item_of_link(store: LocalStore, target: str, expected: ItemId | None) -> None:
    assert store.item_of_link(target) == expected
