"""Measure the single-node tiers on this machine, with baselines from the same run.

Ingest (take + hash into the store), local-restore verification, backup upload and
restore from a ``file://`` backup of one item, against ``cp -r`` of the same bytes between
the same filesystems. Prints a table; numbers are only comparable within one run.

Then the cost of content digests (BLAKE3, ``local.digests``), with and without them in the
same run, rounds interleaved, wall and CPU time: ingest's manifest, the local verify, a
backup download, and a peer's receive (``transfer.ItemWriter`` fed over a socket the way
the data channel feeds it, and from ``iter_chunks`` the way gRPC chunks arrive). "Without"
is the same code on the same item's format-1 manifest (crc32c only), which is what every
path did before digests. ``--no-digests`` measures only that baseline.

    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/bench_local.py --size-mib 1024 --rounds 5
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/bench_local.py --digests-only --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mtc_replicator.core.manifest import LEGACY_VERSION, ItemId, Manifest
from mtc_replicator.local import hashing
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.transport import datachannel
from mtc_replicator.transport.transfer import ItemWriter, iter_chunks


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


def timed_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of every thread of this process) of one call. CPU time is
    what hashing costs whatever else the machine runs; wall time is what a restore waits."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def legacy(m: Manifest) -> Manifest:
    """``m`` as written before digests: format 1, crc32c only."""
    files = tuple(dataclasses.replace(f, blake3=None) for f in m.files)
    return dataclasses.replace(m, files=files, version=LEGACY_VERSION)


def crc_only_manifest(item: ItemId, data: Path) -> None:
    """Ingest's hashing before digests: every file's size and crc32c, in one read."""
    _, files = hashing.walk_tree(data)
    for rel in files:
        hashing.file_crc32c(data / rel, root=data, rel=rel)


def fresh(ram: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=ram))


def receive_socket(m: Manifest, data: Path, ram: Path) -> None:
    """The data channel's receive: ``sendfile`` in one thread, ``receive_into`` here."""
    staged = fresh(ram)
    a, b = socket.socketpair()

    def send() -> None:
        with a:
            for entry in m.files:
                with open(data / entry.path, "rb") as f:
                    a.sendfile(f)

    sender = threading.Thread(target=send)
    sender.start()
    writer = ItemWriter(m, staged)  # as datachannel.receive_staged does
    try:
        datachannel.receive_into(writer, b, idle_timeout=30)
        writer.finish()
    finally:
        writer.close()
        b.close()
        sender.join()
        shutil.rmtree(staged)


def receive_chunks(m: Manifest, data: Path, ram: Path) -> None:
    """gRPC's receive of checked 1 MiB chunks (``ItemWriter.write``), socket left out."""
    staged = fresh(ram)
    writer = ItemWriter(m, staged, hash_aside=True)  # as transfer.receive_item does
    try:
        for index, offset, chunk, crc in iter_chunks(m, data):
            writer.write(index, offset, chunk, crc)
        writer.finish()
    finally:
        writer.close()
        shutil.rmtree(staged)


def fetch(backups: BackupStore, m: Manifest, ram: Path) -> None:
    staged = fresh(ram)
    try:
        backups.fetch_pinned(m.item, m.digest, staged)
    finally:
        shutil.rmtree(staged)


def median_of(rounds: int, fn: Callable[[], object]) -> float:
    return statistics.median(timed(fn) for _ in range(rounds))


def digest_costs(size_mib: int, files: int, rounds: int, only_baseline: bool) -> None:
    """With and without digests, rounds interleaved: per operation the median and the
    least wall time (the least is the run least disturbed by the rest of the machine) and
    the median CPU time, and their ratios."""
    ram = Path(tempfile.mkdtemp(dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp())
    load = os.getloadavg()[0]
    try:
        data = ram / "item"
        make_step(data, size_mib << 20, files)
        item = ItemId("bench", 1, 0, 0)
        with_digests = hashing.build_manifest(item, data)
        variants = {"crc32c only": legacy(with_digests)}
        if not only_baseline:
            variants["with digests"] = with_digests
        buckets = {}
        for name, m in variants.items():
            buckets[name] = FileObjectStore(disk / name.replace(" ", "-"))
            BackupStore(buckets[name]).upload_item(m, data)
        cases: dict[str, Callable[[str, Manifest], object]] = {
            "ingest: walk + hash every file": lambda _, m: (
                hashing.build_manifest(item, data)
                if m.version != LEGACY_VERSION
                else crc_only_manifest(item, data)
            ),
            "restore from local: verify": lambda _, m: hashing.verify_item(m, data),
            "restore from peer: data channel": lambda _, m: receive_socket(m, data, ram),
            "restore from peer: gRPC chunks": lambda _, m: receive_chunks(m, data, ram),
            "restore from file:// backup": lambda name, m: fetch(
                BackupStore(buckets[name]), m, ram
            ),
        }
        times: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(rounds):
            for case, fn in cases.items():
                for name, m in variants.items():
                    t = timed_cpu(lambda fn=fn, name=name, m=m: fn(name, m))
                    times.setdefault((case, name), []).append(t)
        load = max(load, os.getloadavg()[0])
        gib = (size_mib << 20) / (1 << 30)
        print(
            f"\ncontent digests: {size_mib} MiB in {files} files, {rounds} rounds, "
            f"{os.cpu_count()} cores, load average up to {load:.1f}"
        )
        print("wall: median (least) seconds; cpu: median CPU seconds of all threads")
        head = f"{'operation':34} {'crc32c only':>20}"
        if not only_baseline:
            head += f" {'with digests':>20} {'wall':>6} {'least':>6} {'cpu':>6}"
        print(head)
        for case in cases:
            line = f"{case:34}"
            stats = {}
            for name in variants:
                walls = [w for w, _ in times[(case, name)]]
                cpus = [c for _, c in times[(case, name)]]
                stats[name] = (statistics.median(walls), min(walls), statistics.median(cpus))
                w, least, c = stats[name]
                line += f" {w:6.3f} ({least:5.3f}) {c:5.3f}"
            if not only_baseline:
                (bw, bl, bc), (dw, dl, dc) = stats["crc32c only"], stats["with digests"]
                line += f"  {dw / bw:5.2f}x {dl / bl:5.2f}x {dc / bc:5.2f}x"
                line += f"  ({gib / dw:.2f} GiB/s)"
            print(line)
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the digest comparison")
    p.add_argument(
        "--no-digests", action="store_true", help="measure the crc32c-only baseline alone"
    )
    p.add_argument("--digests-only", action="store_true", help="skip the cp -r table")
    a = p.parse_args()
    if a.digests_only:
        digest_costs(a.size_mib, a.files, a.rounds, a.no_digests)
        return
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
    digest_costs(a.size_mib, a.files, a.rounds, a.no_digests)


if __name__ == "__main__":
    main()
