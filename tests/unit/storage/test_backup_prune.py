"""Tests for ``mtc_replicator.storage.backup_prune``: deleting steps COMMIT first, applying a plan
with each step checked again, on real backups (layouts v1 and v2) in the in-memory store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import LAYOUT_V1, commit_key, data_key, manifest_key
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.prune import Action, RetentionPolicy, plan_prune
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.backup_audit import ProblemKind, scan_job
from mtc_replicator.storage.backup_prune import apply_prune, delete_step, prune_facts
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.storage.restore_pins import RestorePin, write_restore_pin
from tests.unit.storage.test_backup import flip_object_byte, upload_v1
from tests.unit.storage.test_backup_audit import JOB, upload_step, verify
from tests.unit.storage.test_restore_pins import DIGEST

HOUR = 3600.0
DAY = 24 * HOUR
BASE = 1_700_006_400.0
"""2023-11-15T00:00:00Z, a Wednesday."""


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def backup(objects: MemoryObjectStore) -> BackupStore:
    return BackupStore(objects)


# --- prune I/O ----------------------------------------------------------------------------


class DeleteLog(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def test_delete_step_removes_commit_first_then_manifests_then_data(tmp_path: Path) -> None:
    objects = DeleteLog()
    upload_step(BackupStore(objects), tmp_path, 100)
    upload_step(BackupStore(objects), tmp_path, 1000)
    count, size = delete_step(objects, JOB, 100)
    assert objects.deleted[0] == commit_key(JOB, 100)
    assert set(objects.deleted[1:3]) == {
        manifest_key(ItemId(JOB, 100, 0, 0)),
        manifest_key(ItemId(JOB, 100, 1, 0)),
    }
    assert count == len(objects.deleted) == 6
    assert size > 6000
    assert [i.key for i in objects.list(f"{JOB}/100/")] == []
    assert len(list(objects.list(f"{JOB}/1000/"))) == 6  # step 1000 shares the digits only


def test_apply_prune_deletes_what_the_plan_says(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    for step, at in ((100, BASE), (200, BASE + DAY), (300, BASE + 2 * DAY)):
        upload_step(backup, tmp_path, step, commit_at=at)
    upload_step(backup, tmp_path, 400, commit_at=None)  # memory clock: written "long ago"
    listing = scan_job(objects, JOB)
    policy = RetentionPolicy(keep_last=2, min_age_seconds=60)
    decisions = plan_prune(policy, prune_facts(listing), now=BASE + 3 * DAY)
    assert [(d.step, d.action) for d in decisions] == [
        (400, Action.DELETE),
        (300, Action.KEEP),
        (200, Action.KEEP),
        (100, Action.DELETE),
    ]
    done = apply_prune(objects, JOB, decisions, min_age_seconds=60, now=BASE + 3 * DAY)
    assert [(d.step, d.skipped) for d in done] == [(100, None), (400, None)]
    assert set(backup.committed_steps(JOB)) == {200, 300}
    assert [s.step for s in scan_job(objects, JOB).steps] == [300, 200]


def test_apply_prune_rechecks_each_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=BASE)
    upload_step(backup, tmp_path, 200, commit_at=None)
    upload_step(backup, tmp_path, 300, commit_at=None)
    upload_step(backup, tmp_path, 400, commit_at=BASE + DAY)
    listing = scan_job(objects, JOB)
    policy = RetentionPolicy(keep_last=1, min_age_seconds=60)
    decisions = plan_prune(policy, prune_facts(listing), now=BASE + 3 * DAY)
    assert {d.step for d in decisions if d.action is Action.DELETE} == {100, 200, 300}
    # Meanwhile: an operator pins 100, step 200 gets its COMMIT, step 300 a new object.
    write_restore_pin(objects, RestorePin(JOB, 100, 1.0, DIGEST))
    assert backup.try_commit(JOB, 200, ["0-0", "1-0"]) is not None
    newest = max(i.mtime for i in objects.list(""))
    objects.put_bytes(f"{JOB}/300/2-0/late", b"x")
    done = apply_prune(objects, JOB, decisions, min_age_seconds=60, now=newest + 30)
    assert [(d.step, d.objects) for d in done] == [(100, 0), (200, 0), (300, 0)]
    assert all(d.skipped for d in done)
    assert set(backup.committed_steps(JOB)) == {100, 200, 400}


def test_a_v1_backup_lists_verifies_and_prunes(tmp_path: Path) -> None:
    """A step written before layout v2 (no ``<hh>/``, no ``layout`` in its COMMIT), beside
    a v2 step: ``mtc backups`` lists, verifies and prunes both."""
    objects = DeleteLog()
    backup = BackupStore(objects)
    old = upload_v1(backup, tmp_path, 50)
    upload_step(backup, tmp_path, 100)
    steps = {s.step: s for s in scan_job(objects, JOB).steps}
    assert (steps[50].commit, steps[50].manifests) == (old, 2)
    assert steps[100].manifests == 2
    verdict = verify(objects, 50)
    assert verdict.ok
    assert verdict.unexpected == ()
    assert (verdict.items, verdict.objects_checked) == (2, 4)
    key = data_key(ItemId(JOB, 50, 1, 0), "", LAYOUT_V1)
    flip_object_byte(objects, key, 0)
    assert [(p.kind, p.key) for p in verify(objects, 50).problems] == [
        (ProblemKind.CHECKSUM_MISMATCH, key)
    ]
    delete_step(objects, JOB, 50)
    assert objects.deleted[0] == commit_key(JOB, 50)
    assert set(objects.deleted[1:3]) == {
        manifest_key(ItemId(JOB, 50, r, 0), LAYOUT_V1) for r in (0, 1)
    }
    assert list(objects.list(f"{JOB}/50/")) == []
    assert set(backup.committed_steps(JOB)) == {100}
