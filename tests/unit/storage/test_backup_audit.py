"""Tests for ``mtc_replicator.storage.backup_audit``: listing and verifying real backups made by
``BackupStore`` on the in-memory object store. Its helpers make backups for the tests of
``restore_pins`` and ``backup_prune`` too.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import CommitRecord, commit_key, data_key, manifest_key
from mtc_replicator.core.manifest import FileEntry, ItemId, ItemKind, Manifest
from mtc_replicator.core.prune import StepState
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.backup_audit import (
    ProblemKind,
    StepVerdict,
    find_newest_verified,
    list_jobs,
    plan_verify,
    run_verify,
    scan_job,
    verify_step,
)
from mtc_replicator.storage.objectstore import MemoryObjectStore
from tests.forge import same_crc32c

JOB = "job"


# --- a real backup in memory -----------------------------------------------------------------


def upload_step(
    backup: BackupStore,
    tmp: Path,
    step: int,
    *,
    ranks: int = 2,
    commit_at: float | None = 1000.0,
    job: str = JOB,
) -> dict[str, Manifest]:
    """Upload ``ranks`` items of ``step`` (rank 0 a tree, the rest files); commit unless None."""
    manifests: dict[str, Manifest] = {}
    for rank in range(ranks):
        item = ItemId(job, step, rank, 0)
        src = tmp / f"{job}-{step}-{rank}"
        if rank == 0:
            (src / "sub").mkdir(parents=True)
            (src / "sub" / "a").write_bytes(os.urandom(3000))
            (src / "b").write_bytes(os.urandom(1000))
        else:
            src.write_bytes(os.urandom(2000))
        manifests[item.key] = build_manifest(item, src)
        backup.upload_item(manifests[item.key], src)
    if commit_at is not None:
        assert backup.try_commit(job, step, list(manifests), now=commit_at) is not None
    return manifests


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def backup(objects: MemoryObjectStore) -> BackupStore:
    return BackupStore(objects)


class Recorder:
    """A progress sink that remembers the total it heard."""

    def __init__(self) -> None:
        self.total = 0

    def __call__(self, n: int) -> None:
        assert n >= 0
        self.total += n


def verify(objects: MemoryObjectStore, step: int) -> StepVerdict:
    plan = plan_verify(objects, JOB, step)
    assert plan.committed
    heard = Recorder()
    verdict = run_verify(objects, plan, heard)
    assert heard.total == plan.total_bytes  # the bar always ends at 100%
    return verdict


def kinds(verdict: StepVerdict) -> list[ProblemKind]:
    return [p.kind for p in verdict.problems]


# --- listing -------------------------------------------------------------------------------


def test_scan_job_tells_committed_partial_and_invalid_steps_apart(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=500.0)
    upload_step(backup, tmp_path, 200, commit_at=None, ranks=1)
    upload_step(backup, tmp_path, 300, commit_at=None)
    objects.put_bytes(commit_key(JOB, 300), b"{broken")
    objects.put_bytes(f"{JOB}/stray", b"x")
    objects.put_bytes(f"{JOB}/007/x", b"x")  # not a step's spelling
    upload_step(backup, tmp_path, 5, job="other")

    assert list_jobs(objects) == [JOB, "other"]
    listing = scan_job(objects, JOB)
    assert [s.step for s in listing.steps] == [300, 200, 100]
    assert listing.stray == (f"{JOB}/007/x", f"{JOB}/stray")
    invalid, partial, committed = listing.steps
    assert invalid.commit is None
    assert invalid.commit_error is not None
    assert invalid.state(now=1e9) is StepState.INVALID
    assert (partial.items, partial.objects, partial.commit) == (1, 3, None)
    assert partial.bytes == 4000 + len(objects.get_bytes(manifest_key(ItemId(JOB, 200, 0, 0))))
    newest = partial.newest_object_at
    assert partial.state(now=newest + 10, min_age_seconds=60) is StepState.UPLOADING
    assert partial.state(now=newest + 60, min_age_seconds=60) is StepState.PARTIAL
    assert committed.commit is not None
    assert committed.commit.created == 500.0
    assert (committed.items, committed.objects) == (2, 6)
    assert committed.state(now=1e9) is StepState.COMMITTED
    assert scan_job(objects, "nothing").steps == ()


# --- verification --------------------------------------------------------------------------


def test_verify_a_good_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100)
    verdict = verify(objects, 100)
    assert verdict.ok
    assert (verdict.items, verdict.objects_checked, verdict.bytes_checked) == (2, 3, 6000)
    assert verdict.unexpected == ()


def test_verify_finds_a_flipped_byte(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100)
    key = data_key(manifests["0-0"].item, "sub/a")
    data = bytearray(objects.get_bytes(key))
    data[1234] ^= 0x01
    objects.put_bytes(key, bytes(data))
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ProblemKind.CHECKSUM_MISMATCH]
    problem = verdict.problems[0]
    assert (problem.item, problem.key) == ("0-0", key)
    assert "manifest says" in problem.detail


def test_verify_reports_every_problem_of_a_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100, ranks=3)
    objects.delete(data_key(manifests["0-0"].item, "b"))
    objects.put_bytes(data_key(manifests["1-0"].item, ""), b"short")
    # Rank 2's manifest swapped for one that describes other bytes: its digest differs.
    swapped = Manifest(manifests["2-0"].item, ItemKind.FILE, (FileEntry("", 5, 0, "0" * 64),))
    objects.put_bytes(manifest_key(manifests["2-0"].item), swapped.to_json())
    objects.put_bytes(f"{JOB}/100/0-0/extra", b"x")
    verdict = verify(objects, 100)
    assert kinds(verdict) == [
        ProblemKind.MANIFEST_DIGEST_MISMATCH,
        ProblemKind.MISSING_OBJECT,
        ProblemKind.SIZE_MISMATCH,
    ]
    assert "5 bytes, manifest says 2000" in verdict.problems[2].detail
    assert verdict.unexpected == (f"{JOB}/100/0-0/extra",)


def test_verify_a_commit_naming_a_missing_manifest(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    committed = backup.try_commit(JOB, 100, ["0-0", "1-0"])
    assert committed is not None
    items = {**committed.items, "7-0": "cd" * 32}
    objects.delete(commit_key(JOB, 100))
    objects.put_bytes(commit_key(JOB, 100), CommitRecord(JOB, 100, items, 1.0).to_json())
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ProblemKind.MISSING_MANIFEST]
    assert verdict.problems[0].item == "7-0"


@pytest.mark.parametrize(
    "commit",
    [
        b"{nope",
        json.dumps({"job": "other", "step": 100, "items": {}, "created": 1}).encode(),
        json.dumps({"job": JOB, "step": 100, "items": {}, "created": 10**400}).encode(),
    ],
)
def test_verify_an_invalid_commit(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path, commit: bytes
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    objects.put_bytes(commit_key(JOB, 100), commit)
    assert kinds(verify(objects, 100)) == [ProblemKind.INVALID_COMMIT]


def test_verify_an_invalid_manifest(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100)
    objects.put_bytes(manifest_key(manifests["1-0"].item), b'{"version": 1, "job": "../x"}')
    assert kinds(verify(objects, 100)) == [ProblemKind.INVALID_MANIFEST]


def test_a_partial_step_is_not_verified(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    assert not plan_verify(objects, JOB, 100).committed
    assert verify_step(objects, JOB, 100) is None


def test_find_newest_verified_walks_down_past_corrupt_steps(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    for step in (100, 200, 300):
        upload_step(backup, tmp_path, step)
    objects.delete(data_key(ItemId(JOB, 300, 1, 0), ""))
    newest, verdicts = find_newest_verified(objects, JOB, [100, 200, 300])
    assert newest == 200
    assert [(v.step, v.ok) for v in verdicts] == [(300, False), (200, True)]


def test_a_hostile_commit_is_listed_as_invalid_not_a_crash(objects: MemoryObjectStore) -> None:
    body = {"job": JOB, "step": 1, "items": {}, "created": 10**400}
    objects.put_bytes(commit_key(JOB, 1), json.dumps(body).encode())
    (step,) = scan_job(objects, JOB).steps
    assert step.state(now=0) is StepState.INVALID
    assert step.commit_error is not None
    assert step.commit_error.startswith("COMMIT has a bad timestamp")


def test_verify_reports_an_object_of_the_same_size_and_crc32c(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    """``mtc backups verify`` sees what a restore would refuse: a crc32c forged on purpose."""
    manifests = upload_step(backup, tmp_path, 100, ranks=2)
    key = data_key(manifests["1-0"].item, "")
    objects.put_bytes(key, same_crc32c(objects.get_bytes(key)))
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ProblemKind.CHECKSUM_MISMATCH]
    assert "content digest" in verdict.problems[0].detail


def test_verify_decides_a_format_2_file_by_its_digest_as_a_restore_does(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    """A manifest whose crc32c is wrong but whose digest is right: a restore takes it
    (``tests/unit/local/test_digests_decide.py``), so verify reports nothing; a flipped byte of
    another object is still its digest's mismatch."""
    manifests = upload_step(backup, tmp_path, 100, ranks=3, commit_at=None)
    lying = manifests["1-0"]
    lying = dataclasses.replace(
        lying, files=(dataclasses.replace(lying.files[0], crc32c=lying.files[0].crc32c ^ 1),)
    )
    objects.put_bytes(manifest_key(lying.item), lying.to_json())
    assert backup.try_commit(JOB, 100, list(manifests), now=1000.0) is not None
    assert kinds(verify(objects, 100)) == []
    key = data_key(manifests["2-0"].item, "")
    raw = bytearray(objects.get_bytes(key))
    raw[7] ^= 0x10
    objects.put_bytes(key, bytes(raw))
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ProblemKind.CHECKSUM_MISMATCH]
    assert "content digest" in verdict.problems[0].detail
