"""``kill -9`` of a real daemon in the middle of its work: nothing committed is lost, and
nothing half-done is ever restored."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import item_prefix
from mtc_replicator.core.manifest import ItemId
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    backup_commits,
    config_text,
    item_dir,
    make_step,
    payload,
    read_prerestore,
    read_tree,
    sha256_tree,
    store_root,
    stored_steps,
    top_level_step_dirs,
    wait_ingested,
    wait_markers,
    wait_until,
    write_big_step_tmp,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration

BIG_FILES, BIG_MIB = 3, 100
"""A 300 MiB step: hashing it takes long enough to be killed in the middle."""


def _committed_items_verify(ckpt: Path) -> None:
    """Every directory under items/ is a whole item: a manifest, and data matching it."""
    root = store_root(ckpt) / "items"
    for manifest in root.glob("*/*/*/MANIFEST.json"):
        assert (manifest.parent / "data").exists(), manifest
    for item in root.glob("*/*/*"):
        assert (item / "MANIFEST.json").is_file(), f"{item} is in items/ without a manifest"


@pytest.mark.tmpfs_size("1g")
def test_kill_during_ingest_loses_nothing(ckpt: Path, job: str, start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    yaml_text = config_text(job)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)

    # Hashing 300 MiB takes tens of milliseconds; on a rare miss, try again with a new step.
    for step in (9, 10, 11):
        tmp, digests = write_big_step_tmp(ckpt, step, BIG_FILES, BIG_MIB)
        os.rename(tmp, ckpt / str(step))
        wait_until(
            lambda s=step: s not in top_level_step_dirs(ckpt),
            f"step {step} taken",
            daemon=daemon,
            interval=0.001,
        )
        daemon.kill()
        if f"ingested {job}/s{step}/" not in daemon.log():
            break
        daemon = start_daemon()
    else:
        pytest.fail("the kill never landed during an ingest")
    # Taken but not hashed: in the ingest area, not an item.
    assert step not in stored_steps(ckpt, job)
    assert (store_root(ckpt) / "ingest" / job / str(step) / "0-0" / "data").is_dir()
    _committed_items_verify(ckpt)

    # The restarted daemon resumes the incarnation and finishes the ingest.
    daemon = start_daemon()
    data = wait_ingested(ckpt, job, step, daemon)
    assert sha256_tree(data) == digests
    _committed_items_verify(ckpt)

    # A new incarnation restores the complete step, byte for byte.
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, step, daemon)
    assert read_prerestore(ckpt)["restore-step"] == step
    assert sha256_tree(marker.resolve()) == digests


def _upload_in_flight(backup: Path, job: str, step: int) -> bool:
    step_dir = backup / job / str(step)
    objects = [p for p in step_dir.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return bool(objects) and not (step_dir / "COMMIT").exists()


@pytest.mark.tmpfs_size("1g")
def test_kill_during_backup_upload_never_restores_it(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir)
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 1, payload(1, seed=job))
    wait_ingested(ckpt, job, 1, daemon)
    wait_until(lambda: 1 in backup_commits(backup_dir, job), "COMMIT of step 1", daemon=daemon)

    tmp, digests = write_big_step_tmp(ckpt, 2, BIG_FILES, BIG_MIB)
    os.rename(tmp, ckpt / "2")
    wait_until(
        lambda: _upload_in_flight(backup_dir, job, 2),
        "the upload of step 2 under way",
        daemon=daemon,
        interval=0.002,
    )
    daemon.kill()
    assert not (backup_dir / job / "2" / "COMMIT").exists(), "the kill came too late"
    assert 2 in stored_steps(ckpt, job), "step 2 was committed locally before its upload"

    # The node's memory is lost (store set aside): restore must skip the uncommitted step 2.
    os.rename(store_root(ckpt), ckpt.parent / "kept-store")
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 1, "restore-source": "backup"}
    assert read_tree(marker) == payload(1, seed=job)
    assert 2 not in backup_commits(backup_dir, job)
    assert daemon.stop() == 0

    # With the memory back, the resumed incarnation completes the interrupted backup.
    shutil.rmtree(store_root(ckpt))
    os.rename(ckpt.parent / "kept-store", store_root(ckpt))
    daemon = start_daemon(backup=backup_dir)
    wait_until(lambda: 2 in backup_commits(backup_dir, job), "COMMIT of step 2", daemon=daemon)
    uploaded = sha256_tree(backup_dir / item_prefix(ItemId(job, 2, 0, 0)))
    # The killed upload's temp file may stay behind (file:// only); listings skip it.
    assert {k: v for k, v in uploaded.items() if ".mtc-tmp-" not in k} == digests
    assert daemon.stop() == 0

    # And that completed backup restores byte for byte into an empty store.
    shutil.rmtree(store_root(ckpt))
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 2, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 2, "restore-source": "backup"}
    assert sha256_tree(marker.resolve()) == digests
    assert sha256_tree(item_dir(ckpt, job, 2) / "data") == digests
