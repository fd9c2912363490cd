"""``node.kept_upload.KeptUploads`` (``mtc upload``) on a real store and a real ``file://``
backup: what it uploads of a job that no longer runs here, when it commits, what it
refuses. Real files in ``tmp_path``; the daemon's thread pool is a real one."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.core.contract import render_config
from mtc_replicator.core.foreign import UploadRefused
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.kept_upload import KeptUploads
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from tests.unit.core.test_foreign import config
from tests.unit.node.test_reclaim import back_up, save


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalStore]:
    (tmp_path / "ckpt").mkdir()
    s = LocalStore(tmp_path / "ckpt")
    s.open()
    yield s
    s.close()


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def uploads(
    store: LocalStore,
    backups: BackupStore | None,
    executor: ThreadPoolExecutor,
    running: str | None = None,
) -> KeptUploads:
    return KeptUploads(
        store,
        backups,
        executor,
        ForeignItems(store, backups),
        current=lambda: frozenset() if running is None else {running},
        env={},
        cancelled=lambda: False,
    )


def test_a_one_node_jobs_newest_step_is_uploaded_and_committed(
    store: LocalStore, tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    for step in (10, 20):
        save(store, tmp_path, ItemId("job", step, 0, 0))
    kept = uploads(store, backups, executor)
    kept.foreign.ended("job", render_config(config()))
    done = asyncio.run(kept.upload("job"))
    assert (done.step, done.uploaded, done.bytes) == (20, (ItemId("job", 20, 0, 0),), 1000)
    assert (done.committed, done.already_committed, done.missing) == (True, False, ())
    assert set(backups.committed_steps("job")) == {20}
    assert kept.foreign.last["job"].backed_up  # mtc status sees it at once
    again = asyncio.run(kept.upload("job"))
    assert (again.already_committed, again.uploaded) == (True, ())


def test_a_cluster_job_is_committed_by_the_upload_that_completes_its_items(
    tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    stores = []
    for node, ranks in enumerate(((0, 1), (2,))):  # node 0 holds rank 1's copy too
        (tmp_path / f"n{node}").mkdir()
        s = LocalStore(tmp_path / f"n{node}" / "ckpt")
        s.checkpoint_dir.mkdir()
        s.open()
        stores.append(s)
        for r in ranks:
            save(s, tmp_path / f"n{node}", ItemId("job", 5, r, 0))
    try:
        first = uploads(stores[0], backups, executor)
        first.foreign.ended("job", render_config(config(rank=0, nodes=3, peers_per_node=1)))
        done = asyncio.run(first.upload("job"))
        assert (done.committed, [i.rank for i in done.missing]) == (False, [2])
        assert backups.committed_steps("job") == {}
        last = uploads(stores[1], backups, executor)
        last.foreign.ended("job", render_config(config(rank=2, nodes=3, peers_per_node=1)))
        assert asyncio.run(last.upload("job")).committed
        assert set(backups.committed_steps("job")) == {5}
    finally:
        for s in stores:
            s.close()


def test_it_refuses_the_running_job_a_job_it_lacks_the_layout_of_and_no_backup(
    store: LocalStore, tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    save(store, tmp_path, ItemId("job", 10, 0, 0))
    with pytest.raises(UploadRefused, match="runs on this node now"):
        asyncio.run(uploads(store, backups, executor, running="job").upload("job"))
    with pytest.raises(UploadRefused, match="holds no items of job nope"):
        asyncio.run(uploads(store, backups, executor).upload("nope"))
    with pytest.raises(UploadRefused, match="does not know job job's layout"):
        asyncio.run(uploads(store, backups, executor).upload("job"))
    with pytest.raises(UploadRefused, match="no --backup"):
        asyncio.run(uploads(store, None, executor).upload("job"))
    assert backups.committed_steps("job") == {}


def test_a_caller_that_gives_up_does_not_stop_the_upload(
    store: LocalStore, tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    save(store, tmp_path, ItemId("job", 10, 0, 0))
    kept = uploads(store, backups, executor)
    kept.foreign.ended("job", render_config(config()))

    async def give_up_then_ask_again() -> bool:
        caller = asyncio.ensure_future(kept.upload("job"))
        await asyncio.sleep(0)
        caller.cancel()  # the RPC's deadline
        with pytest.raises(asyncio.CancelledError):
            await caller
        return (await kept.upload("job")).committed  # joins it, or finds it committed

    assert asyncio.run(give_up_then_ask_again())
    assert set(backups.committed_steps("job")) == {10}


def test_an_older_step_than_the_backups_newest_is_uploaded_only_when_named(
    store: LocalStore, tmp_path: Path, executor: ThreadPoolExecutor
) -> None:
    """The job went on on other nodes and backed up step 30 there; this node kept step 10."""
    backups = BackupStore(FileObjectStore(tmp_path / "backup"))
    for step in (10, 30):
        save(store, tmp_path, ItemId("job", step, 0, 0))
    back_up(store, backups, ItemId("job", 30, 0, 0))
    store.delete(ItemId("job", 30, 0, 0))
    kept = uploads(store, backups, executor)
    kept.foreign.ended("job", render_config(config()))
    kept.foreign.held(frozenset())  # the daemon's last look at the bucket
    with pytest.raises(UploadRefused, match=r"holds a newer step of job job, 30, .* held here, 10"):
        asyncio.run(kept.upload("job"))
    assert asyncio.run(kept.upload("job", 10)).committed
    assert set(backups.committed_steps("job")) == {10, 30}
