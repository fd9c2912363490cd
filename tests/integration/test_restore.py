"""Restore rounds against a real daemon: from the local store, from a committed backup,
and past a corrupt copy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import (
    LAYOUT_V1,
    CommitRecord,
    commit_key,
    data_key,
    manifest_key,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.objectstore import FileObjectStore
from tests.daemon_process import DaemonProcess
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    ERRORS,
    backup_commits,
    config_text,
    holds,
    item_dir,
    make_step,
    marker_names,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    store_root,
    stored_steps,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration


def _assert_relative_link_into(ckpt: Path, link: Path) -> Path:
    """A marker is a relative symlink that resolves inside CHECKPOINT_DIR; its target."""
    assert link.is_symlink(), f"{link.name} must be a symlink"
    target = os.readlink(link)
    assert not os.path.isabs(target), f"marker target must be relative, got {target!r}"
    resolved = (link.parent / target).resolve()
    assert resolved.is_relative_to(ckpt.resolve()), f"{target!r} escapes CHECKPOINT_DIR"
    return resolved


def test_restart_restores_from_local_store(ckpt: Path, job: str, start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    yaml_text = config_text(job, workers_per_node=2)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon, workers=2)
    saved = payload(3, seed=job)
    make_step(ckpt, 3, saved)
    wait_ingested(ckpt, job, 3, daemon)
    assert daemon.stop() == 0

    # The node restarts: the job writes its handshake before the daemon is back, and the
    # daemon must restore step 3 from memory.
    write_yaml_atomic(ckpt, yaml_text)
    daemon = start_daemon()
    markers = wait_markers(ckpt, job, 3, daemon, workers=2)
    assert read_prerestore(ckpt)["restore-step"] == 3
    assert read_prerestore(ckpt).get("restore-source", "local") == "local"
    for m in markers:
        resolved = _assert_relative_link_into(ckpt, m)
        assert resolved.is_dir()
        assert read_tree(m) == saved, f"{m.name} does not show the saved bytes"
    assert not (ckpt / ERRORS).exists()

    # Orbax renames one marker to `<N>` and deletes the others; the PyTorch reference
    # renames one to `step=<N>`. Both names must still reach the data.
    w0, w1 = markers
    os.replace(w0, ckpt / "3")
    os.rename(w1, ckpt / "step=3")
    assert marker_names(ckpt) == []
    for name in ("3", "step=3"):
        _assert_relative_link_into(ckpt, ckpt / name)
        assert read_tree(ckpt / name) == saved
    # The daemon must not take the `<N>` link for a new step, nor drop what it points at.
    holds(
        lambda: (ckpt / "3").is_symlink() and (ckpt / "3" / "_CHECKPOINT_METADATA").exists(),
        "the renamed marker keeps resolving",
        1.0,
        daemon=daemon,
    )
    assert stored_steps(ckpt, job) == {3}

    # The next save proceeds normally next to the client's links.
    make_step(ckpt, 4, payload(4, seed=job))
    wait_ingested(ckpt, job, 4, daemon)
    assert read_tree(item_dir(ckpt, job, 4) / "data") == payload(4, seed=job)


def _save_backed_up_steps(
    ckpt: Path, backup_dir: Path, job: str, daemon: DaemonProcess, steps: tuple[int, ...]
) -> str:
    """A fresh job backing up every step saves ``steps``, each committed to the backup;
    returns its ``replicator.yaml`` text, for the restarts that follow."""
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    for step in steps:
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
        wait_until(
            lambda s=step: s in backup_commits(backup_dir, job),
            f"COMMIT of step {step}",
            daemon=daemon,
        )
    return yaml_text


def test_wiped_store_restores_newest_committed_backup(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir)
    yaml_text = _save_backed_up_steps(ckpt, backup_dir, job, daemon, (1, 2))
    assert daemon.stop() == 0

    # Step 2's upload "never finished": its files and manifest are there, its COMMIT is not.
    (backup_dir / job / "2" / "COMMIT").unlink()
    assert (backup_dir / manifest_key(ItemId(job, 2, 0, 0))).is_file()
    # And a step 5 that a crashed uploader left by hand: files, manifest, no COMMIT.
    shutil.copytree(backup_dir / job / "2", backup_dir / job / "5")
    shutil.rmtree(store_root(ckpt))

    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 1, "restore-source": "backup"}
    _assert_relative_link_into(ckpt, marker)
    assert read_tree(marker) == payload(1, seed=job)
    assert read_tree(item_dir(ckpt, job, 1) / "data") == payload(1, seed=job)
    assert backup_commits(backup_dir, job) == {1}, "the daemon must not commit others' steps"


def test_a_restore_pin_rolls_one_node_back_to_an_older_backup(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir)
    yaml_text = _save_backed_up_steps(ckpt, backup_dir, job, daemon, (1, 2))
    mtc = [
        sys.executable,
        "-m",
        "mtc_replicator.tools.cli",
        "backups",
        "restore",
        backup_dir.as_uri(),
    ]
    done = subprocess.run(
        [*mtc, "--job", job, "--step", "1", "--yes"], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr

    write_yaml_atomic(ckpt, yaml_text)  # the job restarts
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_tree(marker) == payload(1, seed=job)
    # Step 2 would pass for the newest checkpoint at the next restart: rolled back with it.
    assert stored_steps(ckpt, job) == {1}
    # The used pin goes after the round (its used record is written first, then it is
    # deleted, in the background): soon after the markers, not before them.
    pin = backup_dir / "_control" / job / "restore-pin.json"
    wait_until(lambda: not pin.exists(), "the used pin removed", daemon=daemon)


# --- corruption ------------------------------------------------------------------------------


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("case", ["stopped-backup-copy", "running-older-step", "no-fallback"])
def test_corrupt_local_copy_is_never_exposed(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon, case: str
) -> None:
    """A flipped byte in the store is caught on restore; the daemon falls back and says so.

    stopped-backup-copy: the newest step is corrupt locally, its backup copy is used.
    running-older-step: the newest step is only local and corrupt; the older step is used.
    no-fallback: nothing else exists, so nothing is restored (an s0 marker).
    """
    backup = None if case == "no-fallback" else backup_dir
    # Every step is backed up in the first case; only the first step in the second.
    interval = {"stopped-backup-copy": 1, "running-older-step": 100, "no-fallback": 1}[case]
    daemon = start_daemon(backup=backup)
    yaml_text = config_text(job, backup_interval_steps=interval)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    want = {"stopped-backup-copy": {1, 2}, "running-older-step": {1}, "no-fallback": set()}[case]
    for step in (1, 2):
        make_step(ckpt, step, payload(step, seed=job, size=8192))
        wait_ingested(ckpt, job, step, daemon)
        if step in want:
            wait_until(
                lambda s=step: s in backup_commits(backup_dir, job),
                f"COMMIT of step {step}",
                daemon=daemon,
            )
    assert backup_commits(backup_dir, job) == want
    wait_until(lambda: stored_steps(ckpt, job) == {2}, "only step 2 kept locally", daemon=daemon)

    victim = item_dir(ckpt, job, 2) / "data" / "state" / "array_0.bin"
    if case == "running-older-step":
        _flip_a_byte(victim)  # under a running daemon; the next handshake must catch it
    else:
        assert daemon.stop() == 0
        _flip_a_byte(victim)
        daemon = start_daemon(backup=backup)
    write_yaml_atomic(ckpt, yaml_text)

    expected_step = {"stopped-backup-copy": 2, "running-older-step": 1, "no-fallback": 0}[case]
    (marker,) = wait_markers(ckpt, job, expected_step, daemon)
    errors = read_text(ckpt / ERRORS)
    assert "corrupt" in errors, f"{ERRORS} must say the copy was corrupt: {errors!r}"
    assert "step 2" in errors, errors
    if expected_step == 0:
        assert read_prerestore(ckpt) == {}
        assert not marker.is_symlink()
        assert marker.stat().st_size == 0
        return
    assert read_prerestore(ckpt) == {"restore-step": expected_step, "restore-source": "backup"}
    assert read_tree(marker) == payload(expected_step, seed=job, size=8192)
    if case == "stopped-backup-copy":
        # The corrupt copy was replaced by the verified one from the backup.
        assert read_tree(item_dir(ckpt, job, 2) / "data") == payload(2, seed=job, size=8192)


def test_a_backup_of_layout_v1_made_by_hand_still_restores(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A step as versions before layout v2 wrote it (no ``<hh>/`` in its keys, no
    ``layout`` in its COMMIT): a node that lost its RAM disk restores it from the backup."""
    src = make_step(tmp_path, 7, payload(7, seed=job))
    item = ItemId(job, 7, 0, 0)
    manifest = build_manifest(item, src)
    objects = FileObjectStore(backup_dir)
    for entry in manifest.files:
        objects.put_file(data_key(item, entry.path, LAYOUT_V1), src / entry.path)
    objects.put_bytes(manifest_key(item, LAYOUT_V1), manifest.to_json())
    record = CommitRecord(job, 7, {item.key: manifest.digest}, 1.0, LAYOUT_V1)
    objects.put_bytes(commit_key(job, 7), record.to_json())
    assert (backup_dir / job / "7" / "0-0.manifest.json").is_file()

    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1000))
    (marker,) = wait_markers(ckpt, job, 7, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 7, "restore-source": "backup"}
    assert read_tree(marker) == payload(7, seed=job)


def test_a_step_restored_after_a_job_restart_is_backed_up_without_a_new_save(
    ckpt: Path, tmp_path: Path, job: str, start_daemon: StartDaemon
) -> None:
    # A backup every step, uploads slow (paced): step 20's upload is under way when the
    # trainer saves step 30 and restarts at once. The restored step 30 must go up next,
    # not step 20 for an uploader that is gone, nor nothing until the job saves again.
    backup = tmp_path / "backup"
    daemon = start_daemon(backup=backup, extra=("--max-transfer-rate", "2MiB"))
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 10, payload(10, seed=job, size=64 << 10))
    wait_ingested(ckpt, job, 10, daemon)
    wait_until(lambda: 10 in backup_commits(backup, job), "COMMIT of step 10", daemon=daemon)
    for step in (20, 30):
        make_step(ckpt, step, payload(step, seed=job, size=8 << 20))
        wait_ingested(ckpt, job, step, daemon)
    restarted = daemon.log_path.read_text().count("\n")
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 30, daemon)
    wait_until(lambda: 30 in backup_commits(backup, job), "COMMIT of step 30", daemon=daemon)
    after = daemon.log_path.read_text().splitlines()[restarted:]
    ordered = [line for line in after if "backup of step" in line and "ordered" in line]
    assert ordered, after
    assert all("backup of step 30 " in line for line in ordered), ordered


def test_a_failing_backup_is_retried_with_growing_waits(
    ckpt: Path, tmp_path: Path, job: str, start_daemon: StartDaemon
) -> None:
    # Step 10's prefix in the bucket is a file: every upload of it fails. The coordinator
    # repeats its order at every report (each second here); the uploads back off instead
    # of failing, and writing to replicator.errors, once a second for as long as it lasts.
    backup = tmp_path / "backup"
    (backup / job).mkdir(parents=True)
    (backup / job / "10").write_bytes(b"not a directory")
    daemon = start_daemon(backup=backup)
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 10, payload(10, seed=job))
    wait_ingested(ckpt, job, 10, daemon)

    def failures() -> list[str]:
        text = read_text(ckpt / ERRORS) if (ckpt / ERRORS).exists() else ""
        return [line for line in text.splitlines() if "backup of step 10" in line]

    wait_until(failures, "the first failed upload", daemon=daemon)
    time.sleep(12)
    tries = failures()
    # Waits of 1-2, 2-4, 4-8 s: at most 4 tries in the 12 s after the first (13 before).
    assert 2 <= len(tries) <= 5, tries
    assert "will retry in" in tries[-1]
