"""``mtc backups``: every "not found" exits non-zero, ``--all-jobs``, ``download``, and the
progress bar; the real CLI in a subprocess against backups written by the real BackupStore.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import data_key, manifest_key
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.storage.stores import open_object_store
from mtc_replicator.tools import certs, progress_bars
from mtc_replicator.transport.signing import record_trust
from tests.integration.test_backups_cli import COMMITTED, UPLOADING, Backup, mtc
from tests.storage_servers import Bucket
from tests.tls import node_tls

pytestmark = pytest.mark.integration


@pytest.fixture
def backup(tmp_path: Path, job: str) -> Backup:
    return Backup(tmp_path, job)


def _fails(out: subprocess.CompletedProcess[str], *words: str, rc: int = 1) -> None:
    assert out.returncode == rc, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in out.stderr, out.stderr


# --- not found -----------------------------------------------------------------------------


def test_a_missing_location_is_not_found_and_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    for verb in (["list"], ["verify", "--job", "j"], ["prune", "--job", "j", "--keep-last", "1"]):
        _fails(mtc(verb[0], missing.as_uri(), *verb[1:]), "no such directory")
    assert not missing.exists()


def test_an_unknown_job_is_not_found(backup: Backup) -> None:
    _fails(mtc("verify", backup.url, "--job", "nope"), "job nope has no committed backups")
    _fails(mtc("verify", backup.url, "--job", "nope", "--json"), "job nope")
    _fails(mtc("list", backup.url, "--job", "nope"), "no backups of job nope")
    _fails(mtc("prune", backup.url, "--job", "nope", "--keep-last", "1"), "no backups of job nope")
    _fails(mtc("restore", backup.url, "--job", "nope", "--step", "1", "--yes"), "not committed")
    _fails(
        mtc(
            "download",
            backup.url,
            "--job",
            "nope",
            "--step",
            "1",
            "--to",
            str(backup.root.parent / "d"),
        ),
        "not committed",
    )
    _fails(
        mtc("verify", backup.url, "--job", backup.job, "--step", str(UPLOADING)), "not committed"
    )


def test_bad_numbers_are_usage_errors(backup: Backup) -> None:
    out = mtc("verify", backup.url, "--job", backup.job, "--step", "abc")
    _fails(out, "argument --step: must be a whole number >= 0, got 'abc'", rc=2)
    assert "_count" not in out.stderr
    _fails(
        mtc("prune", backup.url, "--job", "j", "--min-age-minutes", "soon"),
        "--min-age-minutes",
        rc=2,
    )


# --- --all-jobs ----------------------------------------------------------------------------


def test_verify_and_prune_take_all_jobs(backup: Backup) -> None:
    _fails(mtc("verify", backup.url), "one of the arguments --job --all-jobs is required", rc=2)
    _fails(mtc("verify", backup.url, "--job", "x", "--all-jobs"), "not allowed with", rc=2)
    out = mtc("verify", backup.url, "--all-jobs", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert body["ok"] is True
    by_job = {j["job"]: j for j in body["jobs"]}
    assert set(by_job) == {backup.job, "other-job"}
    assert sorted(s["step"] for s in by_job[backup.job]["steps"]) == list(COMMITTED)

    backup.flip_byte(200)
    out = mtc("verify", backup.url, "--all-jobs")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"CORRUPT: {backup.job}" in out.stdout

    out = mtc("prune", backup.url, "--all-jobs", "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    plans = {j["job"]: j for j in json.loads(out.stdout)["jobs"]}
    actions = {s["step"]: s["action"] for s in plans[backup.job]["steps"]}
    assert (actions[300], actions[100]) == ("keep", "delete")
    assert {s["step"]: s["action"] for s in plans["other-job"]["steps"]} == {7: "keep"}
    assert backup.step_dir(100).exists()  # a dry run


# --- download ------------------------------------------------------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_download_a_step_verified(backup: Backup, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    out = mtc("download", backup.url, "--job", backup.job, "--step", "200", "--to", str(dest))
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["n0-w0", "n1-w0"]
    for rank in (0, 1):
        src = tmp_path / "src" / f"{backup.job}-200-{rank}"
        assert _tree(dest / f"n{rank}-w0") == _tree(src)
    assert out.stderr == ""  # not a TTY: no bar

    # Not into a non-empty directory, unless --force; one rank alone.
    again = mtc("download", backup.url, "--job", backup.job, "--step", "300", "--to", str(dest))
    _fails(again, "not empty", "--force")
    out = mtc(
        "download", backup.url, "--job", backup.job, "--step", "300", "--rank", "1",
        "--to", str(dest), "--force", "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert [(i["rank"], i["worker"]) for i in body["items"]] == [(1, 0)]
    assert _tree(dest / "n1-w0") == _tree(tmp_path / "src" / f"{backup.job}-300-1")
    _fails(
        mtc(
            "download",
            backup.url,
            "--job",
            backup.job,
            "--step",
            "300",
            "--rank",
            "5",
            "--to",
            str(tmp_path / "x"),
        ),
        "has no rank 5",
    )


def test_a_tampered_byte_fails_and_leaves_nothing(backup: Backup, tmp_path: Path) -> None:
    backup.flip_byte(200)
    dest = tmp_path / "out"
    out = mtc("download", backup.url, "--job", backup.job, "--step", "200", "--to", str(dest))
    _fails(out, "does not match its manifest", "nothing was written")
    assert list(dest.iterdir()) == []  # not even the staging directory


def test_download_errors_are_messages_not_tracebacks(backup: Backup, tmp_path: Path) -> None:
    # A target under a regular file: nothing can be written there.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = mtc(
        "download", backup.url, "--job", backup.job, "--step", "200", "--to", str(blocker / "d")
    )
    _fails(out, "cannot write to")
    assert "Traceback" not in out.stderr
    # A manifest changed after its COMMIT pinned it.
    manifest = backup.root / manifest_key(ItemId(backup.job, 200, 0, 0))
    edited = json.loads(manifest.read_bytes())
    edited["files"][0][2] = f"{int(edited['files'][0][2], 16) ^ 1:08x}"  # another crc32c
    manifest.write_text(json.dumps(edited))
    dest = tmp_path / "out"
    out = mtc("download", backup.url, "--job", backup.job, "--step", "200", "--to", str(dest))
    _fails(out, "nothing was written")
    assert "Traceback" not in out.stderr
    assert not dest.exists() or list(dest.iterdir()) == []


def test_download_checks_the_commit_signature(tmp_path: Path, job: str) -> None:
    """A COMMIT not signed by the nodes' CA is refused, as the daemon's restore refuses it."""
    tls = node_tls(tmp_path / "tls", certs.new_ca())
    backup = Backup(tmp_path, job)  # unsigned COMMITs
    out = mtc(
        "download", backup.url, "--job", job, "--step", "100", "--to", str(tmp_path / "out"),
        "--tls-ca", str(tls.files.ca),
    )  # fmt: skip
    _fails(out, "refused")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_download_from_s3_and_a_tampered_object(
    tmp_path: Path, job: str, s3_bucket: Bucket
) -> None:
    store = BackupStore(open_object_store(s3_bucket.url))
    src = tmp_path / "src"
    (src / "state").mkdir(parents=True)
    (src / "state" / "weights").write_bytes(os.urandom(300 * 1024))
    manifest = build_manifest(ItemId(job, 5, 0, 0), src)
    store.upload_item(manifest, src)
    assert store.try_commit(job, 5, [manifest.item.key]) is not None
    env = {**os.environ, **s3_bucket.env}

    def run(dest: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", "download", s3_bucket.url,
             "--job", job, "--step", "5", "--to", str(dest)],
            capture_output=True, text=True, env=env, check=False, timeout=120,
        )  # fmt: skip

    good = run(tmp_path / "good")
    assert good.returncode == 0, good.stdout + good.stderr
    assert _tree(tmp_path / "good" / "n0-w0") == _tree(src)
    store.objects.put_bytes(data_key(ItemId(job, 5, 0, 0), "state/weights"), b"x" * 300 * 1024)
    bad = run(tmp_path / "bad")
    _fails(bad, "nothing was written")
    assert list((tmp_path / "bad").iterdir()) == []


# --- progress ------------------------------------------------------------------------------


def test_a_bar_on_a_terminal_only(backup: Backup, tmp_path: Path) -> None:
    """On a TTY, a bar with a rate; piped, none; --json, none unless asked for."""
    args = ["verify", backup.url, "--job", backup.job, "--step", "200"]
    piped = mtc(*args)
    assert (piped.returncode, piped.stderr) == (0, "")
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", *args],
            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL,
            timeout=60, check=False,
        )  # fmt: skip
        os.close(follower)
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    text = drawn.decode()
    assert f"verify {backup.job}" in text, text
    assert "100%" in text, text
    assert "B/s" in text, text
    forced = mtc(*args, "--json", "--progress")
    assert "100%" in forced.stderr
    json.loads(forced.stdout)  # the bar never reaches stdout
    assert mtc(*args, "--json").stderr == ""


def test_the_bar_counts_the_bytes(backup: Backup) -> None:
    """The total is the step's bytes, and every one of them is counted."""
    import argparse
    import io

    from mtc_replicator.storage.backup_audit import plan_verify, run_verify

    plan = plan_verify(backup.store.objects, backup.job, 200)
    stream = io.StringIO()
    bar = progress_bars.bar(argparse.Namespace(progress=True), plan.total_bytes, "v", stream)
    assert isinstance(bar, progress_bars.ByteBar)
    run_verify(backup.store.objects, plan, bar)
    assert bar.bar.total == plan.total_bytes == 2 * (64 * 1024 + len(b'{"step": 200}'))
    assert bar.bar.n == plan.total_bytes
    bar.close()
    quiet = progress_bars.bar(argparse.Namespace(progress=None), 10, "v", io.StringIO())
    assert isinstance(quiet, progress_bars.NoBar)


def test_download_and_verify_check_each_items_attestation(tmp_path: Path, job: str) -> None:
    """With ``--tls-ca`` a download believes an item only as a restore does: attested by
    the node that produced it, for the owner its signed COMMIT names."""
    ca = certs.new_ca()
    node = node_tls(tmp_path / "node", ca, node="node-0")
    trust = record_trust(node.material())
    store = BackupStore(FileObjectStore(tmp_path / "backup"), trust)
    for step, attest in ((10, False), (20, True)):
        src = tmp_path / "src" / str(step)
        (src / "state").mkdir(parents=True)
        (src / "state" / "weights").write_bytes(os.urandom(4096))
        manifest = build_manifest(ItemId(job, step, 0, 0), src)
        store.upload_item(node.attest(manifest, "team-a") if attest else manifest, src)
        record = store.try_commit(job, step, [manifest.item.key])
        assert record is not None
        assert record.owner == ("team-a" if attest else None)
    url, ca_flag = (tmp_path / "backup").as_uri(), ("--tls-ca", str(node.files.ca))

    def download(step: int, *extra: str) -> subprocess.CompletedProcess[str]:
        to = tmp_path / f"out-{step}-{len(extra)}"
        return mtc("download", url, "--job", job, "--step", str(step), "--to", str(to), *extra)

    assert download(20, *ca_flag).returncode == 0
    _fails(download(10, *ca_flag), "not signed by its producer")
    assert download(10, *ca_flag, "--accept-unsigned-records").returncode == 0
    # verify says the same of each step
    assert mtc("verify", url, "--job", job, "--step", "20", *ca_flag).returncode == 0
    unattested = mtc("verify", url, "--job", job, "--step", "10", *ca_flag)
    assert unattested.returncode == 1
    assert "not signed by its producer" in unattested.stdout + unattested.stderr
