"""``mtc demo --nodes 4``: the cluster story with real processes, checked end to end.

Four ``mtc-replicator`` daemons (one per "node": its own RAM-disk directory and port) share one
``file://`` backup, which is also the coordinator registry. A 4-process PyTorch job (one rank
per node, gloo on loopback, gradients averaged with ``all_reduce``) saves through
``mtc_replicator/client/``. The demo crashes the job, kills node 2 and wipes its RAM disk, restarts
the job and shows rank 2 restored from its peer; then wipes every node and shows every rank restored
from the backup. Every restore must give each rank bit-identical weights to what it saved; otherwise
the demo exits non-zero.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.demo.single import (
    JOB,
    STEPS,
    Daemon,
    DemoFailure,
    Trainer,
    check,
    ram_disk,
    say,
    store_of,
    throwaway_tls,
    wait_for_backups,
    wipe,
)
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs

CRASH_AFTER = 15
FAST = ("--rescan-seconds", "0.3", "--settle-seconds", "2", "--config-wait-seconds", "3")
"""Daemon timings shortened so that the demo takes seconds, not minutes."""

Saved = dict[int, dict[int, str]]
"""rank -> step -> digest of the weights that rank saved at that step."""


@dataclass
class Node:
    rank: int
    ckpt: Path
    daemon: Daemon

    def holds(self, step: int, rank: int) -> bool:
        """Whether this node's daemon committed ``rank``'s item of ``step`` (home or peer copy)."""
        item = store_of(self.ckpt) / "items" / JOB / str(step) / f"{rank}-0"
        return (item / "MANIFEST.json").exists()


def owner_file(work: Path, rank: int) -> Path:
    """What the CSI plugin writes when it publishes a node's CHECKPOINT_DIR into the job's pod:
    every node of the demo job belongs to the namespace ``demo``."""
    path = work / f"node{rank}.owner.json"
    record = {
        "namespace": "demo",
        "pod": f"{JOB}-{rank}",
        "pod_uid": uuid.uuid4().hex,
        "service_account": "default",
        "published_at": time.time(),
    }
    path.write_text(json.dumps(record))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Job:
    """One run of the whole N-rank training job: one trainer process per node."""

    def __init__(self, nodes: list[Node], step_seconds: float, hang_after: int = 0) -> None:
        port = free_port()
        self.trainers = [
            Trainer(
                n.ckpt,
                step_seconds,
                extra_args=(
                    "--rank",
                    str(n.rank),
                    "--nodes",
                    str(len(nodes)),
                    "--dist-port",
                    str(port),
                    "--hang-after",
                    str(hang_after),
                ),
            )
            for n in nodes
        ]
        for t in self.trainers:
            t.start()

    def run_until(self, kind: str, saved: Saved) -> None:
        """Read every rank's events until it reports ``kind`` (or ends), recording saves."""
        for rank, t in enumerate(self.trainers):
            while (e := t.next_event()) is not None:
                if e["event"] == "saved":
                    saved.setdefault(rank, {})[int(str(e["step"]))] = str(e["digest"])
                if e["event"] == kind:
                    break
            else:
                assert t.proc is not None
                if t.proc.wait() != 0:
                    raise DemoFailure(f"rank {rank}'s trainer exited with {t.proc.returncode}")
                if kind != "done":
                    raise DemoFailure(f"rank {rank}'s trainer ended before {kind!r}")

    def run_to_end(self, saved: Saved) -> None:
        self.run_until("done", saved)
        for rank, t in enumerate(self.trainers):
            t.run_to_end()
            done = t.first("done")
            say(
                f"  rank {rank} finished step {STEPS} (checkpoint {done['digest']}, "
                f"model {done['replica']})"
            )

    def kill(self) -> None:
        for t in self.trainers:
            if t.proc is not None:
                t.kill()


def check_restores(
    label: str, job: Job, want_step: int, want_sources: list[str], saved: Saved
) -> list[str]:
    """Check every rank's restore; print the table; return the failed checks.

    Two digests per rank: its checkpoint's (the weights and the rank number it records, so
    each rank's differs; it must equal what that rank saved) and its model's (the weights
    alone: the same on every rank, as the job is data-parallel, gradients averaged with
    ``all_reduce``). A job without data parallelism (sharded weights) would compare only
    the first: each rank's shard against what that rank saved.
    """
    failures: list[str] = []
    rows = []
    replicas: set[object] = set()
    for rank, t in enumerate(job.trainers):
        r = t.first("restored")
        step, source = int(str(r["step"])), str(r["source"])
        want_digest = saved.get(rank, {}).get(step)
        ok = step == want_step and source == want_sources[rank] and r["digest"] == want_digest
        rows.append((rank, step, source, want_sources[rank], r["digest"], r["replica"], ok))
        replicas.add(r["replica"])
        check(f"{label}: rank {rank} restored step", step, want_step, failures)
        check(f"{label}: rank {rank} restore source", source, want_sources[rank], failures)
        check(
            f"{label}: rank {rank}'s checkpoint digest (what it saved)",
            r["digest"],
            want_digest,
            failures,
        )
    check(
        f"{label}: distinct model digests across ranks (data-parallel: one model; each "
        "rank's checkpoint digest also covers its rank number, so those differ)",
        len(replicas),
        1,
        failures,
    )
    say(f"  restore table ({label}):")
    say(
        f"    {'rank':>4}  {'step':>4}  {'source':<7} {'expected':<8} {'checkpoint':<16}  "
        f"{'model':<16}  result"
    )
    for rank, step, source, want, dig, model, ok in rows:
        say(
            f"    {rank:>4}  {step:>4}  {source:<7} {want:<8} {dig!s:<16}  {model!s:<16}  "
            f"{'OK' if ok else 'FAIL'}"
        )
    return failures


def wait_replicated(nodes: list[Node], step: int, timeout: float = 60) -> None:
    """Until every rank's ``step`` is committed at home and held by at least one peer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(
            n.holds(step, n.rank) and any(p.holds(step, n.rank) for p in nodes if p is not n)
            for n in nodes
        ):
            return
        time.sleep(0.2)
    raise DemoFailure(f"step {step} was not replicated to a peer of every rank in {timeout}s")


def _start_cluster(work: Path, backup: Path, nodes: int) -> list[Node]:
    """One node per rank, each with its RAM disk, TLS certificate and owner file (not started)."""
    ca = certs.new_ca()
    cluster: list[Node] = []
    for rank in range(nodes):
        ckpt = ram_disk(work, f"node{rank}")
        ckpt.mkdir(parents=True, exist_ok=True)
        log = work / f"node{rank}.log"
        args = (
            *FAST,
            *throwaway_tls(work, ca, f"node{rank}"),
            *("--owner-file", str(owner_file(work, rank))),
        )
        cluster.append(Node(rank, ckpt, Daemon(ckpt, backup, log, args, f"node {rank} daemon")))
    say(f"{nodes} nodes, one daemon + one trainer rank each; work dir: {work}")
    say(f"shared backup and coordinator registry: {backup.as_uri()}")
    say(f"mutual TLS between daemons: a throwaway CA, one certificate per node in {work / 'tls'}")
    say("COMMITs and registry entries signed with the node keys; the job owned by namespace demo")
    for n in cluster:
        say(f"  node {n.rank}: CHECKPOINT_DIR (RAM disk) {n.ckpt}")
    return cluster


def _crash(
    cluster: list[Node], step_seconds: float, saved: Saved, jobs: list[Job], failures: list[str]
) -> None:
    """Stage 1: a fresh job saves, replicates, then every trainer is killed."""
    nodes = len(cluster)
    say(f"stage 1: fresh {nodes}-rank job (gloo), save every 5 steps, crash after step 15")
    jobs.append(job := Job(cluster, step_seconds, hang_after=CRASH_AFTER))
    job.run_until("hanging", saved)
    for rank in range(nodes):
        check(f"rank {rank} started fresh", job.trainers[rank].first("fresh")["event"],
              "fresh", failures)  # fmt: skip
    wait_replicated(cluster, CRASH_AFTER)
    say(f"  every rank saved step {CRASH_AFTER}, committed at home and on a peer")
    job.kill()
    say("  all trainers killed with SIGKILL")


def _peer_restore(
    cluster: list[Node], victim: int, step_seconds: float, saved: Saved, jobs: list[Job]
) -> list[str]:
    """Stage 2: one node loses its daemon and RAM disk; its ranks restore from a peer."""
    say(f"stage 2: node {victim} dies: kill its daemon, wipe its RAM disk, restart it")
    cluster[victim].daemon.kill()
    wipe(cluster[victim].ckpt)
    say(f"  {cluster[victim].ckpt} is now empty: {sorted(cluster[victim].ckpt.iterdir())}")
    cluster[victim].daemon.start()
    say("  restart the job: every rank restores, node 2's data comes from its peer")
    jobs.append(job := Job(cluster, step_seconds))
    job.run_to_end(saved)
    sources = ["peer" if r == victim else "local" for r in range(len(cluster))]
    return check_restores("peer restore", job, CRASH_AFTER, sources, saved)


def _backup_restore(
    cluster: list[Node], backup: Path, step_seconds: float, saved: Saved, jobs: list[Job]
) -> list[str]:
    """Stage 3: every RAM disk wiped; every rank restores the newest committed backup."""
    wait_for_backups(backup, want=STEPS, timeout=60)
    say("stage 3: the job finished; stop every daemon and wipe every RAM disk")
    for n in cluster:
        n.daemon.stop()
    steps = BackupStore(FileObjectStore(backup)).committed_steps(JOB)
    if not steps:
        raise DemoFailure("no committed backup step")
    newest = max(steps)
    say(f"  committed backup steps: {sorted(steps)}; the newest is {newest}")
    for n in cluster:
        wipe(n.ckpt)
        n.daemon.start()
    say("  restart the job: every rank restores from the backup")
    jobs.append(job := Job(cluster, step_seconds))
    job.run_to_end(saved)
    return check_restores("backup restore", job, newest, ["backup"] * len(cluster), saved)


def run(workdir: Path | None = None, step_seconds: float = 0.2, nodes: int = 4) -> int:
    """The cluster story; 0 when every check passed.

    ``step_seconds`` below ~0.1 lets saves outrun the coordinator's backup order: the ordered
    step can be deleted by retention first, and no backup is ever committed (a daemon race).
    """
    work = workdir or Path(tempfile.mkdtemp(prefix="mtc-demo-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    backup = work / "backup"
    cluster = _start_cluster(work, backup, nodes)
    failures: list[str] = []
    jobs: list[Job] = []
    saved: Saved = {}
    started = time.monotonic()
    try:
        for n in cluster:
            n.daemon.start()
        _crash(cluster, step_seconds, saved, jobs, failures)
        failures += _peer_restore(cluster, 2 % nodes, step_seconds, saved, jobs)
        failures += _backup_restore(cluster, backup, step_seconds, saved, jobs)
    except DemoFailure as exc:
        failures.append(str(exc))
        say(f"FAILED: {exc}")
    finally:
        for j in jobs:
            j.kill()
        for n in cluster:
            n.daemon.stop()
        if workdir is None and not failures:
            shutil.rmtree(work, ignore_errors=True)
        if not failures:
            for n in cluster:
                shutil.rmtree(n.ckpt, ignore_errors=True)
                shutil.rmtree(store_of(n.ckpt), ignore_errors=True)
    took = time.monotonic() - started
    if failures:
        say(f"FAILED checks: {failures}; logs in {work} ({took:.0f}s)")
        return 1
    say(f"all checks passed in {took:.0f}s: every rank's restore was bit-identical, from its")
    say("local RAM disk, from a peer's copy of a wiped node, and from the backup")
    return 0
