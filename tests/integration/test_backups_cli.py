"""``mtc backups list|verify|restore|prune`` as an operator runs it: the real CLI in a
subprocess, against a ``file://`` backup written by the real ``BackupStore``.

The backup of job J holds steps 100, 200, 300 (committed two, one and a half days ago,
hours apart), 400 (items uploaded, no COMMIT, nothing written for three hours: abandoned)
and 500 (no COMMIT, written just now: still uploading); another job has one step.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.core.backup_layout import data_key, item_prefix, manifest_key
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.storage.restore_pins import read_restore_pin, resolve_restore_pin
from mtc_replicator.storage.stores import open_object_store
from tests.storage_servers import Bucket

pytestmark = pytest.mark.integration

COMMITTED = (100, 200, 300)
ABANDONED = 400
UPLOADING = 500
DAY = 86400.0


class Backup:
    def __init__(self, root: Path, job: str) -> None:
        self.root = root / "backup"
        self.url = self.root.as_uri()
        self.job = job
        self.store = BackupStore(FileObjectStore(self.root))
        now = time.time()
        commit_times = {100: now - 2 * DAY, 200: now - 1.5 * DAY, 300: now - 1.5 * DAY + 3600}
        for step in (*COMMITTED, ABANDONED, UPLOADING):
            self.upload(root, job, step, commit_at=commit_times.get(step))
        three_hours_ago = now - 3 * 3600
        for path in (self.root / job / str(ABANDONED)).rglob("*"):
            os.utime(path, (three_hours_ago, three_hours_ago))
        self.upload(root, "other-job", 7, commit_at=now)

    def upload(self, root: Path, job: str, step: int, commit_at: float | None) -> None:
        keys = []
        for rank in range(2):
            src = root / "src" / f"{job}-{step}-{rank}"
            (src / "state").mkdir(parents=True)
            (src / "state" / "weights").write_bytes(os.urandom(64 * 1024))
            (src / "_CHECKPOINT_METADATA").write_bytes(b'{"step": %d}' % step)
            manifest = build_manifest(ItemId(job, step, rank, 0), src)
            self.store.upload_item(manifest, src)
            keys.append(manifest.item.key)
        if commit_at is not None:
            assert self.store.try_commit(job, step, keys, now=commit_at) is not None

    def step_dir(self, step: int) -> Path:
        return self.root / self.job / str(step)

    def item_dir(self, step: int, rank: int) -> Path:
        return self.root / item_prefix(ItemId(self.job, step, rank, 0))

    def key(self, step: int, rank: int, path: str) -> str:
        return data_key(ItemId(self.job, step, rank, 0), path)

    def files(self) -> dict[str, str]:
        """Every object file and a hash of its bytes: the whole state of the backup."""
        return {
            str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }

    def flip_byte(self, step: int) -> Path:
        path = self.item_dir(step, 1) / "state" / "weights"
        data = bytearray(path.read_bytes())
        data[4321] ^= 0xFF
        path.write_bytes(bytes(data))
        return path


@pytest.fixture
def backup(tmp_path: Path, job: str) -> Backup:
    return Backup(tmp_path, job)


def mtc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def mtc_json(*args: str, rc: int = 0) -> Any:
    out = mtc(*args, "--json")
    assert out.returncode == rc, out.stdout + out.stderr
    return json.loads(out.stdout)


def test_list(backup: Backup) -> None:
    out = mtc("list", backup.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == backup.url
    assert f"job {backup.job}: 1 uploading, 1 partial, 3 committed (" in out.stdout
    assert "job other-job: 1 committed" in out.stdout
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("  ")}
    assert rows["500"][1:4] == ["uploading", "2", "6"]
    assert rows["400"][1:4] == ["partial", "2", "6"]
    assert rows["400"][-1] in ("2h59m", "3h0m")
    assert rows["300"][1:4] == ["committed", "2", "7"]
    assert rows["300"][5] == "KiB"
    assert rows["100"][-1] == "2d0h"

    doc = mtc_json("list", backup.url, "--job", backup.job)
    assert doc["url"] == backup.url
    (job,) = doc["jobs"]
    assert job["job"] == backup.job
    assert job["restore_pin"] is None
    states = {s["step"]: s["state"] for s in job["steps"]}
    assert states == {
        500: "uploading",
        400: "partial",
        300: "committed",
        200: "committed",
        100: "committed",
    }
    step300 = next(s for s in job["steps"] if s["step"] == 300)
    on_disk = sum(p.stat().st_size for p in backup.step_dir(300).rglob("*") if p.is_file())
    assert (step300["bytes"], step300["objects"], step300["items"]) == (on_disk, 7, 2)
    assert abs(step300["age_seconds"] - (1.5 * DAY - 3600)) < 120


def test_bad_urls_and_job_names_are_usage_errors(tmp_path: Path) -> None:
    for url in ("relative/path", "ftp://host/x"):
        out = mtc("list", url)
        assert out.returncode == 2
        assert "mtc backups: error:" in out.stderr
    out = mtc("verify", tmp_path.as_uri(), "--job", "../etc")
    assert out.returncode == 2
    assert "not a job name" in out.stderr


def test_verify_good_and_corrupt_steps(backup: Backup) -> None:
    out = mtc("verify", backup.url, "--job", backup.job, "--progress")
    assert out.returncode == 0, out.stdout + out.stderr
    for step in COMMITTED:
        assert f"job {backup.job} step {step}: OK (2 items, 4 objects, 128.0 KiB)" in out.stdout
    assert "3 steps verified: 3 OK, 0 CORRUPT" in out.stdout
    assert "100%" in out.stderr  # the progress bar, forced although stderr is a pipe

    quiet = mtc("verify", backup.url, "--job", backup.job)
    assert quiet.stderr == ""  # no bar when stderr is not a terminal

    flipped = backup.flip_byte(200)
    (backup.item_dir(100, 0) / "_CHECKPOINT_METADATA").unlink()
    out = mtc("verify", backup.url, "--job", backup.job)
    assert out.returncode == 1
    assert f"job {backup.job} step 300: OK" in out.stdout
    assert f"job {backup.job} step 200: CORRUPT" in out.stdout
    weights, metadata = (
        backup.key(200, 1, "state/weights"),
        backup.key(100, 0, "_CHECKPOINT_METADATA"),
    )
    # A file with a digest is judged by it alone, as a restore judges it.
    assert f"checksum mismatch: item 1-0 {weights}: " in out.stdout
    assert "content digest (blake3)" in out.stdout
    assert f"missing object: item 0-0 {metadata}" in out.stdout
    assert "3 steps verified: 1 OK, 2 CORRUPT" in out.stdout

    doc = mtc_json("verify", backup.url, "--job", backup.job, "--step", "200", rc=1)
    assert doc["ok"] is False
    (step,) = doc["steps"]
    assert step["status"] == "CORRUPT"
    assert step["problems"] == [
        {
            "kind": "checksum_mismatch",
            "item": "1-0",
            "key": weights,
            "detail": step["problems"][0]["detail"],
        }
    ]
    assert str(flipped).endswith("1-0/state/weights")
    doc = mtc_json("verify", backup.url, "--job", backup.job, "--step", "300")
    assert doc["ok"] is True

    out = mtc("verify", backup.url, "--job", backup.job, "--step", str(ABANDONED))
    assert out.returncode == 1
    assert f"step {ABANDONED} of job {backup.job} is not committed" in out.stderr


def test_verify_a_modified_manifest(backup: Backup) -> None:
    manifest = backup.root / manifest_key(ItemId(backup.job, 300, 0, 0))
    body = json.loads(manifest.read_bytes())
    body["files"][0][1] += 1
    manifest.write_text(json.dumps(body))
    doc = mtc_json("verify", backup.url, "--job", backup.job, "--step", "300", rc=1)
    kinds = [p["kind"] for p in doc["steps"][0]["problems"]]
    assert kinds == ["manifest_digest_mismatch"]


def test_restore_pins_a_verified_committed_step(backup: Backup) -> None:
    pin_path = backup.root / "_control" / backup.job / "restore-pin.json"
    out = mtc("restore", backup.url, "--job", backup.job, "--step", "200")
    assert out.returncode == 2
    assert "--yes" in out.stderr
    assert not pin_path.exists()

    out = mtc("restore", backup.url, "--job", backup.job, "--step", str(ABANDONED), "--yes")
    assert out.returncode == 1
    assert "not committed" in out.stderr
    assert not pin_path.exists()

    out = mtc("restore", backup.url, "--job", backup.job, "--step", "200", "--yes")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"job {backup.job}: the next restore round will use backup step 200" in out.stdout
    pin = json.loads(pin_path.read_bytes())
    commit = (backup.step_dir(200) / "COMMIT").read_bytes()
    assert pin["job"] == backup.job
    assert pin["step"] == 200
    assert pin["version"] == 1
    assert abs(pin["requested_at"] - time.time()) < 60
    assert pin["commit_digest"] == hashlib.sha256(commit).hexdigest()
    objects = FileObjectStore(backup.root)
    read = read_restore_pin(objects, backup.job)
    assert read is not None
    assert resolve_restore_pin(objects, read).step == 200
    assert backup.job in mtc("list", backup.url).stdout
    assert "next restore pinned to step 200" in mtc("list", backup.url).stdout
    assert set(backup.store.committed_steps(backup.job)) == set(COMMITTED)

    # A corrupt step is refused and the pin stays as it was; --no-verify takes it anyway.
    backup.flip_byte(300)
    out = mtc("restore", backup.url, "--job", backup.job, "--step", "300", "--yes")
    assert out.returncode == 1
    assert "checksum mismatch" in out.stdout
    assert "nothing pinned" in out.stderr
    assert json.loads(pin_path.read_bytes())["step"] == 200
    out = mtc("restore", backup.url, "--job", backup.job, "--step", "300", "--yes", "--no-verify")
    assert out.returncode == 0
    assert "(unverified, unsigned) (replacing the pin of step 200)" in out.stdout
    assert json.loads(pin_path.read_bytes())["step"] == 300

    out = mtc("restore", backup.url, "--job", backup.job, "--clear")
    assert out.returncode == 0
    assert "restore pin removed" in out.stdout
    assert not pin_path.exists()


def test_a_malformed_pin_is_reported_not_fatal(backup: Backup) -> None:
    pin_path = backup.root / "_control" / backup.job / "restore-pin.json"
    pin_path.parent.mkdir(parents=True)
    pin_path.write_bytes(b'{"version": 1, "job": "../../etc", "step": -1}')
    out = mtc("list", backup.url, "--job", backup.job)
    assert out.returncode == 0
    assert "restore pin unusable: restore pin" in out.stdout
    out = mtc("prune", backup.url, "--job", backup.job, "--keep-last", "1", "--apply")
    assert out.returncode == 1
    assert "mtc backups pin --clear" in out.stderr
    assert set(backup.store.committed_steps(backup.job)) == set(COMMITTED)


def test_prune_is_a_dry_run_until_apply(backup: Backup) -> None:
    before = backup.files()
    out = mtc("prune", backup.url, "--job", backup.job)
    assert out.returncode == 2
    assert "retention policy" in out.stderr

    out = mtc("prune", backup.url, "--job", backup.job, "--keep-last", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dry run: nothing is deleted" in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert rows["500"][1:3] == ["uploading", "keep"]
    assert rows["400"][1:3] == ["partial", "delete"]
    assert rows["300"][1:3] == ["committed", "keep"]
    assert rows["200"][1:3] == ["committed", "keep"]
    assert rows["100"][1:3] == ["committed", "delete"]
    assert "would delete 2 steps: 13 objects," in out.stdout
    doc = mtc_json("prune", backup.url, "--job", backup.job, "--keep-last", "2")
    assert doc["apply"] is False
    assert doc["deleted"] == []
    actions = {s["step"]: (s["action"], s["reasons"]) for s in doc["steps"]}
    assert actions[300] == ("keep", ["newest committed", "last 2"])
    assert actions[100] == ("delete", ["no keep rule selects it"])
    assert backup.files() == before

    doc = mtc_json("prune", backup.url, "--job", backup.job, "--keep-last", "2", "--apply")
    assert doc["apply"] is True
    assert sorted(d["step"] for d in doc["deleted"]) == [100, ABANDONED]
    assert set(backup.store.committed_steps(backup.job)) == {200, 300}
    after = backup.files()
    gone = {f for f in before if f not in after}
    assert gone == {f for f in before if f.startswith((f"{backup.job}/100/", f"{backup.job}/400/"))}
    assert {f for f in after if f not in before} == set()
    assert mtc("verify", backup.url, "--job", backup.job).returncode == 0
    assert any(f.startswith("other-job/7/") for f in after)


def test_prune_keeps_the_pinned_and_the_newest_verified_step(backup: Backup) -> None:
    assert mtc("restore", backup.url, "--job", backup.job, "--step", "100", "--yes").returncode == 0
    backup.flip_byte(300)
    out = mtc(
        "prune",
        backup.url,
        "--job",
        backup.job,
        "--keep-last",
        "1",
        "--verify-newest",
        "--min-age-minutes",
        "0",
        "--apply",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"job {backup.job} step 300: CORRUPT" in out.stdout
    assert f"job {backup.job} step 200: OK" in out.stdout
    assert "deleted 2 steps:" in out.stdout  # the partial steps, 400 and 500
    assert set(backup.store.committed_steps(backup.job)) == {100, 200, 300}
    assert not backup.step_dir(UPLOADING).exists() or not any(
        p.is_file() for p in backup.step_dir(UPLOADING).rglob("*")
    )


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_the_cli_works_on_bucket_urls(
    tmp_path: Path, job: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """The same commands on ``s3://`` and ``gs://``, reaching the servers only through the
    SDKs' standard environment."""
    bucket: Bucket = request.getfixturevalue(f"{kind}_bucket")
    store = BackupStore(open_object_store(bucket.url))
    src = tmp_path / "src"
    (src / "state").mkdir(parents=True)
    (src / "state" / "weights").write_bytes(os.urandom(256 * 1024))
    manifest = build_manifest(ItemId(job, 5, 0, 0), src)
    store.upload_item(manifest, src)
    assert store.try_commit(job, 5, [manifest.item.key]) is not None

    def mtc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", *args],
            check=False,
            capture_output=True,
            text=True,
            env={**os.environ, **bucket.env},
        )

    listed = mtc("list", bucket.url, "--job", job, "--json")
    assert listed.returncode == 0, listed.stderr
    assert "committed" in listed.stdout
    assert str(5) in listed.stdout
    verified = mtc("verify", bucket.url, "--job", job)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # Damage the stored object (through the SDK, as a bucket user could) and verify again.
    key = data_key(ItemId(job, 5, 0, 0), "state/weights")
    objects = store.objects
    objects.put_bytes(key, b"x" * (256 * 1024))
    damaged = mtc("verify", bucket.url, "--job", job)
    assert damaged.returncode == 1
    assert "checksum" in (damaged.stdout + damaged.stderr).lower()
