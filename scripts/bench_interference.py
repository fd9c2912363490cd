"""Measure how much the replicator slows a training job down, and what a save costs the job.

A stand-in trainer (a separate, single-threaded Python process: numpy matrix multiplies and
large array copies per "step", ~0.3 s here) saves a ``--size-mib`` state dict every
``--save-every`` steps through ``mtc_replicator/client/`` (``mtc_replicator.client.handshake``, then
``mtc_replicator.client.torch_io.save_state_dict``). Its job has two ranks: rank 0 is the trainer,
rank 1 a "mirror" process that saves a state dict of the same size right after the trainer's save
(it does no compute; it stands for the other node). Configurations, run interleaved
``--repeats`` times, each run with fresh directories and a fresh job:

- ``a``: no daemons (the two processes save; this script deletes each ``<N>/`` once it
  appears, as a daemon would take it away);
- ``b``: two real daemons (``python -m mtc_replicator.node.daemon``, mutual TLS, one per rank on
  its own tmpfs directory under /dev/shm), replicating to each other and backing every saved
  step up to a ``file://`` backup on tmpfs (``backup-interval-steps: 1``), unthrottled;
- ``c``: the same with ``--max-transfer-rate`` at each of ``--rates`` (default ``auto``:
  2.5x and 0.5x the bytes per second a daemon must send to replicate and back up each step
  within the save interval measured in ``a``; the table names the flags each run had).

Reported per configuration (pooled over the repeats): the trainer's median and p95 step time
for steps without a save, for save steps, and overall, with ratios to ``a``; per saved step
the seconds from the trainer's save returning to the step being replicated (both ranks'
items committed in their peer's store, polled every 50 ms) and backed up (its ``COMMIT`` in
the backup), and how many saved steps got there before the next save. Committed backups
older than the newest are deleted as the run goes, like a bucket's lifecycle rule, to bound
the RAM this takes.

The client's save cost: a separate single-threaded process alternates
``mtc_replicator.client.torch_io.save_state_dict`` and plain ``torch.save(state, path)`` of the same
``--size-mib`` state dict (4 float32 tensors) into the same tmpfs directory, ``--save-rounds``
times each, and prints the medians and their ratio.

CPU placement (``--pin``, the default on a box with 2 or more CPUs): this box has 2 cores for
two "nodes", so the run models ONE node's trainer: the trainer pins itself to CPU 0, and
everything else (both daemons, the mirror, this script) runs on the other CPUs. On a real
node the daemon gets cores the job leaves idle (the data loader's and the host's) while the
job's own threads keep theirs; what it cannot avoid sharing is memory bandwidth, the caches
and the save's tmpfs writes, which is what the rate limit and the pause during saves are
for. ``--no-pin`` lets the scheduler place everything (the daemons then also take CPU time
from the trainer, as on a node whose every core the job uses).

    .venv/bin/python scripts/bench_interference.py                  # 1 GiB, about 6 minutes
    .venv/bin/python scripts/bench_interference.py --rates 600MiB,150MiB --repeats 3 --json

Numbers are only comparable within one run: other work on the box moves them.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHM = Path("/dev/shm")  # noqa: S108 (tmpfs, where a RAM disk lives)
TENSORS = 4
MIB = 1 << 20
SINGLE_THREAD = {
    name: "1"
    for name in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    )
}


def emit(out: IO[str], **event: object) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


def pin(cpus: str) -> None:
    """Pin this process (its threads to come inherit it) to ``cpus`` ("0", "1-3", "")."""
    if not cpus:
        return
    chosen: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        chosen.update(range(int(low), int(high or low) + 1))
    os.sched_setaffinity(0, chosen)


# --- the stand-in trainer and the mirror (child processes) --------------------------------------


def make_state(size_mib: int, *, touch: bool) -> dict[str, Any]:
    """``TENSORS`` float32 tensors of ``size_mib`` in all; ``touch=False`` leaves the pages
    unwritten (the mirror's: saved as zeros without taking its RAM)."""
    import torch

    each = (size_mib * MIB) // TENSORS // 4
    tensors = [torch.empty(each, dtype=torch.float32) for _ in range(TENSORS)]
    if touch:
        for i, t in enumerate(tensors):
            t.fill_(float(i))
    return {f"layer{i}.weight": t for i, t in enumerate(tensors)}


class Work:
    """A step's fixed CPU and memory-bandwidth work: matrix multiplies, then array copies."""

    def __init__(self, matmul: int, matmuls: int, copy_mib: int, copies: int) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((matmul, matmul), dtype=np.float32)
        self.b = rng.standard_normal((matmul, matmul), dtype=np.float32)
        self.src = np.ones(copy_mib * MIB // 4, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.matmuls, self.copies = matmuls, copies

    def step(self) -> float:
        import numpy as np

        acc = 0.0
        for _ in range(self.matmuls):
            acc += float((self.a @ self.b)[0, 0])
        for i in range(self.copies):
            src, dst = (self.src, self.dst) if i % 2 == 0 else (self.dst, self.src)
            np.copyto(dst, src)
        return acc


def handshake(a: argparse.Namespace, rank: int) -> None:
    from mtc_replicator import client

    result = client.handshake(
        a.dir,
        job_name=a.job,
        framework="pytorch.distributed",
        node_rank=rank,
        nodes=2,
        peers_per_node=1,
        backup_interval_steps=1,
        timeout=120,
        poll_interval=0.1,
    )
    if result.step is not None:
        raise RuntimeError(f"a fresh job was offered step {result.step} to restore")


def run_trainer(a: argparse.Namespace) -> int:
    pin(a.cpus)
    import torch

    from mtc_replicator.client.torch_io import save_state_dict

    torch.set_num_threads(1)
    work = Work(a.matmul, a.matmuls, a.copy_mib, a.copies)
    state = make_state(a.size_mib, touch=True)
    if a.daemons:
        handshake(a, 0)
    emit(sys.stdout, event="ready")
    first = state["layer0.weight"]
    for step in range(1, a.steps + 1):
        t0 = time.monotonic()
        work.step()
        first[: 1 << 16].add_(1.0)  # the weights change every step
        save_seconds = None
        if step % a.save_every == 0:
            s0 = time.monotonic()
            save_state_dict(a.dir, step, state)
            save_seconds = time.monotonic() - s0
        end = time.monotonic()
        emit(sys.stdout, event="step", step=step, seconds=end - t0, save=save_seconds, at=end)
    emit(sys.stdout, event="done")
    return 0


def run_mirror(a: argparse.Namespace) -> int:
    """Rank 1: saves each step the parent names on stdin; ends at EOF."""
    pin(a.cpus)
    import torch

    from mtc_replicator.client.torch_io import save_state_dict

    torch.set_num_threads(1)
    state = make_state(a.size_mib, touch=False)
    if a.daemons:
        handshake(a, 1)
    emit(sys.stdout, event="ready")
    for line in sys.stdin:
        step = int(line)
        save_state_dict(a.dir, step, state)
        emit(sys.stdout, event="saved", step=step, at=time.monotonic())
    return 0


def run_save_cost(a: argparse.Namespace) -> int:
    """Alternate the client's save and plain ``torch.save`` into one tmpfs directory."""
    pin(a.cpus)
    import torch

    from mtc_replicator.client.torch_io import save_state_dict

    torch.set_num_threads(1)
    state = make_state(a.size_mib, touch=True)
    directory = Path(a.dir)
    times: dict[str, list[float]] = {"torch.save": [], "client": []}
    for r in range(a.rounds):
        order = ["torch.save", "client"] if r % 2 == 0 else ["client", "torch.save"]
        for name in order:
            t0 = time.perf_counter()
            if name == "client":
                save_state_dict(directory, r, state)
            else:
                torch.save(state, str(directory / "plain.pt"))
            times[name].append(time.perf_counter() - t0)
            # Freed at once, so that every save writes into freshly allocated tmpfs pages.
            shutil.rmtree(directory / str(r), ignore_errors=True)
            (directory / "plain.pt").unlink(missing_ok=True)
    emit(sys.stdout, event="save_cost", **times)
    return 0


# --- the orchestrator ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    daemons: bool
    rate: str | None = None

    @property
    def flags(self) -> str:
        if not self.daemons:
            return "no daemons"
        return f"--max-transfer-rate {self.rate}" if self.rate else "daemons, no rate limit"


@dataclass
class RunResult:
    config: Config
    steps: list[dict[str, Any]] = field(default_factory=list)
    replicated: dict[int, float] = field(default_factory=dict)
    """Seconds from the trainer's save to both ranks' items in their peer's store."""
    backed_up: dict[int, float] = field(default_factory=dict)
    """Seconds from the trainer's save to the step's COMMIT in the backup."""
    saved_at: dict[int, float] = field(default_factory=dict)


class Child:
    """A child process speaking JSON lines on stdout; a reader thread queues its events."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def next(self, timeout: float) -> dict[str, Any]:
        event = self.events.get(timeout=timeout)
        if event is None:
            raise RuntimeError(f"{self.proc.args!r} exited with {self.proc.wait()}")
        return event

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Daemon:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while b"daemon started:" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                text = self.log.read_text(errors="replace")
                raise RuntimeError(f"daemon did not start:\n{text}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Bench:
    def __init__(self, a: argparse.Namespace, base: Path, logs: Path) -> None:
        self.a, self.base, self.logs = a, base, logs
        self.tls: list[list[str]] = [[], []]
        if a.tls:
            from mtc_replicator.tools import certs

            ca = certs.new_ca()
            for rank in (0, 1):
                directory = logs / "tls" / f"node{rank}"
                certs.write_node_files(directory, ca, certs.issue(ca, node=f"node{rank}"))
                files = certs.node_files(directory)
                self.tls[rank] = [
                    *("--tls-cert", str(files.cert), "--tls-key", str(files.key)),
                    *("--tls-ca", str(files.ca)),
                ]
        self.runs = 0

    def child_args(self, role: str, directory: Path, job: str, daemons: bool) -> list[str]:
        a = self.a
        cpus = a.trainer_cpus if role == "_trainer" else ""
        return [
            sys.executable,
            str(Path(__file__).resolve()),
            role,
            *("--dir", str(directory), "--job", job, "--size-mib", str(a.size_mib)),
            *("--steps", str(a.steps), "--save-every", str(a.save_every)),
            *("--matmul", str(a.matmul), "--matmuls", str(a.matmuls)),
            *("--copy-mib", str(a.copy_mib), "--copies", str(a.copies), "--cpus", cpus),
            *(["--daemons"] if daemons else []),
        ]

    def run(self, config: Config) -> RunResult:
        self.runs += 1
        job = f"interference-{uuid.uuid4().hex[:6]}"
        root = self.base / f"run{self.runs}"
        ckpts = [root / "node0", root / "node1"]
        backup = root / "backup"
        for d in (*ckpts, backup):
            d.mkdir(parents=True)
        env = {**os.environ, **SINGLE_THREAD, "PYTHONPATH": str(ROOT)}
        daemons: list[Daemon] = []
        children: list[Child] = []
        result = RunResult(config)
        stop = threading.Event()
        try:
            for rank, ckpt in enumerate(ckpts):
                if not config.daemons:
                    break
                args = [sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir"]
                args += [str(ckpt), "--listen", "127.0.0.1:0", "--backup", backup.as_uri()]
                args += self.tls[rank]
                if config.rate:
                    args += ["--max-transfer-rate", config.rate]
                log = self.logs / f"run{self.runs}-node{rank}.log"
                daemons.append(Daemon(args, log))
            for daemon in daemons:
                daemon.wait_ready()
            trainer, mirror = (
                Child(
                    self.child_args(role, ckpt, job, config.daemons),
                    self.logs / f"run{self.runs}-{role.strip('_')}.log",
                    env,
                )
                for role, ckpt in (("_trainer", ckpts[0]), ("_mirror", ckpts[1]))
            )
            children += [trainer, mirror]
            for child in children:
                if child.next(timeout=180)["event"] != "ready":
                    raise RuntimeError("a child did not get ready")
            watcher = threading.Thread(
                target=self.watch, args=(config, job, root, result, stop), daemon=True
            )
            watcher.start()
            while (event := trainer.next(timeout=600))["event"] != "done":
                result.steps.append(event)
                if event["save"] is not None:
                    result.saved_at[event["step"]] = event["at"]
                    mirror.send(f"{event['step']}\n")
            mirror.stop()
            if config.daemons and result.saved_at:
                last = max(result.saved_at)
                deadline = time.monotonic() + self.a.drain_seconds
                while time.monotonic() < deadline and not (
                    last in result.replicated and last in result.backed_up
                ):
                    time.sleep(0.1)
            stop.set()
            watcher.join()
        finally:
            stop.set()
            for child in children:
                child.stop()
            for daemon in daemons:
                daemon.stop()
            shutil.rmtree(root, ignore_errors=True)
            for ckpt in ckpts:
                shutil.rmtree(f"{ckpt}.mtc-store", ignore_errors=True)
        return result

    def watch(
        self,
        config: Config,
        job: str,
        root: Path,
        result: RunResult,
        stop: threading.Event,
    ) -> None:
        """Poll the stores and the backup for each saved step; without daemons, take every
        finished ``<N>/`` away instead."""
        ckpts, backup = [root / "node0", root / "node1"], root / "backup"
        stores = [Path(f"{c}.mtc-store") / "items" / job for c in ckpts]
        while not stop.wait(0.05):
            if not config.daemons:
                for ckpt in ckpts:
                    for entry in os.scandir(ckpt):
                        if entry.name.isdigit():
                            shutil.rmtree(entry.path, ignore_errors=True)
                continue
            now = time.monotonic()
            for step, saved in list(result.saved_at.items()):
                if step not in result.replicated and all(
                    (stores[1 - rank] / str(step) / f"{rank}-0" / "MANIFEST.json").is_file()
                    for rank in (0, 1)
                ):
                    result.replicated[step] = now - saved
                if step not in result.backed_up and (backup / job / str(step) / "COMMIT").is_file():
                    result.backed_up[step] = now - saved
            self.prune(backup / job)

    @staticmethod
    def prune(job_dir: Path) -> None:
        """Delete committed backups older than the newest committed one (COMMIT first, so a
        reader never finds a COMMIT without its items)."""
        if not job_dir.is_dir():
            return
        committed = sorted(
            int(p.name) for p in job_dir.iterdir() if p.name.isdigit() and (p / "COMMIT").exists()
        )
        for step in committed[:-1]:
            (job_dir / str(step) / "COMMIT").unlink(missing_ok=True)
            shutil.rmtree(job_dir / str(step), ignore_errors=True)

    def save_cost(self) -> dict[str, list[float]]:
        a = self.a
        directory = self.base / "save-cost"
        directory.mkdir()
        args = [sys.executable, str(Path(__file__).resolve()), "_save_cost"]
        args += ["--dir", str(directory), "--size-mib", str(a.size_mib)]
        args += ["--rounds", str(a.save_rounds), "--cpus", a.trainer_cpus]
        env = {**os.environ, **SINGLE_THREAD, "PYTHONPATH": str(ROOT)}
        child = Child(args, self.logs / "save-cost.log", env)
        try:
            event = child.next(timeout=600)
        finally:
            child.stop()
            shutil.rmtree(directory, ignore_errors=True)
        return {k: v for k, v in event.items() if k != "event"}


# --- statistics and the report ------------------------------------------------------------------


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def summarize(config: Config, runs: list[RunResult], warmup: int) -> dict[str, Any]:
    steps = [s for r in runs for s in r.steps if s["step"] > warmup]
    plain = [s["seconds"] for s in steps if s["save"] is None]
    saves = [s["seconds"] for s in steps if s["save"] is not None]
    everything = plain + saves
    out: dict[str, Any] = {"config": config.name, "flags": config.flags}
    for label, values in (("plain", plain), ("save", saves), ("all", everything)):
        out[label] = {
            "median": statistics.median(values) if values else None,
            "p95": p95(values) if values else None,
            "n": len(values),
        }
    out["plain_median_per_run"] = [
        statistics.median(s["seconds"] for s in r.steps if s["step"] > warmup and not s["save"])
        for r in runs
    ]
    saved = [(r, step) for r in runs for step in sorted(r.saved_at)]
    out["saved_steps"] = len(saved)
    for key in ("replicated", "backed_up"):
        seconds = [getattr(r, key)[step] for r, step in saved if step in getattr(r, key)]
        out[key] = {
            "count": len(seconds),
            "median": statistics.median(seconds) if seconds else None,
            "max": max(seconds) if seconds else None,
        }
    in_time = 0
    for r, step in saved:
        later = [s for s in r.saved_at if s > step]
        deadline = r.saved_at[min(later)] - r.saved_at[step] if later else float("inf")
        in_time += step in r.replicated and r.replicated[step] <= deadline
    out["replicated_before_next_save"] = in_time
    return out


def save_interval(runs: list[RunResult]) -> float:
    """Median seconds between two saves of the trainer."""
    gaps = []
    for r in runs:
        at = [r.saved_at[s] for s in sorted(r.saved_at)]
        gaps += [b - a for a, b in itertools.pairwise(at)]
    return statistics.median(gaps)


def auto_rates(size_mib: int, interval: float) -> list[str]:
    """2.5x and 0.5x what one daemon sends per save interval (its item to the peer and to
    the backup), in whole MiB/s."""
    need = 2 * size_mib / interval
    return [f"{max(1, round(need * 2.5))}MiB", f"{max(1, round(need * 0.5))}MiB"]


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: list[dict[str, Any]], a: argparse.Namespace) -> str:
    base = summaries[0]
    lines = [
        f"trainer: {a.size_mib} MiB state, a save every {a.save_every} steps, {a.steps} steps "
        f"per run ({a.warmup} warm-up dropped), {a.repeats} runs per configuration interleaved; "
        f"pinned: {'trainer on CPU ' + a.trainer_cpus if a.trainer_cpus else 'no'}",
        f"{'config':<7} {'flags':<34} {'plain med':>9} {'p95':>6} {'save med':>8} {'p95':>6} "
        f"{'all med':>7} {'p95':>6} {'vs a':>6} {'plain':>6} "
        f"{'replicated s med/max (in time)':>31} {'backed up s med/max':>20}",
    ]
    for s in summaries:
        ratio = s["all"]["median"] / base["all"]["median"]
        plain_ratio = s["plain"]["median"] / base["plain"]["median"]
        rep, bak = s["replicated"], s["backed_up"]
        replicated = (
            f"{fmt(rep['median'], 1)}/{fmt(rep['max'], 1)} "
            f"({s['replicated_before_next_save']}/{s['saved_steps']})"
        )
        backed = f"{fmt(bak['median'], 1)}/{fmt(bak['max'], 1)} ({bak['count']})"
        lines.append(
            f"{s['config']:<7} {s['flags']:<34} {fmt(s['plain']['median']):>9} "
            f"{fmt(s['plain']['p95']):>6} {fmt(s['save']['median']):>8} {fmt(s['save']['p95']):>6} "
            f"{fmt(s['all']['median']):>7} {fmt(s['all']['p95']):>6} "
            f"{fmt(ratio):>6} {fmt(plain_ratio):>6} "
            f"{replicated if s['config'] != 'a' else '-':>31} "
            f"{backed if s['config'] != 'a' else '-':>20}"
        )
    lines.append(
        "plain/save/all: the trainer's step seconds without a save, with one, both; vs a: the "
        "median step against a's (all steps, then plain steps); replicated/backed up: seconds "
        "from the save returning (in time: replicated before the next save, of the saved steps)"
    )
    return "\n".join(lines)


def enforced(summary: dict[str, Any], rate: str | None, size_mib: int) -> bool:
    """Whether the daemons kept to ``rate``: replicating a step (each daemon's item to its
    peer, at the rate at most) cannot take less than size / rate."""
    from mtc_replicator.core.pacing import parse_rate

    fastest = summary["replicated"]["median"]
    limit = parse_rate(rate) if rate else None
    return limit is None or fastest is None or fastest >= 0.9 * size_mib * MIB / limit


def verdict(summaries: list[dict[str, Any]], configs: list[Config], size_mib: int) -> str:
    base = summaries[0]["all"]["median"]
    lines = [
        f"NOTE {c.name}: replicated faster than {c.rate} allows: the daemons did not apply the "
        "limit, so this row measures no limit"
        for c, s in zip(configs, summaries, strict=True)
        if c.rate and not enforced(s, c.rate, size_mib)
    ]
    good = [
        s
        for c, s in zip(configs, summaries, strict=True)
        if c.rate
        and enforced(s, c.rate, size_mib)
        and s["replicated_before_next_save"] == s["saved_steps"]
    ]
    if not good:
        lines.append("target: no enforced rate limit replicated every step in time; not judged")
        return "\n".join(lines)
    best = min(good, key=lambda s: s["all"]["median"])
    ratio = best["all"]["median"] / base
    held = "holds" if ratio <= 1.03 else "missed"
    lines.append(
        f"target (median step within 3% of a, at a rate that replicates every step in time): "
        f"{held}: {best['flags']}: {100 * (ratio - 1):+.1f}%"
    )
    return "\n".join(lines)


# --- main ---------------------------------------------------------------------------------------


def child_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("role")
    p.add_argument("--dir", required=True)
    p.add_argument("--job", default="")
    p.add_argument("--size-mib", type=int, required=True)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--matmul", type=int, default=0)
    p.add_argument("--matmuls", type=int, default=0)
    p.add_argument("--copy-mib", type=int, default=0)
    p.add_argument("--copies", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--cpus", default="")
    p.add_argument("--daemons", action="store_true")
    return p


def main_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=1024, help="checkpoint size per rank")
    p.add_argument("--steps", type=int, default=63, help="trainer steps per run")
    p.add_argument("--save-every", type=int, default=20, help="steps between saves (K)")
    p.add_argument("--warmup", type=int, default=3, help="first steps of a run not counted")
    p.add_argument("--repeats", type=int, default=2, help="runs per configuration")
    p.add_argument(
        "--rates",
        default="auto",
        help="comma-separated --max-transfer-rate values for the c runs, or auto (see above)",
    )
    p.add_argument("--matmul", type=int, default=512, help="matrix side of a step's multiplies")
    p.add_argument("--matmuls", type=int, default=64, help="multiplies per step")
    p.add_argument("--copy-mib", type=int, default=128, help="array size of a step's copies")
    p.add_argument("--copies", type=int, default=24, help="copies per step")
    p.add_argument("--save-rounds", type=int, default=5, help="saves of each kind for the cost")
    p.add_argument("--drain-seconds", type=float, default=60.0, help="wait for the last step")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="no CPU pinning")
    p.add_argument("--no-tls", dest="tls", action="store_false", help="plaintext daemons")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    return p


@contextlib.contextmanager
def workspace() -> Iterator[tuple[Path, Path]]:
    shm = SHM if SHM.is_dir() else None
    with (
        tempfile.TemporaryDirectory(prefix="mtc-bench-interference-", dir=shm) as base,
        tempfile.TemporaryDirectory(prefix="mtc-bench-interference-logs-") as logs,
    ):
        yield Path(base), Path(logs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        a = child_parser().parse_args(argv)
        roles = {"_trainer": run_trainer, "_mirror": run_mirror, "_save_cost": run_save_cost}
        return roles[a.role](a)
    a = main_parser().parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    a.trainer_cpus = ""
    if a.pin and len(cpus) >= 2:
        a.trainer_cpus = str(cpus[0])
        pin(",".join(str(c) for c in cpus[1:]))  # the daemons and the mirror inherit it
    with workspace() as (base, logs):
        bench = Bench(a, base, logs)
        cost = bench.save_cost()
        print(f"client save cost measured ({a.save_rounds} rounds each)", file=sys.stderr)
        configs = [Config("a", False), Config("b", True)]
        rates = None if a.rates == "auto" else a.rates.split(",")
        if rates is not None:
            configs += [Config(f"c{i + 1}", True, r) for i, r in enumerate(rates)]
        results: dict[str, list[RunResult]] = {}
        for repeat in range(a.repeats):
            index = 0
            while index < len(configs):  # the auto rates join after the first run of a
                config = configs[index]
                index += 1
                t0 = time.monotonic()
                results.setdefault(config.name, []).append(bench.run(config))
                print(
                    f"run {repeat + 1}/{a.repeats} {config.name} ({config.flags}): "
                    f"{time.monotonic() - t0:.0f}s",
                    file=sys.stderr,
                    flush=True,
                )
                if rates is None and config.name == "a":
                    rates = auto_rates(a.size_mib, save_interval(results["a"]))
                    configs += [Config(f"c{i + 1}", True, r) for i, r in enumerate(rates)]
    summaries = [summarize(c, results[c.name], a.warmup) for c in configs]
    cost_median = {k: statistics.median(v) for k, v in cost.items()}
    ratio = cost_median["client"] / cost_median["torch.save"]
    if a.json:
        verdicts = verdict(summaries, configs, a.size_mib).splitlines()
        report = {"configs": summaries, "verdict": verdicts}
        print(json.dumps({**report, "save_cost": cost, "client_vs_torch": ratio}))
        return 0
    print(table(summaries, a))
    print(verdict(summaries, configs, a.size_mib))
    print(
        f"client save cost, {a.size_mib} MiB state dict on tmpfs, median of {a.save_rounds}: "
        f"mtc_replicator.client.torch_io.save_state_dict {cost_median['client']:.3f}s, "
        f"torch.save {cost_median['torch.save']:.3f}s: {ratio:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
