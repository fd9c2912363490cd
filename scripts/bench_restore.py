"""Measure restores as a training job sees them, handshake to the last marker, in one run.

Real daemons on tmpfs (``/dev/shm``), mutual TLS (a throwaway CA made for the run), one
shared ``file://`` registry or backup; this process plays the training job. Three cases,
each against a baseline of the same bytes measured in the same run:

- peer: a 2-node job, ``--size-mib`` per rank; node 1 loses its RAM disk (daemon killed,
  directory and store emptied, daemon restarted), both ranks write ``replicator.yaml``
  and the clock stops at the last rank's marker (node 1 pulls from node 0, node 0 verifies
  its own copy). Baseline: a raw-socket copy of one rank's item between two processes
  (``sendfile`` out, ``recv_into`` + ``write`` in: ``scripts/bench_peer.py``'s), rounds
  interleaved; target >= 0.8x on medians;
- local: the same job restarts with nothing lost (each rank verifies its own copy);
  target < 0.2 s;
- backup: a 4-node job, ``--size-mib`` in all, every RAM disk wiped, restored from a
  ``file://`` backup on disk; baseline: ``cp -r`` of the backup's step to tmpfs.

After the table, each case's CPU seconds, both ends added (the daemons from the handshake
to the markers, the raw copy's two processes from their connection on), and the least
wall time that CPU needs on this machine's cores: a case that must do more than its
baseline on cores the baseline already fills cannot match it (docs/performance.md,
"Against the raw copy's CPU"). ``--node-cores N`` plays two nodes with cores of their own
on one machine (``taskset``: node 0's daemon and the raw copy's sender on N cores, node 1's
and the raw receiver on N others), where by default every process shares every core: on
this 2-core box N=1, on a machine of 16 cores up to 8. Then each case's timeline (seconds
after the handshake until the yaml was accepted, the plan made, each rank's item ready, each
round done), read from the daemons' INFO log lines.

    .venv/bin/python scripts/bench_restore.py --size-mib 1024 [--rounds 7] [--json]
    .venv/bin/python scripts/bench_restore.py --data-streams 2   # the daemons' --data-streams
    .venv/bin/python scripts/bench_restore.py --no-tls --backup-rounds 0   # plaintext only
    .venv/bin/python scripts/bench_restore.py --node-cores 8 --backup-rounds 0   # 16 cores

Numbers are only comparable within one run: this machine's two cores are shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.tools import certs  # noqa: E402
from scripts.bench_peer import raw_copy, taskset, warm_pages  # noqa: E402
from tests.daemon_process import DaemonProcess  # noqa: E402
from tests.integration.helpers import (  # noqa: E402
    config_text,
    read_prerestore,
    store_root,
    write_big_step_tmp,
    write_yaml_atomic,
)
from tests.proc import cpu_seconds as proc_cpu  # noqa: E402
from tests.tls import node_tls  # noqa: E402

_PHASES = (
    ("accepted replicator.yaml", "n{r} yaml accepted"),
    ("ranks in ", "n{r} (coordinator) plan made"),
    ("ready from", "n{r} item ready"),
    ("restore round done", "n{r} round done"),
)
_PULLED = re.compile(r"pulled \S+ from \S+: \d+ bytes in ([0-9.]+)s")


def _stamp(line: str) -> float | None:
    """The wall-clock time of a daemon log line (``2026-11-23T06:08:01.879Z INFO ...``)."""
    try:
        return datetime.datetime.fromisoformat(line[:24]).timestamp()
    except ValueError:
        return None


SHM = Path("/dev/shm")  # noqa: S108 (tmpfs, where a RAM disk lives)
FILES = 8
STEP = 5
PEER_TARGET = 0.8
PEER_TLS_TARGET = 0.9
"""Issue 38: a restore over mutual TLS against a raw copy over the same TLS."""
LOCAL_TARGET = 0.2


class Job:
    """One daemon per node on its own CHECKPOINT_DIR; the job's handshakes and markers."""

    def __init__(
        self,
        root: Path,
        nodes: int,
        *,
        backup: Path | None = None,
        log_level: str = "info",
        tls: bool = True,
        extra: tuple[str, ...] = (),
        pins: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        self.root, self.nodes, self.log_level = root, nodes, log_level
        self.extra = extra
        """More daemon flags."""
        self.pins = pins
        """Each node's cores (``taskset``), or () for all of the machine's."""
        self.name = f"bench-{uuid.uuid4().hex[:6]}"
        self.dirs = [root / f"node{r}" for r in range(nodes)]
        for d in self.dirs:
            d.mkdir(parents=True)
        ca = certs.new_ca()
        self.tls = [node_tls(root / "tls" / f"node{r}", ca, node=f"node{r}") for r in range(nodes)]
        self.use_tls = tls
        self.backup = backup
        if backup is None:
            (root / "registry").mkdir()
        self.keys: dict[str, object] = {"peers_per_node": 1, "backup_interval_steps": 1000}
        self.daemons: list[DaemonProcess | None] = [None] * nodes

    def start(self, rank: int) -> None:
        where = ("--registry", (self.root / "registry").as_uri()) if self.backup is None else ()
        daemon = DaemonProcess(
            self.dirs[rank],
            backup=self.backup.as_uri() if self.backup is not None else None,
            extra_args=(
                *where,
                *(self.tls[rank].args() if self.use_tls else ()),
                "--log-level",
                self.log_level,
                *self.extra,
            ),
            log_path=self.root / f"node{rank}.log",
            prefix=taskset(self.pins[rank]) if self.pins else (),
        )
        self.daemons[rank] = daemon.start()

    def stop_all(self) -> None:
        for d in self.daemons:
            if d is not None and d.running:
                d.stop()

    def clear(self, rank: int) -> None:
        """The node's RAM disk and the store beside it are gone (daemon down)."""
        shutil.rmtree(self.dirs[rank])
        shutil.rmtree(store_root(self.dirs[rank]), ignore_errors=True)
        self.dirs[rank].mkdir()

    def wipe(self, rank: int) -> None:
        d = self.daemons[rank]
        assert d is not None
        d.kill()
        self.clear(rank)
        self.start(rank)

    def cpu(self) -> float:
        """CPU seconds of every node's daemon so far, added."""
        return sum(proc_cpu(d.pid) for d in self.daemons if d is not None)

    def markers(self, rank: int) -> list[Path]:
        return [p for p in self.dirs[rank].iterdir() if p.name.endswith(".restore")]

    def restore(self, step: int) -> float:
        """Every rank's handshake at once; seconds until the last rank's marker of ``step``."""
        for r in range(self.nodes):
            for marker in self.markers(r):
                marker.unlink()  # the last incarnation's, consumed by its client
        self.handshake_at = time.time()
        t0 = time.perf_counter()
        for r in range(self.nodes):
            text = config_text(self.name, rank=r, nodes=self.nodes, **self.keys)
            write_yaml_atomic(self.dirs[r], text)
        want = [f"{self.name}-s{step}-n{r}-w0.restore" for r in range(self.nodes)]
        deadline = time.monotonic() + 120
        waiting = set(range(self.nodes))
        while waiting:
            waiting = {r for r in waiting if not os.path.lexists(self.dirs[r] / want[r])}
            if time.monotonic() > deadline:
                raise RuntimeError(f"no marker on ranks {sorted(waiting)}; see {self.root}")
            time.sleep(0.002)
        return time.perf_counter() - t0

    def timeline(self) -> dict[str, float]:
        """Seconds from the last handshake to each phase's end, from the daemons' INFO log
        lines (millisecond stamps): when the yaml was accepted, the plan made, each rank's
        item ready (pulled: the pull's own seconds too) and each rank's round done."""
        marks: dict[str, float] = {}
        for r in range(self.nodes):
            for line in (self.root / f"node{r}.log").read_text(errors="replace").splitlines():
                stamp = _stamp(line)
                if stamp is None or stamp < self.handshake_at - 0.002:
                    continue
                at = max(0.0, stamp - self.handshake_at)
                for needle, phase in _PHASES:
                    if needle in line:
                        marks.setdefault(phase.format(r=r), at)
                if (pulled := _PULLED.search(line)) is not None:
                    marks.setdefault(f"n{r} pull itself (s)", float(pulled[1]))
        return marks

    def source(self, rank: int) -> str:
        return str(read_prerestore(self.dirs[rank])["restore-source"])

    def save(self, step: int, mib_per_rank: int) -> None:
        """Every rank publishes ``step`` (``FILES`` shards) and it is committed where the
        job's layout puts it: at home, at the peer, and in the backup when there is one."""
        for r in range(self.nodes):
            tmp, _ = write_big_step_tmp(self.dirs[r], step, FILES, mib_per_rank // FILES)
            os.rename(tmp, self.dirs[r] / str(step))
        self.wait(lambda: all(self.copies(r, step) >= 2 for r in range(self.nodes)), "replicas")
        if self.backup is not None:
            self.wait((self.backup_step(step) / "COMMIT").is_file, "backup")

    def backup_step(self, step: int) -> Path:
        assert self.backup is not None
        return self.backup / self.name / str(step)

    def copies(self, rank: int, step: int) -> int:
        """Committed copies of ``rank``'s item of ``step`` in every node's store."""
        return sum(
            (
                store_root(d) / "items" / self.name / str(step) / f"{rank}-0" / "MANIFEST.json"
            ).is_file()
            for d in self.dirs
        )

    def item_data(self, rank: int, step: int) -> Path:
        return store_root(self.dirs[rank]) / "items" / self.name / str(step) / f"{rank}-0" / "data"

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; see {self.root}")
            time.sleep(0.05)


def first_start(job: Job) -> None:
    """The job's first incarnation: every rank starts from scratch (step 0, no data)."""
    job.restore(0)
    for r in range(job.nodes):
        for marker in job.markers(r):
            marker.unlink()


def bench_peer_and_local(
    root: Path,
    size_mib: int,
    rounds: int,
    log_level: str,
    *,
    tls: bool = True,
    extra: tuple[str, ...] = (),
    pins: tuple[tuple[int, ...], ...] = (),
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]], dict[str, list[float]]]:
    """The peer and local cases, interleaved with the raw copies they are compared with;
    their seconds, the restores' timelines and each case's CPU seconds by round.

    With ``tls`` (the daemons' mutual TLS): the plaintext raw copy, the same copy over the
    data channel's TLS (``TlsStream``, the daemons' certificates), the peer restore and the
    local restore. Without: the plaintext raw copy and the peer restore, keyed ``*_plain``.
    With ``pins``, node 0's daemon and the raw copy's sender run on ``pins[0]``, node 1's
    daemon and the raw receiver on ``pins[1]``.
    """
    sfx = "" if tls else "_plain"
    job = Job(root / f"peer{sfx}", 2, log_level=log_level, tls=tls, extra=extra, pins=pins)
    keys = ["raw", "raw_tls", "peer", "local"] if tls else ["raw", "peer"]
    out: dict[str, list[float]] = {f"{k}{sfx}": [] for k in keys}
    phases: dict[str, list[dict[str, float]]] = {f"peer{sfx}": [], **({"local": []} if tls else {})}
    cpu: dict[str, list[float]] = {f"{k}{sfx}": [] for k in keys}
    """CPU seconds of both ends of each case, by round (the two daemons from the handshake
    to the markers; the raw copy's two processes from the connection to its end)."""
    try:
        for r in range(job.nodes):
            job.start(r)
        first_start(job)
        job.save(STEP, size_mib)
        size = size_mib << 20
        raw_src = job.item_data(0, STEP)

        def raw(tls_dir: Path | None = None) -> float:
            dest = root / "raw"
            copied = raw_copy(
                raw_src, dest, tls_dir, warm=size, pins=(pins[0], pins[1]) if pins else None
            )
            cpu[f"raw{'_tls' if tls_dir else ''}{sfx}"].append(copied["cpu"] + copied["sender_cpu"])
            shutil.rmtree(dest)
            return copied["seconds"]

        def peer() -> float:
            job.wipe(1)
            warm_pages(root, size)
            cpu0 = job.cpu()
            seconds = job.restore(STEP)
            cpu[f"peer{sfx}"].append(job.cpu() - cpu0)
            phases[f"peer{sfx}"].append(job.timeline())
            if job.source(1) != "peer":
                raise RuntimeError(f"rank 1 restored from {job.source(1)}, not its peer")
            return seconds

        def local() -> float:
            cpu0 = job.cpu()
            seconds = job.restore(STEP)
            cpu["local"].append(job.cpu() - cpu0)
            phases["local"].append(job.timeline())
            if {job.source(r) for r in range(job.nodes)} != {"local"}:
                raise RuntimeError("a rank did not restore its local copy")
            return seconds

        cases: dict[str, Callable[[], float]] = {"raw": raw, "peer": peer}
        if tls:
            cases |= {"raw_tls": lambda: raw(job.tls[1].root), "local": local}
        for i in range(rounds):
            # Alternate the order: whoever goes first may meet colder tmpfs pages.
            order = keys if i % 2 == 0 else keys[::-1]
            for key in order:
                out[f"{key}{sfx}"].append(cases[key]())
            print(
                f"round {i + 1}:" + "".join(f"  {k} {v[-1]:.3f}s" for k, v in out.items()),
                flush=True,
            )
    finally:
        job.stop_all()
    return out, phases, cpu


def bench_backup(
    root: Path, disk: Path, size_mib: int, rounds: int, log_level: str
) -> dict[str, list[float]]:
    """A 4-node job, ``size_mib`` in all, every RAM disk wiped, restored from ``file://``."""
    job = Job(root / "backup", 4, backup=disk / "backup", log_level=log_level)
    job.keys["backup_interval_steps"] = 1
    out: dict[str, list[float]] = {"cp": [], "backup": []}
    try:
        for r in range(job.nodes):
            job.start(r)
        first_start(job)
        job.save(STEP, size_mib // job.nodes)
        for i in range(rounds):

            def cp() -> None:
                dest = root / "cp"
                t0 = time.perf_counter()
                subprocess.run(["cp", "-r", str(job.backup_step(STEP)), str(dest)], check=True)
                out["cp"].append(time.perf_counter() - t0)
                shutil.rmtree(dest)

            def restore() -> None:
                job.stop_all()
                for r in range(job.nodes):
                    job.clear(r)
                for r in range(job.nodes):
                    job.start(r)
                out["backup"].append(job.restore(STEP))
                if {job.source(r) for r in range(job.nodes)} != {"backup"}:
                    raise RuntimeError("a rank did not restore from the backup")

            for case in (cp, restore) if i % 2 == 0 else (restore, cp):
                case()
            print(
                f"round {i + 1}: cp {out['cp'][-1]:.3f}s  4-node restore from file:// "
                f"{out['backup'][-1]:.3f}s",
                flush=True,
            )
    finally:
        job.stop_all()
    return out


def median_timeline(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the rounds, in the order of the last round."""
    names = sorted({k for run in runs for k in run}, key=lambda k: runs[-1].get(k, 99.0))
    return {k: statistics.median(run[k] for run in runs if k in run) for k in names}


def report(
    size_mib: int,
    peer: dict[str, list[float]],
    backup: dict[str, list[float]],
    phases: dict[str, list[dict[str, float]]],
    cpu: dict[str, list[float]],
    *,
    node_cores: int | None = None,
) -> dict[str, object]:
    med = {k: statistics.median(v) for k, v in (peer | backup).items() if v}
    best = {k: min(v) for k, v in (peer | backup).items() if v}
    rows = [
        ("raw socket copy of one rank's item (baseline)", "raw", "raw", ""),
        ("the same copy over TLS (TlsStream; baseline)", "raw_tls", "raw_tls", ""),
        ("restore from a peer, TLS, node 1 wiped", "peer", "raw", f">= {PEER_TARGET}x"),
        ("  the same against the TLS copy", "peer", "raw_tls", f">= {PEER_TLS_TARGET}x"),
        ("raw socket copy (baseline, plaintext run)", "raw_plain", "raw_plain", ""),
        ("restore from a peer, plaintext", "peer_plain", "raw_plain", f">= {PEER_TARGET}x"),
        ("restore from local copies, 2 nodes, nothing lost", "local", "", f"< {LOCAL_TARGET}s"),
        ("cp -r of the backup's step to tmpfs (baseline)", "cp", "cp", ""),
        ("restore from file://, 4 nodes, every RAM disk wiped", "backup", "cp", "reported"),
    ]
    print(f"\n{size_mib} MiB per rank (peer, local), {size_mib} MiB in all (backup), tmpfs")
    if node_cores is not None:
        print(
            f"peer and local cases: each node's daemon on {node_cores} core(s) of its own, the"
            " raw copy's sender on node 0's and its receiver on node 1's (the backup case"
            " unpinned)"
        )
    print(
        "handshake to the last rank's marker; median (best) of the interleaved rounds, and the"
        " ratio of medians (of bests): a round that met pages the host had taken back is slow"
        ' (docs/performance.md, "Fresh memory on this VM"), so medians swing where bests do not'
    )
    print(f"{'case':52} {'seconds':>16} {'vs baseline':>19}  target")
    for name, key, base, target in rows:
        if key not in med or (base and base not in med):
            continue  # --backup-rounds 0, --no-plaintext, --no-tls
        ratio = f"{med[base] / med[key]:.2f}x ({best[base] / best[key]:.2f}x)" if base else "-"
        print(f"{name:52} {med[key]:7.3f} ({best[key]:6.3f}) {ratio:>19}  {target}")
    tls = "peer" in med
    ratios = {
        "peer_vs_raw": med["raw"] / med["peer"] if tls else None,
        "peer_vs_raw_tls": med["raw_tls"] / med["peer"] if tls else None,
        "peer_plain_vs_raw_plain": (
            med["raw_plain"] / med["peer_plain"] if "peer_plain" in med else None
        ),
        "backup_vs_cp": med["cp"] / med["backup"] if "backup" in med else None,
    }
    # Verdicts on bests: the baselines' slow rounds are the host's (fresh memory), not the
    # copy's, and they swing the medians of a baseline far more than of a restore.
    holds: dict[str, bool] = {}
    if tls:
        holds["peer (TLS) >= 0.8x raw (plaintext), bests"] = (
            best["raw"] / best["peer"] >= PEER_TARGET
        )
        holds[f"peer (TLS) >= {PEER_TLS_TARGET}x raw over TLS, bests"] = (
            best["raw_tls"] / best["peer"] >= PEER_TLS_TARGET
        )
        holds["local < 0.2 s, median"] = med["local"] < LOCAL_TARGET
    if "peer_plain" in best:
        holds["peer (plaintext) >= 0.8x raw (plaintext), bests"] = (
            best["raw_plain"] / best["peer_plain"] >= PEER_TARGET
        )
    for what, ok in holds.items():
        print(f"target {what}: {'holds' if ok else 'MISSED'}")
    cpu_med = {k: statistics.median(v) for k, v in cpu.items() if v}
    cores = 2 * node_cores if node_cores is not None else os.cpu_count() or 1
    print(
        f"\nCPU seconds of both ends (median) and the least seconds they need on the {cores}"
        " cores they run on: what a case must do beside its baseline shows here"
    )
    for key, spent in cpu_med.items():
        print(
            f"  {key:12} {spent:6.2f} CPU s over {med[key]:6.3f} s ({spent / med[key]:.2f} cores"
            f" busy); at least {spent / cores:.3f} s"
        )
    timelines = {case: median_timeline(runs) for case, runs in phases.items()}
    for case, timeline in timelines.items():
        print(f"\nrestore {case}: seconds after the handshake (median; from the daemons' logs)")
        for phase, at in timeline.items():
            print(f"  {phase:40} {at:6.3f}")
    return {
        "size_mib": size_mib,
        "node_cores": node_cores,
        "rounds": {k: v for k, v in (peer | backup).items()},
        "median": med,
        "best": best,
        "cpu_seconds": cpu,
        **ratios,
        "targets": holds,
        "timelines": timelines,
    }


def node_pins(n: int) -> tuple[tuple[int, ...], ...]:
    """Two nodes' cores, ``n`` each and none shared, from those this process may use; ()
    when there are fewer than ``2n`` (or ``n`` < 1)."""
    cores = sorted(os.sched_getaffinity(0))
    if n < 1 or len(cores) < 2 * n:
        return ()
    return (tuple(cores[:n]), tuple(cores[n : 2 * n]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backup-rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="also print the results as one object")
    p.add_argument(
        "--log-level", default="info", help="the daemons' (debug logs every phase, slower)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run's directories (and logs)")
    p.add_argument(
        "--data-streams",
        default=None,
        help="the daemons' --data-streams (default: theirs, auto) in the peer and local cases",
    )
    p.add_argument(
        "--no-plaintext",
        dest="plaintext",
        action="store_false",
        help="skip the plaintext run (daemons without TLS against the same raw copy)",
    )
    p.add_argument(
        "--no-tls",
        dest="tls",
        action="store_false",
        help="skip the TLS run (its raw copies, peer and local restores)",
    )
    p.add_argument(
        "--node-cores",
        type=int,
        default=None,
        metavar="N",
        help="play nodes with cores of their own: node 0's daemon and the raw copy's sender on"
        " N cores, node 1's daemon and the raw receiver on N others (needs 2N cores; default:"
        " every process on every core)",
    )
    a = p.parse_args()
    pins = node_pins(a.node_cores) if a.node_cores is not None else ()
    if a.node_cores is not None and not pins:
        p.error(
            f"--node-cores {a.node_cores} needs {2 * a.node_cores} cores; this process has"
            f" {len(os.sched_getaffinity(0))}"
        )
    root = Path(tempfile.mkdtemp(prefix="mtc-bench-restore-", dir=SHM))
    disk = Path(tempfile.mkdtemp(prefix="mtc-bench-restore-"))
    try:
        extra = () if a.data_streams is None else ("--data-streams", a.data_streams)
        peer: dict[str, list[float]] = {}
        phases: dict[str, list[dict[str, float]]] = {}
        cpu: dict[str, list[float]] = {}
        if a.tls:
            peer, phases, cpu = bench_peer_and_local(
                root, a.size_mib, a.rounds, a.log_level, extra=extra, pins=pins
            )
        if a.plaintext:
            plain, plain_phases, plain_cpu = bench_peer_and_local(
                root, a.size_mib, a.rounds, a.log_level, tls=False, extra=extra, pins=pins
            )
            peer |= plain
            phases |= plain_phases
            cpu |= plain_cpu
        backup = (
            bench_backup(root, disk, a.size_mib, a.backup_rounds, a.log_level)
            if a.backup_rounds
            else {}
        )
        result = report(a.size_mib, peer, backup, phases, cpu, node_cores=a.node_cores)
        if a.json:
            print(json.dumps(result))
    finally:
        if a.keep:
            print(f"kept {root} and {disk}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)


if __name__ == "__main__":
    main()
