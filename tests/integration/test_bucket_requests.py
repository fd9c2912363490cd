"""No storm on the bucket: what a backup restore round asks of S3, counted on moto's server.

A real coordinator (the daemon running rank 0, ``--backup s3://...``) and many simulated
members in this process: each joins over real gRPC with an empty inventory (its RAM disk
was lost), runs the real round participant (``cluster.rounds.RoundParticipant``) on a real
``LocalStore`` on tmpfs, and fetches its item with the real backup fetch
(``BackupStore.fetch_pinned``). The daemon reaches moto through one recording proxy, the
members through another, so each side's requests are counted apart:

- the coordinator's listings are a small constant per round at 64 and at 256 members:
  one delimiter listing of ``<job>/``, however many steps, items and files, for each
  ``BACKUPS_TTL`` (5 s) the joins take to arrive, never one per join;
- no member lists, and the members' reads are exactly the objects of their items (a
  manifest and one file each), each read once, plus the registry lookup of their joins.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.cluster.coordinator_client import RegistryFinder
from mtc_replicator.cluster.coordinators import BACKUPS_TTL
from mtc_replicator.cluster.registry import Registry
from mtc_replicator.cluster.rounds import JobRank, RoundContext, RoundOutcome, RoundParticipant
from mtc_replicator.cluster.sources import ItemSources
from mtc_replicator.core.backup_layout import data_key, manifest_key
from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.s3 import S3ObjectStore
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import config_text, ram_disk, wait_until, write_yaml_atomic
from tests.storage_servers import Bucket, FaultProxy, Request, s3_env

pytestmark = pytest.mark.integration

STEPS = (10, 20)
"""Two committed steps: an older one makes a listing of every object of the job (what
``committed_steps`` did before) take more pages at 256 members than at 64."""
KEYS = {"peers_per_node": 1, "backup_interval_steps": 1000}
FAST = ("--rescan-seconds", "0.3", "--settle-seconds", "2", "--config-wait-seconds", "3")


def is_listing(req: Request) -> bool:
    return req.method == "GET" and ("list-type=" in req.path or "prefix=" in req.path)


def object_key(bucket: Bucket, req: Request) -> str:
    """The backup key a path-style GET names (``/<bucket>/backups/<key>``)."""
    path = req.path.split("?", 1)[0]
    return path.removeprefix(f"/{bucket.name}/backups/")


def seed(bucket: Bucket, job: str, nodes: int, tmp: Path) -> None:
    """Committed backups of every rank's item of ``STEPS``: tiny, one file per item."""
    backups = BackupStore(S3ObjectStore.from_url(bucket.url))
    for step in STEPS:

        def upload(rank: int, step: int = step) -> str:
            src = tmp / f"src-{step}-{rank}"
            src.write_bytes(f"step {step} rank {rank}".encode())
            item = ItemId(job, step, rank, 0)
            backups.upload_item(build_manifest(item, src), src)
            return item.key

        with ThreadPoolExecutor(8) as pool:
            keys = list(pool.map(upload, range(nodes)))
        assert backups.try_commit(job, step, keys) is not None


async def member(
    rank: int,
    job: str,
    nodes: int,
    ram: Path,
    backups: BackupStore,
    registry: Registry,
    errors: list[str],
) -> RoundOutcome:
    """One simulated rank: an empty store, the real participant, the real backup fetch."""
    config = parse_config(config_text(job, rank=rank, nodes=nodes, **KEYS))
    ckpt = ram / f"m{rank}" / "checkpoint"
    ckpt.mkdir(parents=True)
    store = LocalStore(ckpt)
    store.open()

    def error(message: str, step: int | None) -> None:
        errors.append(f"rank {rank}: {message}")

    me = JobRank(
        config=config,
        incarnation_id=f"sim-{rank}-{uuid.uuid4().hex[:8]}",
        store=store,
        finder=RegistryFinder(registry),
        advertise=f"127.0.0.1:{20000 + rank}",
    )
    sources = ItemSources(store, rank, backups=backups)
    ctx = RoundContext(me, sources, error=error)
    try:
        return await RoundParticipant(ctx).run()
    finally:
        store.close()


async def members(
    nodes: int, job: str, ram: Path, bucket: Bucket, errors: list[str]
) -> list[RoundOutcome]:
    """Ranks 1..nodes-1, concurrently, sharing one S3 client as one process's ranks would."""
    s3 = S3ObjectStore.from_url(bucket.url)
    backups, registry = BackupStore(s3), Registry(s3)
    return await asyncio.gather(
        *(member(r, job, nodes, ram, backups, registry, errors) for r in range(1, nodes))
    )


def restore_round(
    members_count: int, s3_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, object]:
    """Rank 0's daemon and ``members_count`` simulated ranks restore ``STEPS[-1]`` from the
    backup; the requests each side made, counted by two proxies."""
    nodes = members_count + 1
    job = f"storm-{members_count}-{uuid.uuid4().hex[:6]}"
    root = tmp_path / f"n{members_count}"
    root.mkdir()
    t0 = time.monotonic()
    seed(s3_bucket, job, nodes, root)
    seeded = time.monotonic() - t0
    to_daemon, to_members = FaultProxy(s3_bucket.endpoint), FaultProxy(s3_bucket.endpoint)
    to_daemon.start()
    to_members.start()
    try:
        with ram_disk(root / "ram", "512m") as ckpt:
            daemon = DaemonProcess(
                ckpt,
                backup=s3_bucket.url,
                extra_args=FAST,
                env=s3_env(to_daemon.url),
                log_path=root / "daemon.log",
            ).start()
            try:
                write_yaml_atomic(ckpt, config_text(job, rank=0, nodes=nodes, **KEYS))
                for key, value in s3_env(to_members.url).items():
                    monkeypatch.setenv(key, value)
                t1 = time.monotonic()
                errors: list[str] = []
                outcomes = asyncio.run(members(nodes, job, root / "ram", s3_bucket, errors))
                elapsed = time.monotonic() - t1
                marker = f"{job}-s{STEPS[-1]}-n0-w0.restore"
                wait_until((ckpt / marker).exists, marker, daemon=daemon, timeout=30)
                daemon_requests = to_daemon.requests()  # the round, before steady state
                member_requests = to_members.requests()
            finally:
                daemon.stop(timeout=20)
    finally:
        to_daemon.stop()
        to_members.stop()
        for key, value in s3_bucket.env.items():
            monkeypatch.setenv(key, value)
    assert errors == []
    assert [(o.step, o.source) for o in outcomes] == [(STEPS[-1], "backup")] * members_count
    return {
        "job": job,
        "seconds": elapsed,
        "seeded": seeded,
        "daemon": daemon_requests,
        "members": member_requests,
    }


def test_a_backup_restore_round_lists_a_constant_number_of_times(
    s3_bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rounds = {n: restore_round(n, s3_bucket, tmp_path, monkeypatch) for n in (64, 256)}
    listings = {}
    for n, found in rounds.items():
        job = str(found["job"])
        daemon_reqs: list[Request] = found["daemon"]  # type: ignore[assignment]
        member_reqs: list[Request] = found["members"]  # type: ignore[assignment]
        # No member lists: the plan gave each its digest.
        assert [r.path for r in member_reqs if is_listing(r)] == []
        # A member reads its item's manifest and file, once each, and the registry.
        reads = collections.Counter(
            object_key(s3_bucket, r)
            for r in member_reqs
            if r.method == "GET" and not object_key(s3_bucket, r).startswith("_registry/")
        )
        step = STEPS[-1]
        items = [ItemId(job, step, r, 0) for r in range(1, n + 1)]
        assert reads == collections.Counter(
            [*(manifest_key(i) for i in items), *(data_key(i, "") for i in items)]
        )
        lookups = [r for r in member_reqs if "_registry/" in r.path]
        assert len(lookups) <= 2 * n, "about one registry read per member's join"
        assert {r.method for r in member_reqs} <= {"GET", "HEAD"}, "members write nothing"
        listings[n] = [r.path for r in daemon_reqs if is_listing(r)]
        print(
            f"members={n}: round {found['seconds']:.1f}s (seeding {found['seeded']:.1f}s); "
            f"coordinator daemon: {len(listings[n])} listings, {len(daemon_reqs)} requests; "
            f"members: 0 listings, {sum(reads.values())} object reads, "
            f"{len(lookups)} registry reads"
        )
    # The coordinator's listings, independent of the members: a delimiter listing of the
    # job's steps serves every join for BACKUPS_TTL, so one per round while the joins arrive
    # within it (a slow box spread 256 joins over 16 s: one more per TTL, never one per
    # join); each S3 store's one bucket check per process (max-keys=1; the daemon opens the
    # backup and the registry apart), and the start-up probe's one listing of the empty
    # _mtc-probe/ prefix (the backup is the registry here).
    for n, paths in listings.items():
        steps = [p for p in paths if "delimiter=%2F" in p]
        checks = [p for p in paths if "max-keys=1" in p]
        probes = [p for p in paths if "_mtc-probe" in p]
        seconds = float(rounds[n]["seconds"])  # type: ignore[arg-type]
        assert 1 <= len(steps) <= 1 + int(seconds // BACKUPS_TTL), (seconds, paths)
        assert len(checks) <= 2, paths
        assert len(probes) == 1, paths
        assert len(steps) + len(checks) + len(probes) == len(paths), paths
