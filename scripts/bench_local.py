"""Measure the single-node tiers on this machine, with baselines from the same run.

Ingest (take + hash into the store), local-restore verification, backup upload and
restore from a ``file://`` backup of one item, against ``cp -r`` of the same bytes between
the same filesystems. Prints a table; numbers are only comparable within one run.

    .venv/bin/python scripts/bench_local.py --size-mib 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore


def make_step(path: Path, size: int, files: int) -> None:
    path.mkdir(parents=True)
    chunk = os.urandom(4 << 20)
    per_file = size // files
    for i in range(files):
        with open(path / f"shard-{i}.bin", "wb") as f:
            left = per_file
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    a = p.parse_args()
    size = a.size_mib << 20
    ram = Path(tempfile.mkdtemp(dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp())
    try:
        ckpt = ram / "ckpt"
        ckpt.mkdir()
        make_step(ram / "src", size, a.files)
        base_ram = timed(
            lambda: subprocess.run(["cp", "-r", ram / "src", ram / "copy"], check=True)
        )
        base_disk = timed(
            lambda: subprocess.run(["cp", "-r", ram / "src", disk / "copy"], check=True)
        )
        shutil.rmtree(ram / "copy")
        shutil.rmtree(disk / "copy")
        store = LocalStore(ckpt)
        store.open()
        item = ItemId("bench", 1, 0, 0)
        os.rename(ram / "src", ckpt / "1")
        t_ingest = timed(lambda: (store.take(ckpt / "1", item), store.commit_ingested(item)))
        t_verify = timed(lambda: store.verify(item))
        backups = BackupStore(FileObjectStore(disk / "backup"))
        manifest = store.get(item)
        assert manifest is not None
        t_upload = timed(lambda: backups.upload_item(manifest, store.data_path(item)))
        record = backups.try_commit("bench", 1, [item.key])
        assert record is not None
        staged = store.new_staging()
        t_fetch = timed(lambda: backups.fetch_item(record, item, staged))
        gib = size / (1 << 30)
        rows = [
            ("cp -r tmpfs -> tmpfs (baseline)", base_ram, None),
            ("ingest: rename + crc32c manifest", t_ingest, base_ram),
            ("restore from local: verify every byte", t_verify, base_ram),
            ("cp -r tmpfs -> disk (baseline)", base_disk, None),
            ("backup upload to file:// (fsync)", t_upload, base_disk),
            ("restore from file:// backup, verified", t_fetch, base_disk),
        ]
        print(f"item: {a.size_mib} MiB in {a.files} files")
        print(f"{'operation':42} {'seconds':>8} {'GiB/s':>7} {'vs baseline':>12}")
        for name, secs, base in rows:
            ratio = f"{base / secs:.2f}x" if base else "-"
            print(f"{name:42} {secs:8.3f} {gib / secs:7.2f} {ratio:>12}")
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
