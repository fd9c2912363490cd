"""``node.owner_watch``: the owner file read on the pool given, the periodic read due at most
once a second."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.core.ownership import UNOWNED, BadOwner
from mtc_replicator.local.store_owner import write_store_owner
from mtc_replicator.node.owner_watch import CHECK_EVERY, OwnerWatch, handed_over, read_owner
from tests.unit.core.test_ownership import owner_json


def _write(path: Path, namespace: str) -> None:
    path.write_text(json.dumps(owner_json(namespace=namespace)))


def test_read_owner_names_the_file_when_it_cannot_be_used(tmp_path: Path) -> None:
    path = tmp_path / "owner.json"
    assert read_owner(None) == UNOWNED
    with pytest.raises(BadOwner, match="cannot read the owner file"):
        read_owner(path)
    path.write_bytes(b"{not json")
    with pytest.raises(BadOwner, match="is malformed"):
        read_owner(path)
    _write(path, "team-a")
    assert read_owner(path) == "team-a"


def test_the_watch_reads_on_its_pool_and_is_due_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "owner.json"
    _write(path, "team-a")
    now = [100.0]
    threads: list[str] = []

    class Pool(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            threads.append("pool")
            return super().submit(fn, *args, **kwargs)

    with Pool(max_workers=1) as pool:
        watch = OwnerWatch(path, pool, clock=lambda: now[0])
        due = [watch.due()]
        now[0] += CHECK_EVERY / 2
        due.append(watch.due())  # too soon
        now[0] += CHECK_EVERY / 2
        due.append(watch.due())
        assert due == [True, False, True]
        assert OwnerWatch(None, pool).due() is False
        assert asyncio.run(watch.read()) == "team-a"
        _write(path, "team-b")
        assert asyncio.run(watch.read()) == "team-b"
        path.unlink()
        with pytest.raises(BadOwner):
            asyncio.run(watch.read())
    assert threads == ["pool"] * 3


def test_handed_over_while_owner_json_and_the_stores_record_differ(tmp_path: Path) -> None:
    path, store = tmp_path / "owner.json", tmp_path / "store"
    store.mkdir()
    assert handed_over(None, store) is False  # no owner file: nobody's node
    assert handed_over(path, store) is False  # unreadable: the handshake is refused instead
    _write(path, "team-a")
    assert handed_over(path, store) is False  # no record yet: adopted
    write_store_owner(store, "team-a")
    assert handed_over(path, store) is False
    _write(path, "team-b")
    assert handed_over(path, store) is True  # until the purge records team-b
    write_store_owner(store, "team-b")
    assert handed_over(path, store) is False
