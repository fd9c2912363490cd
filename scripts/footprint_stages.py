"""Each stage of a node's checkpoint cycle measured on real daemons, for
``bench_footprint.py``: CPU seconds per GiB from ``/proc``, per daemon process.

Every daemon runs with mutual TLS and its data channel (the defaults a DaemonSet runs),
its RAM disk on tmpfs; a scenario isolates each stage:

- ingest (and both digests): a one-node job without a backup: the daemon takes each step
  and has nothing else to do with it;
- upload: the same job with a ``file://`` backup of every step, less the ingest;
- push send and push receive: a two-node job without a backup, where rank 0 saves steps
  of ``step_mib`` and rank 1 steps of 4 KiB: rank 0's CPU less the ingest is its push
  send, rank 1's CPU is its receive of rank 0's copies (its own tiny steps' ingest and push
  ride along, a few milliseconds each);
- restore receive and serve: then rank 0's RAM disk is wiped and its daemon restarted,
  and the job restarts: rank 0's CPU from the handshake to its marker, per GiB it pulled
  from rank 1, and rank 1's for serving it; less the same for a step of 4 KiB (the round's
  own cost, reported apart).

Every stage is what its bytes cost: each scenario saves as many steps of 4 KiB as it
measures of ``step_mib`` and takes their CPU off (``saves_measured``); what a step costs
whatever its bytes is reported apart, per scenario. The node's whole cycle
(``bench_footprint``) keeps both.

Each scenario saves ``warmup`` steps before the ``saves`` it measures, and prunes its
``file://`` bucket to the newest committed step as it goes (``prune_backups``): the steps
measured cost what every step of a long run does, with the RAM disks' and the bucket's
memory reused rather than grown (on this VM, writing into fresh memory costs many times
writing into memory freed a moment ago: docs/performance.md).

Helpers shared with the node's whole-cycle run (``bench_footprint.measure``) live here too.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.core.contract import PRERESTORE_FILE, marker_name
from mtc_replicator.tools import certs
from mtc_replicator.transport.tls import TlsFiles
from scripts.bench_peer import warm_pages
from scripts.bench_scale import Node, make_tls

MiB = 1 << 20
BLOCK = os.urandom(MiB)
TINY = 4096
"""Bytes of the steps of a rank whose own stages are not the ones measured."""
SETTLE = 1.0
"""Seconds given to a step's trailing work (retention, progress reports) before the CPU is
read, and to a daemon just started before its CPU is first read."""


def yaml_text(job: str, rank: int, nodes: int) -> str:
    """A job that backs up every step; of several nodes, each with one peer."""
    peers = "peers-per-node: 1\n" if nodes > 1 else ""
    return (
        f"job-name: {job}\nframework: orbax\nnode-rank: {rank}\nnodes: {nodes}\n"
        f"{peers}backup-interval-steps: 1\n"
    )


def handshake(node: Node, job: str, nodes: int) -> None:
    """What a rank's training process does at (re)start: one ``replicator.yaml`` rename."""
    tmp = node.ckpt / "replicator.yaml.tmp"
    tmp.write_text(yaml_text(job, node.rank, nodes))
    os.rename(tmp, node.ckpt / "replicator.yaml")


def save(ckpt: Path, step: int, nbytes: int, files: int = 1) -> float:
    """A step of ``nbytes``, published as Orbax does (one rename): ``write_step`` and
    ``publish``; the wall-clock time of the rename."""
    return publish(write_step(ckpt, step, nbytes, files), step)


def write_step(ckpt: Path, step: int, nbytes: int, files: int = 1) -> Path:
    """A step's directory, not yet published: one ``state`` file of ``nbytes``, or
    ``files`` files ``state.<i>`` sharing them."""
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-footprint"
    tmp.mkdir()
    names = ["state"] if files == 1 else [f"state.{i}" for i in range(files)]
    for i, name in enumerate(names):
        size = nbytes // files + (nbytes % files if i == files - 1 else 0)
        with (tmp / name).open("wb") as f:
            for _ in range(size // MiB):
                f.write(BLOCK)
            f.write(BLOCK[: size % MiB])
    return tmp


def publish(tmp: Path, step: int) -> float:
    """``write_step``'s directory renamed to its step; the wall-clock time it was."""
    published = time.time()
    os.rename(tmp, tmp.parent / str(step))
    return published


def daemon_argv(ckpt: Path, tls: TlsFiles, bucket: Path, *, backup: bool) -> list[str]:
    """A daemon on ``ckpt`` with mutual TLS; ``bucket`` its backup, or (``backup`` False)
    only the job's registry."""
    argv = [sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir", str(ckpt)]
    argv += ["--listen", "127.0.0.1:0", "--backup" if backup else "--registry", bucket.as_uri()]
    return [*argv, *certs.daemon_flags(tls)]


def prune_backups(bucket: Path, job: str) -> None:
    """A lifecycle rule on the ``file://`` bucket: every committed step of ``job`` but the
    newest deleted (its ``COMMIT`` first, as ``mtc backups prune`` does). A real bucket
    holds nothing in the node's memory; left to grow on tmpfs or in the page cache, the
    bucket makes the daemons write into fresh memory, which on this VM costs the writer
    10-14 CPU s/GiB (docs/performance.md). The newest committed step, all the daemons ask
    the bucket about in a run, stays."""
    committed = (p.parent.name for p in (bucket / job).glob("*/COMMIT"))
    steps = sorted(int(name) for name in committed if name.isdigit())
    for step in steps[:-1]:
        (bucket / job / str(step) / "COMMIT").unlink()
        shutil.rmtree(bucket / job / str(step), ignore_errors=True)


def wait_logged(
    logs: list[Path], pattern: str, needed: int, what: str, timeout: float = 120.0
) -> None:
    """Until ``pattern`` was logged ``needed`` times in ``logs`` together."""
    found = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(len(found.findall(p.read_text(errors="replace"))) for p in logs) >= needed:
            return
        time.sleep(0.1)
    tail = "\n".join(logs[0].read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(f"{what} not in time; {logs[0]}:\n{tail}")


def wait_file(path: Path, what: str, node: Node, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.lexists(path):
        if time.monotonic() > deadline:
            tail = "\n".join(node.log.read_text(errors="replace").splitlines()[-20:])
            raise TimeoutError(f"{what} not in time; {node.log}:\n{tail}")
        time.sleep(0.05)


@dataclass
class Stages:
    """Where the scenarios run and what each rank saves."""

    root: Path
    """Logs and certificates."""
    ram: Path
    """The RAM disks (tmpfs)."""
    buckets: Path
    """The ``file://`` buckets (backups and registries), one per scenario."""
    ca: certs.Pair
    step_mib: int
    saves: int
    """Steps measured, after ``warmup`` steps that are not."""
    warmup: int
    launch: tuple[tuple[str, ...], ...] = ()
    """What each rank's daemon runs under, by rank, put before its argv (``taskset -c 0``:
    pinned before it starts, every thread it makes inherits the cores); empty: nothing."""

    @property
    def gib(self) -> float:
        """GiB a saving rank checkpoints over a scenario's measured steps."""
        return self.saves * self.step_mib / 1024

    def nodes(self, name: str, count: int, *, backup: bool) -> list[Node]:
        base = self.root / name
        bucket = self.buckets / name
        bucket.mkdir(parents=True)
        made = []
        for rank in range(count):
            ckpt = self.ram / name / f"node{rank}" / "ckpt"
            ckpt.mkdir(parents=True)
            tls = make_tls(base, self.ca, f"node{rank}")
            argv = daemon_argv(ckpt, tls, bucket, backup=backup)
            if self.launch:
                argv = [*self.launch[rank], *argv]
            made.append(Node(rank, ckpt, argv, base / f"node{rank}.log"))
        return made

    @contextlib.contextmanager
    def running(self, name: str, count: int, job: str, *, backup: bool) -> Iterator[list[Node]]:
        """``count`` daemons of a job of ``count`` ranks, its first round over (a fresh
        start); stopped and their RAM disks removed after."""
        nodes = self.nodes(name, count, backup=backup)
        try:
            for node in nodes:
                node.start()
            for node in nodes:
                handshake(node, job, count)
            for node in nodes:
                wait_file(node.ckpt / PRERESTORE_FILE, f"{job}'s first round", node)
            time.sleep(SETTLE)
            yield nodes
        finally:
            for node in nodes:
                node.stop()
            shutil.rmtree(self.ram / name, ignore_errors=True)
            shutil.rmtree(self.buckets / name, ignore_errors=True)

    def saves_measured(
        self, nodes: list[Node], one_step: Callable[[int, int], None]
    ) -> tuple[list[float], list[float]]:
        """``one_step(step, nbytes)`` for ``warmup`` steps of ``step_mib``, then ``saves``
        steps of 4 KiB, then ``saves`` of ``step_mib`` (``last_step`` is the last): each of
        ``nodes``' CPU seconds over the big ones and over the tiny ones, each with their
        trailing work. The big ones' less the tiny ones' is what the bytes cost (the
        stage's CPU per GiB); the tiny ones' is what a step costs whatever its bytes (its
        handshake with the job, manifests, signatures, logs, the daemon's idle ticks over
        the step's seconds), reported apart as a restore round's is.
        The warm-up steps take what a run's first steps take once (connections, threads,
        the RAM disks' and the bucket's memory), so the measured ones cost what every
        step of a long run does."""
        step = 0
        big = self.step_mib * MiB
        for _ in range(self.warmup):
            step += 10
            one_step(step, big)
        spent: list[list[float]] = []
        for nbytes in (TINY, big):
            time.sleep(SETTLE)
            cpu0 = [n.cpu_seconds() for n in nodes]
            for _ in range(self.saves):
                step += 10
                one_step(step, nbytes)
            time.sleep(SETTLE)
            spent.append([n.cpu_seconds() - c for n, c in zip(nodes, cpu0, strict=True)])
        tiny, whole = spent
        return whole, tiny

    @property
    def last_step(self) -> int:
        return (self.warmup + 2 * self.saves) * 10

    def per_gib(self, whole: float, tiny: float) -> float:
        """CPU s/GiB of the bytes alone: the big steps' CPU less the tiny steps'."""
        return (whole - tiny) / self.gib

    def one_node(self, *, backup: bool) -> tuple[float, float]:
        """CPU s/GiB of a one-node job's daemon (ingest, and the upload with ``backup``),
        and its CPU seconds per step whatever the step's bytes."""
        name = "upload" if backup else "ingest"
        job = f"stage-{name}"
        with self.running(name, 1, job, backup=backup) as (node,):

            def one_step(step: int, nbytes: int) -> None:
                save(node.ckpt, step, nbytes)
                if backup:
                    committed = rf"backup committed job={job} step={step} "
                    wait_logged([node.log], committed, 1, f"{job}'s backup of {step}")
                    prune_backups(self.buckets / name, job)
                else:
                    ingested = rf"ingested {job}/s{step}/n0-w0: "
                    wait_logged([node.log], ingested, 1, f"{job}'s step {step}")

            (whole,), (tiny,) = self.saves_measured([node], one_step)
            return self.per_gib(whole, tiny), tiny / self.saves

    def pair(self) -> dict[str, float]:
        """CPU s/GiB of the two-node job's daemons: rank 0's (ingest and push send), rank
        1's (push receive); then rank 0's RAM disk restored from rank 1 twice, its step of
        ``step_mib`` and then one of 4 KiB: the first less the second, per GiB, is the
        restore's receive (rank 0) and serve (rank 1); the second alone is the restore
        round's own cost (CPU seconds, whatever the bytes)."""
        job = "stage-peer"
        with self.running("peer", 2, job, backup=False) as (a, b):

            def one_step(step: int, nbytes: int) -> None:
                save(a.ckpt, step, nbytes)
                save(b.ckpt, step, TINY)
                for node in (a, b):
                    pushed = rf"pushed {job}/s{step}/n{node.rank}-w0 to "
                    wait_logged([node.log], pushed, 1, f"rank {node.rank}'s push of {step}")

            (sent, received), (sent_tiny, received_tiny) = self.saves_measured([a, b], one_step)
            restoring, serving = self._restore(a, b, job, self.last_step)
            tiny = self.last_step + 10
            one_step(tiny, TINY)
            round_restoring, round_serving = self._restore(a, b, job, tiny)
            gib = self.step_mib / 1024
            return {
                "ingest_and_push_send": self.per_gib(sent, sent_tiny),
                "push_receive": self.per_gib(received, received_tiny),
                "step_pushing": sent_tiny / self.saves,
                "step_receiving": received_tiny / self.saves,
                "restore_receive": (restoring - round_restoring) / gib,
                "restore_serve": (serving - round_serving) / gib,
                "restore_round_restoring": round_restoring,
                "restore_round_serving": round_serving,
            }

    def _restore(self, a: Node, b: Node, job: str, step: int) -> tuple[float, float]:
        """Rank 0's RAM disk lost, its daemon restarted, the job restarted: the CPU seconds
        rank 0 spends from the handshake to its marker of ``step``, and rank 1 meanwhile."""
        a.stop()
        a.wipe()
        a.start()
        time.sleep(SETTLE)
        # The pull writes into pages the kernel just freed, as bench_restore's do and as
        # the floors' writes do: memory this VM's host took back meanwhile would cost the
        # pull up to 10x to fill (docs/performance.md, "Fresh memory on this VM").
        warm_pages(self.ram, self.step_mib * MiB)
        cpu0 = (a.cpu_seconds(), b.cpu_seconds())
        for node in (a, b):
            handshake(node, job, 2)
        for node in (a, b):
            marker = node.ckpt / marker_name(job, step, node.rank, 0)
            wait_file(marker, f"rank {node.rank}'s marker of step {step}", node)
        pulled = rf"pulled {job}/s{step}/n0-w0 from "
        wait_logged([a.log], pulled, 1, f"rank 0's pull of step {step} from its peer")
        time.sleep(SETTLE)
        return a.cpu_seconds() - cpu0[0], b.cpu_seconds() - cpu0[1]

    def measure(self) -> dict[str, float]:
        """Every stage's CPU s/GiB (``footprint_floors.STAGE_FLOORS``'s names)."""
        ingest, step_ingesting = self.one_node(backup=False)
        with_upload, step_uploading = self.one_node(backup=True)
        peer = self.pair()
        return {
            "ingest": ingest,
            "push_send": peer["ingest_and_push_send"] - ingest,
            "push_receive": peer["push_receive"],
            "upload": with_upload - ingest,
            "restore_receive": peer["restore_receive"],
            "restore_serve": peer["restore_serve"],
            # Not stages: CPU seconds of a restore round whatever its bytes,
            "restore_round_restoring": peer["restore_round_restoring"],
            "restore_round_serving": peer["restore_round_serving"],
            # and of a step of 4 KiB, by scenario (per daemon).
            "step_ingesting": step_ingesting,
            "step_uploading": step_uploading,
            "step_pushing": peer["step_pushing"],
            "step_receiving": peer["step_receiving"],
        }
