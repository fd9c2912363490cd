"""``core.handoff``: whether the store is the current owner's, and its record. Then the
store's side: ``LocalStore.purge`` empties it, and no copy staged before a purge is ever
committed after (real files in ``tmp_path``, no sockets)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.handoff import (
    NoRecord,
    StoreHandoff,
    decide_handoff,
    owner_record,
    parse_owner_record,
)
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import DATA, LocalStore, StoreError
from mtc_replicator.local.store_owner import RECORD_FILE, read_store_owner, write_store_owner

ITEM = ItemId("job", 10, 0, 0)


@pytest.mark.parametrize(
    ("recorded", "current", "decision"),
    [
        ("team-a", "team-a", StoreHandoff.KEEP),
        ("team-a", "team-b", StoreHandoff.PURGE),
        (NoRecord.MISSING, "team-a", StoreHandoff.ADOPT),  # new store, or the upgrade
        (NoRecord.MALFORMED, "team-a", StoreHandoff.PURGE),  # protects nobody's items
        ("", "team-a", StoreHandoff.PURGE),  # an unowned store meets an owner file
    ],
)
def test_decide_handoff(recorded: str | NoRecord, current: str, decision: StoreHandoff) -> None:
    assert decide_handoff(recorded, current) is decision


def test_the_record_round_trips_and_refuses_what_we_never_wrote() -> None:
    assert parse_owner_record(owner_record("team-a")) == "team-a"
    for raw in (b"team-a", b"Team A\n", b"../x\n", b"\xff\n", b"a" * 300 + b"\n"):
        with pytest.raises(BadOwner):
            parse_owner_record(raw)
    with pytest.raises(BadOwner):
        owner_record("Team A")


def test_the_record_file(tmp_path: Path) -> None:
    assert read_store_owner(tmp_path) is NoRecord.MISSING
    write_store_owner(tmp_path, "team-a")
    assert read_store_owner(tmp_path) == "team-a"
    (tmp_path / RECORD_FILE).write_bytes(b"{}\n")
    assert read_store_owner(tmp_path) is NoRecord.MALFORMED
    (tmp_path / RECORD_FILE).unlink()
    (tmp_path / RECORD_FILE).symlink_to(tmp_path / "elsewhere")
    assert read_store_owner(tmp_path) is NoRecord.MALFORMED  # never followed


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    s = LocalStore(ckpt)
    s.open()
    yield s
    s.close()


def _staged(store: LocalStore, item: ItemId) -> tuple[Path, Manifest]:
    staged = store.new_staging()
    (staged / DATA).mkdir()
    (staged / DATA / "shard").write_bytes(b"bytes of " + str(item).encode())
    return staged, build_manifest(item, staged / DATA, root=store.root)


def test_purge_empties_the_store_and_refuses_copies_staged_before_it(store: LocalStore) -> None:
    staged, manifest = _staged(store, ITEM)
    store.commit_staged(staged, manifest)
    other = ItemId("job", 11, 1, 0)
    late, late_manifest = _staged(store, other)  # a push that arrives across the handoff
    src = store.checkpoint_dir / "12"
    src.mkdir()
    store.take(src, ItemId("job", 12, 0, 0))

    gone = store.purge()
    assert list(gone) == [ITEM]
    assert store.manifests() == {}
    assert store.pending_ingest() == []
    assert not any(store.items_root.iterdir())
    with pytest.raises(StoreError, match="purged meanwhile"):
        store.commit_staged(late, late_manifest)
    assert store.get(other) is None
    assert not any(store.items_root.iterdir())

    fresh, fresh_manifest = _staged(store, other)  # after the purge: the new owner's
    store.commit_staged(fresh, fresh_manifest)
    assert store.get(other) is not None


def test_purge_takes_the_items_a_round_set_aside_too(store: LocalStore) -> None:
    """A's items a restore round set aside would rejoin the next incarnation's inventory
    (``bring_back``): B's, after a handoff. The purge takes them with the rest."""
    staged, manifest = _staged(store, ITEM)
    store.commit_staged(staged, manifest)
    store.set_aside(ITEM)
    assert store.aside() == {ITEM: manifest}

    gone = store.purge()
    assert list(gone) == [ITEM]
    assert store.aside() == {}
    assert store.bring_back() == []
    assert not any(store.aside_root.iterdir())  # nothing for a restarted daemon to find
