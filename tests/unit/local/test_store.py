"""Tests for ``mtc_replicator.local.store.LocalStore``: taking, committing, crash recovery and
locking.

Real files in ``tmp_path`` (the store's whole point is renames on one filesystem); no
sockets, no subprocesses.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.contract import STORE_DIR
from mtc_replicator.core.manifest import CorruptItem, ItemId, ItemKind, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import (
    DATA,
    MANIFEST_FILE,
    LocalStore,
    OpenReport,
    StoreError,
    StorePlacementError,
)

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


def test_a_view_is_relative_and_resolves_to_the_data(store: LocalStore, ckpt: Path) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    target = store.expose(ITEM, "inc1")
    assert not os.path.isabs(target)
    assert target == f"{STORE_DIR}/views/inc1/job/10/0-0/data"
    marker = ckpt / "job-s10-n0-w0.restore"
    marker.symlink_to(target)
    assert (marker / "state" / "shard").stat().st_ino == (
        store.data_path(ITEM) / "state" / "shard"
    ).stat().st_ino
    assert (marker / "state" / "shard").read_bytes() == b"payload"
    assert store.owns_link_target(os.readlink(marker))
    assert store.item_of_link(os.readlink(marker)) == ITEM
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


# --- the store is outside CHECKPOINT_DIR, which pods write ------------------------------------


def test_the_store_is_a_sibling_of_checkpoint_dir_by_default(store: LocalStore, ckpt: Path) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    assert store.root == ckpt.parent / "ckpt.mtc-store"
    assert store.data_path(ITEM).is_relative_to(store.root)
    assert not any(p.name == MANIFEST_FILE for p in ckpt.rglob("*"))


def test_a_store_inside_checkpoint_dir_is_refused(ckpt: Path) -> None:
    with pytest.raises(StorePlacementError, match="inside CHECKPOINT_DIR"):
        LocalStore(ckpt, ckpt / "store").open()
    with pytest.raises(StorePlacementError, match="inside CHECKPOINT_DIR"):
        LocalStore(ckpt, ckpt).open()
    assert not (ckpt / "store").exists()


@pytest.mark.skipif(
    not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat("/tmp").st_dev,
    reason="needs /dev/shm on a filesystem other than /tmp's",
)
def test_a_store_on_another_filesystem_is_refused(ckpt: Path) -> None:
    other = Path("/dev/shm") / f"mtc-test-{os.getpid()}-{ckpt.parent.name}"
    try:
        with pytest.raises(StorePlacementError, match="not on the filesystem"):
            LocalStore(ckpt, other).open()
    finally:
        shutil.rmtree(other, ignore_errors=True)


def test_an_old_store_inside_checkpoint_dir_is_discarded_never_committed(ckpt: Path) -> None:
    # An older daemon's layout, or a pod's forgery: items, pending ingest, state.
    old = ckpt / STORE_DIR
    src = make_step(ckpt / "old-step")
    item_dir = old / "items" / "job" / "10" / "0-0"
    item_dir.mkdir(parents=True)
    os.rename(src, item_dir / DATA)
    (item_dir / MANIFEST_FILE).write_bytes(build_manifest(ITEM, item_dir / DATA).to_json())
    make_step(old / "ingest" / "job" / "11" / "0-0" / DATA)
    (old / "incarnation.json").write_text("{}")
    (old / "views" / "inc0").mkdir(parents=True)
    s = LocalStore(ckpt)
    report = s.open()
    try:
        assert report.items == 0
        assert report.pending_ingest == ()
        assert sorted(report.discarded) == [
            str(old / "incarnation.json"),
            str(old / "ingest"),
            str(old / "items"),
        ]
        assert s.manifests() == {}
        assert sorted(p.name for p in old.iterdir()) == ["views"]  # markers may point there
    finally:
        s.close()


def test_views_never_follow_a_planted_symlink(store: LocalStore, ckpt: Path) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    # A pod points the views at the store's items: dropping views must not delete them.
    (ckpt / STORE_DIR).mkdir(exist_ok=True)
    (ckpt / STORE_DIR / "views").symlink_to(store.items_root)
    store.drop_views()
    store.drop_views(ITEM)
    store.verify(ITEM)
    assert not (ckpt / STORE_DIR / "views").is_symlink()
    # ... or CHECKPOINT_DIR/.mtc itself somewhere else: expose replaces it, follows nothing.
    outside = ckpt.parent / "outside"
    outside.mkdir()
    shutil.rmtree(ckpt / STORE_DIR)
    (ckpt / STORE_DIR).symlink_to(outside)
    target = store.expose(ITEM, "inc1")
    assert list(outside.iterdir()) == []
    assert not (ckpt / STORE_DIR).is_symlink()
    assert ((ckpt / target) / "state" / "shard").read_bytes() == b"payload"
    # Whatever a pod put at a view's name is replaced by the item's copy.
    (ckpt / target / "state" / "shard").unlink()
    (ckpt / target / "state" / "shard").symlink_to("/etc/hostname")
    target = store.expose(ITEM, "inc1")
    assert not (ckpt / target / "state" / "shard").is_symlink()
    store.verify(ITEM)


def test_a_symlink_swapped_into_a_committed_item_is_corruption(store: LocalStore) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    data = store.data_path(ITEM)
    outside = store.root.parent / "outside"
    outside.mkdir()
    (outside / "shard").write_bytes(b"payload")  # the very bytes the manifest lists
    os.rename(data / "state", data / "state.old")
    (data / "state").symlink_to(outside)
    with pytest.raises(CorruptItem, match="'state' is neither"):
        store.verify(ITEM)
    with pytest.raises(StoreError):
        store.expose(ITEM, "inc1")


# --- items a restore round passed over (core.aside) ---------------------------------------------


def test_an_item_set_aside_leaves_the_index_keeps_its_bytes_and_comes_back(
    store: LocalStore,
) -> None:
    ingest(store, ITEM, b"kept")
    manifest = store.commit_ingested(ITEM)
    store.set_aside(ITEM)
    assert store.manifests() == {}
    assert store.get(ITEM) is None  # neither served, exposed, pushed nor counted
    with pytest.raises(StoreError):
        store.expose(ITEM, "inc")
    assert store.aside() == {ITEM: manifest}
    # A daemon restart keeps it aside.
    store, _ = reopen(store)
    try:
        assert store.manifests() == {}
        assert store.aside("job") == {ITEM: manifest}
        assert store.bring_back() == [ITEM]
        assert store.aside() == {}
        assert store.verify(ITEM) == manifest
    finally:
        store.close()


def test_a_copy_committed_again_wins_over_the_aside_one(store: LocalStore) -> None:
    ingest(store, ITEM, b"old")
    store.commit_ingested(ITEM)
    store.set_aside(ITEM)
    ingest(store, ITEM, b"new")
    newer = store.commit_ingested(ITEM)
    assert store.bring_back() == []
    assert store.aside() == {}
    assert store.verify(ITEM) == newer


def test_an_aside_item_is_deleted_only_when_asked(store: LocalStore) -> None:
    ingest(store, ITEM)
    store.commit_ingested(ITEM)
    store.set_aside(ITEM)
    store.delete_aside(ITEM)
    assert store.aside() == {}
    assert not (store.aside_root / "job").exists()
    store, _ = reopen(store)
    try:
        assert store.aside() == {}
        assert store.manifests() == {}
    finally:
        store.close()


def test_an_item_adopted_under_another_jobs_name_shares_its_files(store: LocalStore) -> None:
    """PopulationBasedTraining's exploit (``cluster.donor``): trial-b's step continued as
    trial-a's, by hard links; a manifest listing other files is refused."""
    donor = ItemId("trial-b", 6, 0, 0)
    ingest(store, donor, b"trial-b's weights")
    held = store.commit_ingested(donor)
    own = Manifest(ItemId("trial-a.x1", 6, 0, 0), held.kind, held.files, held.dirs)
    store.adopt(donor, own)
    assert store.get(own.item) == own
    adopted, original = store.data_path(own.item), store.data_path(donor)
    assert sorted(p.name for p in adopted.rglob("*")) == sorted(p.name for p in original.rglob("*"))
    first = next(p for p in adopted.rglob("*") if p.is_file())
    assert first.stat().st_nlink >= 2  # the same inode, not a copy
    store.verify(own.item)
    other = Manifest(ItemId("trial-c.x1", 6, 0, 0), held.kind, held.files[:0], held.dirs)
    with pytest.raises(StoreError, match="other files"):
        store.adopt(donor, other)
    with pytest.raises(StoreError, match="not in the local store"):
        store.adopt(ItemId("gone", 1, 0, 0), own)
    assert store.get(other.item) is None
    assert list(store.staging_root.iterdir()) == []
