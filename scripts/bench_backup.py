"""Measure backups through our backends against each SDK's own transfer calls, in one run.

Starts moto's S3 server and the GCS emulator (separate processes on loopback, as the tests
do), writes one item of ``--size-mib`` in 8 files on tmpfs, then per store and round
(interleaved, so both sides meet the same server state):

- ours: ``BackupStore.upload_item`` (parallel parts, our crc32c and the store's checksum
  checked) and ``BackupStore.fetch_item`` (every byte verified against the COMMIT);
- SDK: boto3's ``upload_file``/``download_file`` (its managed multipart transfer) or
  google-cloud-storage's ``upload_from_filename``/``download_to_filename``, file by file,
  with no verification of ours.

Then, with ``--cluster``, four real daemons back a step up to S3 and the time from the
job's restart (every RAM disk wiped) to the last rank's marker is the restore-from-backup
time of a 4-node job.

    .venv/bin/python scripts/bench_backup.py --size-mib 1024 [--rounds 3] [--cluster]

Numbers are only comparable within one run; the local servers, not a network, bound them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replicator.core.manifest import ItemId, Manifest  # noqa: E402
from replicator.local.hashing import build_manifest  # noqa: E402
from replicator.node.daemon import tune_malloc  # noqa: E402
from replicator.storage.backup import BackupStore  # noqa: E402
from replicator.storage.stores import open_object_store  # noqa: E402
from tests import storage_servers as servers  # noqa: E402

JOB = "bench"
FILES = 8
SHM = Path("/dev/shm")  # noqa: S108 (tmpfs, where a RAM-disk item lives)


def write_item(root: Path, size_mib: int) -> tuple[Manifest, Path]:
    data = root / "item"
    data.mkdir()
    each = (size_mib << 20) // FILES
    block = os.urandom(1 << 20)
    for i in range(FILES):
        with open(data / f"shard_{i}.bin", "wb") as f:
            for _ in range(each >> 20):
                f.write(block)
    return build_manifest(ItemId(JOB, 1, 0, 0), data), data


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Ours:
    def __init__(self, url: str, manifest: Manifest, data: Path, scratch: Path) -> None:
        self.backups = BackupStore(open_object_store(url))
        self.manifest, self.data, self.scratch = manifest, data, scratch

    def upload(self, step: int) -> None:
        m = self.manifest
        item = ItemId(JOB, step, 0, 0)
        manifest = Manifest(item, m.kind, m.files)
        self.backups.upload_item(manifest, self.data)
        record = self.backups.try_commit(JOB, step, [item.key])
        assert record is not None

    def download(self, step: int) -> None:
        record = self.backups.read_commit(JOB, step)
        assert record is not None
        staged = self.scratch / f"ours-{step}"
        staged.mkdir()
        self.backups.fetch_item(record, ItemId(JOB, step, 0, 0), staged)
        shutil.rmtree(staged)


class S3Sdk:
    up, down = "boto3 upload_file", "boto3 download_file"

    def __init__(self, bucket: str, data: Path, scratch: Path) -> None:
        import boto3

        self.client = boto3.client("s3")
        self.bucket, self.data, self.scratch = bucket, data, scratch

    def upload(self, step: int) -> None:
        for f in sorted(self.data.iterdir()):
            self.client.upload_file(str(f), self.bucket, f"sdk/{step}/{f.name}")

    def download(self, step: int) -> None:
        out = self.scratch / f"sdk-{step}"
        out.mkdir()
        for f in sorted(self.data.iterdir()):
            self.client.download_file(self.bucket, f"sdk/{step}/{f.name}", str(out / f.name))
        shutil.rmtree(out)


class GcsSdk:
    up, down = "upload_from_filename", "download_to_filename"

    def __init__(self, bucket: str, data: Path, scratch: Path) -> None:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(project="test", credentials=AnonymousCredentials())
        self.bucket = client.bucket(bucket)
        self.data, self.scratch = data, scratch

    def upload(self, step: int) -> None:
        for f in sorted(self.data.iterdir()):
            self.bucket.blob(f"sdk/{step}/{f.name}").upload_from_filename(str(f))

    def download(self, step: int) -> None:
        out = self.scratch / f"sdk-{step}"
        out.mkdir()
        for f in sorted(self.data.iterdir()):
            self.bucket.blob(f"sdk/{step}/{f.name}").download_to_filename(str(out / f.name))
        shutil.rmtree(out)


def bench_store(
    name: str, ours: Ours, sdk: S3Sdk | GcsSdk, rounds: int, size: int
) -> list[tuple[str, float, float]]:
    times: dict[str, list[float]] = {k: [] for k in ("ours_up", "sdk_up", "ours_down", "sdk_down")}
    for r in range(1, rounds + 1):
        times["sdk_up"].append(timed(lambda r=r: sdk.upload(r)))
        times["ours_up"].append(timed(lambda r=r: ours.upload(r)))
        times["sdk_down"].append(timed(lambda r=r: sdk.download(r)))
        times["ours_down"].append(timed(lambda r=r: ours.download(r)))
        print(
            f"{name} round {r}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    return [
        (f"{name} upload, {sdk.up} (baseline)", med["sdk_up"], 1.0),
        (f"{name} upload, ours (parts, checksums)", med["ours_up"], med["sdk_up"] / med["ours_up"]),
        (f"{name} download, {sdk.down} (baseline)", med["sdk_down"], 1.0),
        (
            f"{name} download, ours (verified)",
            med["ours_down"],
            med["sdk_down"] / med["ours_down"],
        ),
    ]


def bench_cluster(moto: servers.ServerProcess, scratch: Path, size_mib: int) -> float:
    """Seconds from a 4-node job's restart (all RAM disks wiped) to every rank's marker."""
    from tests.integration.cluster import NODES, Cluster

    name = servers.unique_bucket_name()
    servers.create_s3_bucket(moto.url, name)
    (scratch / "cluster").mkdir()
    cluster = Cluster(scratch / "cluster", f"bench-{uuid.uuid4().hex[:6]}")
    cluster.backup_url = f"s3://{name}/backups"
    cluster.env = servers.s3_env(moto.url)
    cluster.keys["backup_interval_steps"] = 1
    try:
        for r in range(NODES):
            cluster.start(r)
        cluster.fresh_start()
        each = (size_mib << 20) // NODES
        cluster.write_step(5, sizes=dict.fromkeys(range(NODES), each))
        cluster.wait_saved(5)
        cluster.wait_backup(5)
        cluster.wipe_all()
        t0 = time.perf_counter()
        cluster.handshake([0, 1, 2, 3])
        cluster.wait_markers(5)
        elapsed = time.perf_counter() - t0
        assert all(cluster.source(r) == "backup" for r in range(NODES))
        return elapsed
    finally:
        cluster.stop_all()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cluster", action="store_true", help="also time a 4-node restore")
    a = p.parse_args()
    tune_malloc()
    shm = SHM if SHM.is_dir() else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp, tempfile.TemporaryDirectory() as logs:
        scratch = Path(tmp)
        manifest, data = write_item(scratch, a.size_mib)
        moto = servers.start_moto(Path(logs))
        gcs = servers.start_gcs_emulator(Path(logs))
        rows: list[tuple[str, float, float]] = []
        try:
            s3_bucket = servers.unique_bucket_name()
            servers.create_s3_bucket(moto.url, s3_bucket)
            os.environ.update(servers.s3_env(moto.url))
            rows += bench_store(
                "S3",
                Ours(f"s3://{s3_bucket}/ours", manifest, data, scratch),
                S3Sdk(s3_bucket, data, scratch),
                a.rounds,
                a.size_mib,
            )
            gcs_bucket = servers.unique_bucket_name()
            servers.create_gcs_bucket(gcs.url, gcs_bucket)
            os.environ.update(servers.gcs_env(gcs.url))
            rows += bench_store(
                "GCS",
                Ours(f"gs://{gcs_bucket}/ours", manifest, data, scratch),
                GcsSdk(gcs_bucket, data, scratch),
                a.rounds,
                a.size_mib,
            )
            cluster_s = bench_cluster(moto, scratch, a.size_mib) if a.cluster else None
        finally:
            moto.stop()
            gcs.stop()
    size = a.size_mib << 20
    print(f"\nitem: {a.size_mib} MiB in {FILES} files on tmpfs; median of {a.rounds} rounds")
    print(f"{'transfer':<52} {'seconds':>8} {'MB/s':>7} {'vs SDK':>7}")
    for label, seconds, ratio in rows:
        print(f"{label:<52} {seconds:8.2f} {size / seconds / 1e6:7.0f} {ratio:6.2f}x")
    if a.cluster:
        print(
            f"4-node job, every RAM disk wiped, {a.size_mib} MiB in all on S3: "
            f"restart to every marker in {cluster_s:.2f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
