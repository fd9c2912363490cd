"""Measure bucket egress of a backup restore with 4 data-parallel replicas, in one run.

Starts moto's S3 server behind the tests' recording proxy, four real daemons (one rank per
replica, ``assume-data-parallelism: 4``, mutual TLS), saves one step of ``--size-mib`` on
every replica and waits for its backup (replica 0 uploads it), then wipes every RAM disk
and restarts the job. Counted through the proxy, in the same run and against the same
objects:

- before: what each rank's first choice made it download before fan-out (the replica-0
  object, once per rank), replayed with ``BackupStore.fetch_item``, the daemons' own call;
- after: the daemons' restore with fan-out (one rank downloads, three pull it from it).

    .venv/bin/python scripts/bench_fanout.py --size-mib 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.core.manifest import ItemId  # noqa: E402
from mtc_replicator.storage.backup import BackupStore  # noqa: E402
from mtc_replicator.storage.stores import open_object_store  # noqa: E402
from tests import storage_servers as servers  # noqa: E402
from tests.integration.cluster import NODES, Cluster, assert_restored  # noqa: E402
from tests.integration.helpers import make_step, payload  # noqa: E402

STEP = 5


def egress(proxy: servers.FaultProxy) -> tuple[int, int]:
    """(GETs, body bytes) the proxy answered since the last clear, listings included."""
    gets = proxy.requests("GET")
    return len(gets), sum(r.reply_bytes for r in gets)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mib", type=int, default=256, help="size of one rank's checkpoint")
    a = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="mtc-bench-fanout-", dir="/dev/shm"))
    moto = servers.start_moto(scratch)
    try:
        name = servers.unique_bucket_name()
        servers.create_s3_bucket(moto.url, name)
        with servers.fault_proxy(moto.url) as proxy:
            env = servers.s3_env(proxy.url)
            os.environ.update(env)  # the "before" fetches in this process use it too
            (scratch / "cluster").mkdir()
            cluster = Cluster(scratch / "cluster", f"bench-{uuid.uuid4().hex[:6]}")
            cluster.backup_url = f"s3://{name}/backups"
            cluster.env = env
            cluster.keys = {"assume_data_parallelism": NODES, "backup_interval_steps": 1}
            try:
                for r in range(NODES):
                    cluster.start(r)
                cluster.fresh_start()
                files = payload(STEP, seed="model", size=a.size_mib << 20)
                for r in range(NODES):
                    make_step(cluster.dirs[r], STEP, files)
                cluster.wait_saved(STEP, copies=False)
                cluster.wait_backup(STEP)
                cluster.stop_all()

                # Before: every replica's rank downloads the replica-0 object itself.
                backups = BackupStore(open_object_store(cluster.backup_url))
                with proxy.lock:
                    proxy.seen.clear()
                record = backups.committed_steps(cluster.job)[STEP]
                for r in range(NODES):
                    staged = scratch / f"before{r}"
                    staged.mkdir()
                    backups.fetch_item(record, ItemId(cluster.job, STEP, 0, 0), staged)
                    shutil.rmtree(staged)
                before = egress(proxy)

                # After: the daemons restore with fan-out.
                for r in range(NODES):
                    cluster.clear(r)
                    cluster.start(r)
                with proxy.lock:
                    proxy.seen.clear()
                t0 = time.monotonic()
                cluster.handshake([2, 3, 0, 1])
                cluster.wait_markers(STEP)
                seconds = time.monotonic() - t0
                after = egress(proxy)
                assert_restored(cluster, STEP, dict.fromkeys(range(NODES), files))
            finally:
                cluster.stop_all()
    finally:
        moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    item = sum(len(v) for v in files.values())
    print(f"4 replicas x 1 rank, one item of {item / 2**20:.1f} MiB per rank, S3 (moto)")
    print("| restore from the bucket | GET requests | bytes from the bucket | vs item |")
    print("|---|---:|---:|---:|")
    for label, (n, b) in (("before: each rank downloads", before), ("after: fan-out", after)):
        print(f"| {label} | {n} | {b:,} | {b / item:.2f}x |")
    print(f"after: restart to every marker in {seconds:.2f}s, every rank's bytes verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
