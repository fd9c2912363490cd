"""``_publish`` replacing a committed item discards the old copy, then renames the
new one in. A kill between the two (or a failed rename) must not leave the node with
neither copy, nor an index that still lists an item whose files are gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import CorruptItem, ItemId
from mtc_replicator.local import store as store_mod
from mtc_replicator.local.store import DATA, LocalStore, StoreError

ITEM = ItemId("job", 10, 0, 0)


class Killed(BaseException):
    """The daemon dies here."""


def committed(ckpt: Path) -> LocalStore:
    s = LocalStore(ckpt)
    s.open()
    src = ckpt / "job-10-0-0.save"
    src.write_bytes(b"old committed bytes")
    s.take(src, ITEM)
    s.commit_ingested(ITEM)
    return s


def staged_copy(s: LocalStore):
    manifest = s.get(ITEM)
    staged = s.new_staging()
    (staged / DATA).write_bytes(b"old committed bytes")
    return staged, manifest


def fail_publish_rename(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    real = os.rename

    def rename(src, dst, *a, **k):
        if Path(dst).name == ITEM.key and "items" in Path(dst).parts:
            raise exc
        return real(src, dst, *a, **k)

    monkeypatch.setattr(store_mod.os, "rename", rename)


def test_a_kill_while_replacing_a_committed_item_keeps_one_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    s = committed(ckpt)
    staged, manifest = staged_copy(s)
    real = store_mod.fsutil.discard_tree

    def discard_then_die(path, trash):  # the kill lands right after the first discard
        real(path, trash)
        raise Killed

    monkeypatch.setattr(store_mod.fsutil, "discard_tree", discard_then_die)
    with pytest.raises(Killed):
        s.commit_staged(staged, manifest)
    monkeypatch.undo()
    s.close()
    again = LocalStore(ckpt)
    again.open()
    assert again.get(ITEM) is not None, "the committed item is gone after the restart"
    again.verify(ITEM)


def test_a_failed_replace_leaves_no_phantom_in_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    s = committed(ckpt)
    staged, manifest = staged_copy(s)
    if hasattr(store_mod.fsutil, "exchange"):  # the fallback, where renameat2 is missing

        def no_exchange(a, b):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(store_mod.fsutil, "exchange", no_exchange)
    fail_publish_rename(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(StoreError):
        s.commit_staged(staged, manifest)
    monkeypatch.undo()
    if s.get(ITEM) is not None:
        try:
            s.verify(ITEM)
        except CorruptItem as exc:
            pytest.fail(f"the index still lists {ITEM}, whose files are gone: {exc}")
