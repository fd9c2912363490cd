"""``node.reclaim.ForeignItems`` on a real store and a real ``file://`` backup: what it
reads of the bucket, what it drops, what it reports. Real files in ``tmp_path``."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from mtc_replicator.core.foreign import DropRefused
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.obs.metrics import Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore


class Recorded(Metrics):
    """Keeps what the daemon would export."""

    def __init__(self) -> None:
        self.unbacked: dict[str, int] = {}
        self.dropped = 0

    def held_without_backup(self, bytes_by_job: Mapping[str, int]) -> None:
        self.unbacked = dict(bytes_by_job)

    def foreign_dropped(self, job: str, nbytes: int) -> None:
        self.dropped += nbytes


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    (tmp_path / "ckpt").mkdir()
    s = LocalStore(tmp_path / "ckpt")
    s.open()
    yield s
    s.close()


def save(store: LocalStore, tmp_path: Path, item: ItemId, size: int = 1000) -> None:
    src = tmp_path / f"src-{item.job}-{item.step}-{item.key}"
    (src / "state").mkdir(parents=True)
    (src / "state" / "shard").write_bytes(b"x" * size)
    store.take(src, item)
    store.commit_ingested(item)


def back_up(store: LocalStore, backups: BackupStore, item: ItemId) -> None:
    manifest = store.get(item)
    assert manifest is not None
    backups.upload_item(manifest, store.data_path(item))
    assert backups.try_commit(item.job, item.step, [item.key]) is not None


def test_only_backed_up_jobs_go_after_the_ttl_and_the_rest_is_reported(
    store: LocalStore, tmp_path: Path
) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    for item in (ItemId("a", 10, 0, 0), ItemId("a", 20, 0, 0), ItemId("b", 5, 1, 0)):
        save(store, tmp_path, item)
    back_up(store, backups, ItemId("a", 20, 0, 0))
    save(store, tmp_path, ItemId("run", 1, 0, 0))
    metrics, clock = Recorded(), Clock()
    foreign = ForeignItems(store, backups, ttl=600.0, clock=clock, metrics=metrics)

    assert foreign.reclaim({"run"}) == []  # nothing needs room (the disk is large), no TTL yet
    assert foreign.last["a"].backed_up
    assert not foreign.last["b"].backed_up
    assert metrics.unbacked == {"b": 1000}

    clock.offset = 601.0
    (dropped,) = foreign.reclaim({"run"})
    assert (dropped.job, dropped.steps, dropped.bytes) == ("a", {0: [10, 20]}, 2000)
    assert metrics.dropped == 2000
    assert {i.job for i in store.manifests()} == {"b", "run"}  # an only copy stays
    assert foreign.reclaim(frozenset()) == []


def test_a_job_that_just_stopped_here_counts_from_then(store: LocalStore, tmp_path: Path) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    save(store, tmp_path, ItemId("a", 10, 0, 0))
    back_up(store, backups, ItemId("a", 10, 0, 0))
    clock = Clock()
    foreign = ForeignItems(store, backups, ttl=600.0, clock=clock)
    clock.offset = 1000.0
    foreign.ended("a")  # it ran here until now, though its last save is older
    assert foreign.reclaim({"b"}) == []
    clock.offset = 1601.0
    assert [d.job for d in foreign.reclaim({"b"})] == ["a"]


def test_room_for_a_push_drops_what_it_needs(store: LocalStore, tmp_path: Path) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    save(store, tmp_path, ItemId("a", 10, 0, 0))
    back_up(store, backups, ItemId("a", 10, 0, 0))
    foreign = ForeignItems(store, backups)
    assert [d.job for d in foreign.make_room({"b"}, 1)] == ["a"]


def test_the_operators_drop_refuses_what_it_must(store: LocalStore, tmp_path: Path) -> None:
    save(store, tmp_path, ItemId("a", 10, 0, 0))
    save(store, tmp_path, ItemId("run", 1, 0, 0))
    foreign = ForeignItems(store, None)  # no backup: nothing is backed up
    with pytest.raises(DropRefused, match="runs on this node now"):
        foreign.drop("run", {"run"}, only_copy=True)
    with pytest.raises(DropRefused, match="may be its only copy"):
        foreign.drop("a", {"run"}, only_copy=False)
    assert foreign.drop("a", {"run"}, only_copy=True).steps == {0: [10]}
    with pytest.raises(DropRefused, match="holds no items of job a"):
        foreign.drop("a", {"run"}, only_copy=True)
    assert {i.job for i in store.manifests()} == {"run"}


def test_a_job_accepted_meanwhile_is_never_dropped(store: LocalStore, tmp_path: Path) -> None:
    """The caller named the running job, then the daemon accepted another: the drop checks
    which job runs right before it deletes anything."""
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    save(store, tmp_path, ItemId("a", 10, 0, 0))
    back_up(store, backups, ItemId("a", 10, 0, 0))
    foreign = ForeignItems(store, backups, ttl=0.0, current=lambda: {"a"})
    assert foreign.reclaim(frozenset()) == []
    with pytest.raises(DropRefused, match="runs on this node now"):
        foreign.drop("a", frozenset(), only_copy=True)
    assert {i.job for i in store.manifests()} == {"a"}


def test_the_config_a_job_ended_with_is_kept_while_its_items_are(
    store: LocalStore, tmp_path: Path
) -> None:
    save(store, tmp_path, ItemId("a", 10, 0, 0))
    save(store, tmp_path, ItemId("b", 10, 0, 0))
    foreign = ForeignItems(store, None)
    foreign.ended("a", "job-name: a\n")
    foreign.ended("b", "job-name: b\n")
    foreign.ended("c")  # none given (a job whose name another owner holds): nothing kept
    assert (foreign.configs.load("a"), foreign.configs.load("c")) == ("job-name: a\n", None)
    # In the store, so a restarted daemon has it too.
    assert ForeignItems(store, None).configs.load("b") == "job-name: b\n"
    foreign.drop("a", frozenset(), only_copy=True)
    assert foreign.configs.load("a") is None
    foreign.purge()
    assert foreign.configs.load("b") is None
