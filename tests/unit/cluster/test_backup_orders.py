"""``cluster.backup_orders``: the coordinator's COMMIT of an ordered backup and the one error
policy every upload and COMMIT shares. A real state machine (``core.coordination``) brought
to the point where every uploader reported; COMMITs written by a callable of the test's own
or by a real ``BackupStore`` on an in-memory bucket. (The ordered uploads and the drain,
through ``ClusterMember``: tests/unit/cluster/test_membership.py.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from mtc_replicator.cluster.backup_orders import (
    Uploaded,
    commit_backup,
    commit_ordered,
    upload_items,
)
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.coordination import COMMIT_RETRY_SECONDS, JobCoordinator, Join
from mtc_replicator.core.manifest import ItemId, ManifestError
from mtc_replicator.core.policy import LastBackup
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import NodeInventory
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore, PermissionDenied

JOB = "job"
VIEW = '{"nodes": 2}'
CONFIG = JobConfig(
    job_name=JOB,
    framework=Framework.ORBAX,
    node_rank=0,
    nodes=2,
    backup_interval=BackupInterval(minutes=None, steps=10),
)


def ordered_and_uploaded() -> JobCoordinator:
    """A coordinator whose two ranks both reported step 10 uploaded: its COMMIT is due."""
    c = JobCoordinator(CONFIG, VIEW)
    for r in range(2):
        inventory = NodeInventory(r, f"127.0.0.1:{7000 + r}", {})
        c.join(Join(r, f"a{r}", VIEW, inventory), {})
    for r in range(2):
        s = c.status(r, f"a{r}")
        c.report_restore(r, f"a{r}", s.round, s.plan_version, ready=True)
    c.note_committed_backup(0, at=0.0)
    for r in range(2):
        c.report_progress(r, f"a{r}", Progress(replicated_step=10), now=1.0)
    assert c.backup_in_flight == 10
    for r in range(2):
        c.report_progress(r, f"a{r}", Progress(replicated_step=10, uploaded_step=10), now=2.0)
    assert c.take_commit() == 10
    return c


def ordered_again_after_the_retry_wait(c: JobCoordinator, now: float) -> bool:
    """Whether a report at ``now`` gets the backup ordered again."""
    c.report_progress(0, "a0", Progress(replicated_step=10, uploaded_step=10), now=now)
    return c.backup_in_flight == 10


class Commits:
    """``BackupStore.try_commit``'s shape: raises ``fail`` when set, else writes."""

    def __init__(self, fail: BaseException | None = None, missing: bool = False) -> None:
        self.fail = fail
        self.missing = missing
        self.keys: list[list[str]] = []

    def __call__(self, job: str, step: int, keys: Sequence[str]) -> CommitRecord | None:
        self.keys.append(list(keys))
        if self.fail is not None:
            raise self.fail
        return None if self.missing else CommitRecord(job, step, dict.fromkeys(keys, "0"), 5.0)


# --- the coordinator's COMMIT -----------------------------------------------------------------


def test_the_commit_names_every_uploaders_items_and_is_noted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = ordered_and_uploaded()
    commits = Commits()
    with caplog.at_level(logging.INFO):
        asyncio.run(commit_ordered(commits, c, 10, lambda: 3.0))
    assert commits.keys == [["0-0", "1-0"]]
    assert c.last_backup == LastBackup(10, 5.0)
    assert c.backup_in_flight is None
    assert "backup of step 10 committed: 2 items" in caplog.text


@pytest.mark.parametrize(
    ("commits", "why"),
    [
        (Commits(missing=True), "an uploaded item's manifest is missing"),
        (Commits(PermissionDenied("403: no create on COMMIT")), "403: no create on COMMIT"),
        (Commits(ManifestError("a manifest is not JSON")), "a manifest is not JSON"),
        (Commits(OSError(28, "No space left on device")), "[Errno 28] No space left on device"),
        (None, "this daemon has no backup store"),
    ],
    ids=["missing-manifest", "bucket-refuses", "bad-manifest", "disk", "no-backup"],
)
def test_a_commit_not_written_says_why_and_orders_the_backup_again_later(
    commits: Commits | None, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = ordered_and_uploaded()
    with caplog.at_level(logging.WARNING):
        asyncio.run(commit_ordered(commits, c, 10, lambda: 3.0))
    assert f"backup of step 10 not committed ({why}); ordering a backup again in 30s" in caplog.text
    assert c.last_backup == LastBackup(0, 0.0)
    assert not ordered_again_after_the_retry_wait(c, 3.0 + COMMIT_RETRY_SECONDS - 1)
    assert ordered_again_after_the_retry_wait(c, 3.0 + COMMIT_RETRY_SECONDS + 1)


def test_a_bug_in_the_commit_is_raised_as_one_and_the_backup_is_still_ordered_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug is not a bucket's failure: it is not logged as a step "not committed" for a
    reason that reads like the bucket's, it leaves with its traceback; and the job's
    backups do not stop on it (the coordinator is not left waiting on the COMMIT)."""
    c = ordered_and_uploaded()
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError, match="no such rank"):
        asyncio.run(commit_ordered(Commits(KeyError("no such rank")), c, 10, lambda: 3.0))
    assert "not committed" not in caplog.text
    assert ordered_again_after_the_retry_wait(c, 3.0 + COMMIT_RETRY_SECONDS + 1)


def test_a_real_bucket_is_committed_once_every_item_is_there(tmp_path: Path) -> None:
    backups = BackupStore(MemoryObjectStore())
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    store.open()
    config = JobConfig(job_name=JOB, framework=Framework.ORBAX, node_rank=0, nodes=1)
    item = ItemId(JOB, 10, 0, 0)
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard").write_bytes(b"weights")
    manifest = build_manifest(item, data)
    staged = store.new_staging()
    data.rename(staged / "data")
    store.commit_staged(staged, manifest)

    async def body() -> tuple[Uploaded, CommitRecord | None, CommitRecord | None]:
        before = await commit_backup(backups.try_commit, config, 10)
        log = JobLog(logging.getLogger(__name__), JOB, 0)
        upload = await upload_items(
            backups, store, config, 10, run_thread=asyncio.to_thread, log=log, metrics=NO_METRICS
        )
        after = await commit_backup(backups.try_commit, config, 10)
        return upload.result, before.record, after.record

    result, before, after = asyncio.run(body())
    assert result is Uploaded.DONE
    assert before is None  # nothing uploaded yet: a manifest is missing
    assert after is not None
    assert after.items.keys() == {"0-0"}
