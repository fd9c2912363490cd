"""A full RAM disk: a clear error, nothing committed lost, and no silent fresh start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from tests.integration.helpers import (
    config_text,
    make_step,
    marker_names,
    payload,
    read_text,
    store_root,
    stored_steps,
    wait_until,
    write_yaml_atomic,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root to mount a small tmpfs that can really fill up"
    ),
]


def _commit_backup(backup: Path, job: str, step: int, data: Path) -> None:
    store = BackupStore(FileObjectStore(backup))
    item = ItemId(job, step, 0, 0)
    store.upload_item(build_manifest(item, data), data)
    assert store.try_commit(job, step, [item.key]) is not None


def _fill(path: Path) -> None:
    """Write zeros until the filesystem refuses another byte (unbuffered, shrinking blocks)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        block = 1 << 20
        while block:
            try:
                os.write(fd, b"\0" * block)
            except OSError:
                block //= 2
    finally:
        os.close(fd)


@pytest.mark.tmpfs_size("8m")
def test_backup_larger_than_the_ram_disk_fails_loudly(
    ckpt: Path, backup_dir: Path, job: str, tmp_path: Path, start_daemon
) -> None:
    big = tmp_path / "big-step"
    big.mkdir()
    (big / "state.bin").write_bytes(os.urandom(12 << 20))
    _commit_backup(backup_dir, job, 40, big)

    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    failed = ckpt / "replicator.failed"
    wait_until(failed.exists, "replicator.failed", daemon=daemon)
    text = read_text(failed)
    # The job must stop with the reason, not start from scratch past a good checkpoint.
    assert "could not be restored" in text
    assert "No space left" in text
    assert marker_names(ckpt) == []
    assert not (ckpt / "replicator.yaml").exists()
    # The half-downloaded copy is gone again, and the backup is untouched and restorable.
    assert list((store_root(ckpt) / "staging").iterdir()) == []
    staged = tmp_path / "fetched"
    staged.mkdir()
    store = BackupStore(FileObjectStore(backup_dir))
    record = store.read_commit(job, 40)
    assert record is not None
    store.fetch_item(record, ItemId(job, 40, 0, 0), staged)
    assert (staged / "data" / "state.bin").read_bytes() == (big / "state.bin").read_bytes()


@pytest.mark.tmpfs_size("8m")
def test_ingest_on_a_full_ram_disk_retries_once_space_is_free(
    ckpt: Path, job: str, start_daemon
) -> None:
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_until(lambda: marker_names(ckpt), "the fresh-start marker", daemon=daemon)

    # The workload's step is complete before the disk fills; its rename needs no space.
    files = payload(7, size=512 * 1024)
    tmp_step = ckpt / "7.orbax-checkpoint-tmp-x"
    tmp_step.mkdir()
    for name, data in files.items():
        (tmp_step / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_step / name).write_bytes(data)
    filler = ckpt / "filler.bin"
    _fill(filler)
    os.rename(tmp_step, ckpt / "7")

    ingest = store_root(ckpt) / "ingest" / job / "7"
    wait_until(ingest.exists, "the step taken into the store", daemon=daemon)
    wait_until(lambda: "ingest failed, will retry" in daemon.log(), "the ENOSPC", daemon=daemon)
    assert 7 not in stored_steps(ckpt, job)

    filler.unlink()
    wait_until(lambda: 7 in stored_steps(ckpt, job), "step 7 committed", daemon=daemon)
    data_dir = store_root(ckpt) / "items" / job / "7" / "0-0" / "data"
    for name, data in files.items():
        assert (data_dir / name).read_bytes() == data
    # make_step is the normal path; it still works once the disk has room again.
    make_step(ckpt, 8, payload(8))
    wait_until(lambda: 8 in stored_steps(ckpt, job), "step 8 committed", daemon=daemon)
