"""How one node's replication throughput scales with the cores its daemon may run on.

Real daemons (mutual TLS, the data channel, RAM disks on tmpfs ``/dev/shm``), each pinned
with ``taskset`` before it starts (every thread it makes inherits the set) to 1 core, then
2 (``--cores 1,2,8,16``: each count the machine has), in rounds interleaved (1, 2, 1, 2,
...) so the box's noise falls on every count alike. Three scenarios, each reported apart:

- ``local``, the local cycle: a one-node job with a ``file://`` backup of every step
  (ingest with both digests, then the upload), timed from the step's rename to its
  COMMIT. The daemon is the only busy process: one node's scaling, on any box.
- ``ingest``: the same job without a backup, from the rename to ``ingested``.
- ``pair``: the two daemons of a two-node job (``peers-per-node: 1``, no backup), both
  saving at once, each pushing its step to the other (and receiving the other's), from
  the renames to both pushes. Where the machine has 2N cores each daemon gets N of its
  own; with fewer, both share the same N: on a 2-core box that is two processes on the
  same cores, which does not isolate one node's scaling (read it where each node has its
  cores).

Each run is a fresh daemon (or pair): ``--warmup`` saves unmeasured, then ``--saves``
measured, of ``--step-mib`` in ``--files`` files; the bucket is pruned to its newest
committed step as it goes (docs/performance.md, "Fresh memory on this VM"). A save's wall
clock runs from the rename (this process's clock) to its end as the daemons' log lines
stamp it (milliseconds). Per scenario and count of cores, over the rounds: GiB of a node's
checkpoint per wall second (median and range), CPU seconds per GiB, the cores the daemon
kept busy while saving (its CPU over the saves' wall seconds) and its busiest thread's
share of them (near 1.0: one thread is what the step waits for), the cores the rest of the
machine kept busy meanwhile (``/proc/stat``: the box's noise, near 0 in a clean run), and
the figure: N cores' throughput over 1 core's. ``--before PATH``: another checkout's
daemons (the code before a change) run beside this one's in every round, and each row says
whose.

    .venv/bin/python scripts/bench_cores.py                      # 1 and 2 cores: ~6 min
    .venv/bin/python scripts/bench_cores.py --cores 1,2,8,16 --json
    .venv/bin/python scripts/bench_cores.py --scenarios local --before ../old-checkout
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.tools import certs  # noqa: E402
from scripts.bench_peer import taskset  # noqa: E402
from scripts.bench_restore import _stamp  # noqa: E402
from scripts.bench_scale import Node  # noqa: E402
from scripts.footprint_stages import (  # noqa: E402
    SETTLE,
    Stages,
    prune_backups,
    publish,
    wait_logged,
    write_step,
)
from tests.proc import system_busy_seconds, thread_cpu_seconds  # noqa: E402

SCENARIOS = ("local", "ingest", "pair")
DAEMONS = {"local": 1, "ingest": 1, "pair": 2}
WHAT = {
    "local": "ingest + file:// upload, one daemon",
    "ingest": "ingest with both digests, one daemon",
    "pair": "two daemons saving at once, each pushing to the other",
}


def parse_cores(text: str) -> list[int]:
    """``--cores``: counts of cores, 1 among them (the ratios are over its figure)."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--cores takes counts of cores separated by commas (e.g. 1,2,8), got {text!r}"
        ) from None
    if not counts or counts[0] < 1 or 1 not in counts:
        raise argparse.ArgumentTypeError(
            f"--cores must include 1 and only counts >= 1 (the ratios are over one core's "
            f"figure), got {text!r}"
        )
    return counts


def core_sets(
    count: int, daemons: int, available: list[int], *, own: bool
) -> tuple[tuple[int, ...], ...]:
    """The cores each of ``daemons`` daemons is pinned to: with ``own``, ``count`` of its
    own, else the same first ``count`` for all (they share them); () where the machine
    has too few."""
    cores = sorted(available)
    if len(cores) < (daemons * count if own else count):
        return ()
    if own:
        return tuple(tuple(cores[i * count : (i + 1) * count]) for i in range(daemons))
    return tuple(tuple(cores[:count]) for _ in range(daemons))


def own_cores(counts: list[int], daemons: int, available: list[int]) -> bool:
    """Whether each daemon gets cores of its own at every count measured: only then are
    the counts' figures alike (a pair on its own 1 core each beside a pair sharing 2 would
    say nothing of scaling)."""
    return len(available) >= daemons * max(counts)


def launch_argv(cores: tuple[int, ...], code: Path | None) -> tuple[str, ...]:
    """What a daemon runs under: ``taskset`` on ``cores`` and, for another checkout's
    daemon, ``env`` in it (``python -m`` imports from its working directory first, then
    ``PYTHONPATH``). Both exec in place: the pid is the daemon's."""
    pinned = taskset(cores)
    return pinned if code is None else (*pinned, "env", "-C", str(code), f"PYTHONPATH={code}")


def shared(pins: tuple[tuple[int, ...], ...]) -> bool:
    """Whether the daemons share their cores."""
    return len(pins) > 1 and len({core for pin in pins for core in pin}) < sum(map(len, pins))


@dataclass(frozen=True)
class Saved:
    """One save of every node at once, as the daemons spent it."""

    wall: float
    """Seconds from the first rename to the last node's end of it."""
    cpu: list[float]
    """Each daemon's CPU seconds from the rename to the end seen."""
    threads: list[dict[int, float]]
    """The same per thread still there at the end, by thread id (a thread that ended
    meanwhile is in ``cpu`` only)."""
    others: float
    """CPU seconds the rest of the machine spent meanwhile (this process's polling too)."""


@dataclass(frozen=True)
class Run:
    """One scenario at one count of cores, in one round."""

    saves: list[Saved]
    """The measured saves."""
    cpu: list[float]
    """Each daemon's CPU seconds over the measured saves and their trailing work."""
    gib: float
    """GiB of one node's checkpoint over the measured saves."""

    @property
    def walls(self) -> list[float]:
        return [s.wall for s in self.saves]

    @property
    def throughput(self) -> float:
        """GiB of a node's checkpoint per wall second."""
        return self.gib / sum(self.walls)

    @property
    def cpu_per_gib(self) -> float:
        """The median daemon's CPU seconds per GiB of its node's checkpoint."""
        return statistics.median(self.cpu) / self.gib

    @property
    def busy(self) -> float:
        """Cores the median daemon kept busy while saving: its CPU over the saves' wall."""
        per_daemon = [sum(s.cpu[d] for s in self.saves) for d in range(len(self.cpu))]
        return statistics.median(per_daemon) / sum(self.walls)

    @property
    def others_busy(self) -> float:
        """Cores the rest of the machine kept busy while saving: the box's noise (near 0:
        the daemons had the cores to themselves)."""
        return sum(s.others for s in self.saves) / sum(self.walls)

    @property
    def busiest_share(self) -> float:
        """The median daemon's busiest thread while saving: its CPU over the saves' wall
        (near 1.0: that thread is what the saves wait for)."""
        busiest = []
        for d in range(len(self.cpu)):
            per_thread: dict[int, float] = {}
            for saved in self.saves:
                for tid, seconds in saved.threads[d].items():
                    per_thread[tid] = per_thread.get(tid, 0.0) + seconds
            busiest.append(max(per_thread.values(), default=0.0))
        return statistics.median(busiest) / sum(self.walls)


def done_at(log: Path, pattern: str) -> float:
    """The log stamp of the first line matching ``pattern``."""
    found = re.compile(pattern)
    for line in log.read_text(errors="replace").splitlines():
        if found.search(line) and (stamp := _stamp(line)) is not None:
            return stamp
    raise LookupError(f"{pattern!r} not in {log}")


class Scenario:
    """A scenario's runs: where they go and what each save is."""

    def __init__(self, args: argparse.Namespace, root: Path, ram: Path, buckets: Path) -> None:
        self.args = args
        self.where = (root, ram, buckets)
        self.ca = certs.new_ca()

    def run(
        self, scenario: str, pins: tuple[tuple[int, ...], ...], name: str, code: Path | None
    ) -> Run:
        """Fresh daemons pinned to ``pins``, of the checkout ``code`` (None: this one);
        their warm-up and measured saves."""
        a = self.args
        launch = tuple(launch_argv(pin, code) for pin in pins)
        stages = Stages(*self.where, self.ca, a.step_mib, a.saves, a.warmup, launch)
        count = DAEMONS[scenario]
        job = f"{scenario}-{name}"
        with stages.running(name, count, job, backup=scenario == "local") as nodes:
            bucket = self.where[2] / name
            for i in range(a.warmup):
                self.save(scenario, nodes, job, (i + 1) * 10, bucket)
            time.sleep(SETTLE)
            cpu0 = [n.cpu_seconds() for n in nodes]
            saves = [
                self.save(scenario, nodes, job, (i + 1) * 10, bucket)
                for i in range(a.warmup, a.warmup + a.saves)
            ]
            time.sleep(SETTLE)
            cpu = [n.cpu_seconds() - c for n, c in zip(nodes, cpu0, strict=True)]
        return Run(saves, cpu, stages.gib)

    def save(self, scenario: str, nodes: list[Node], job: str, step: int, bucket: Path) -> Saved:
        """Every node saves ``step`` at once, its bytes written before the clock starts."""
        a = self.args
        tmps = [write_step(n.ckpt, step, a.step_mib << 20, a.files) for n in nodes]
        cpu0 = [n.cpu_seconds() for n in nodes]
        before = [_threads(n) for n in nodes]
        machine0 = system_busy_seconds()
        started = min(publish(tmp, step) for tmp in tmps)
        if scenario == "local":
            patterns = [rf"backup committed job={job} step={step} "]
        elif scenario == "ingest":
            patterns = [rf"ingested {job}/s{step}/n0-w0: "]
        else:
            patterns = [rf"pushed {job}/s{step}/n{n.rank}-w0 to " for n in nodes]
        for node, pattern in zip(nodes, patterns, strict=True):
            wait_logged([node.log], pattern, 1, f"{job}'s step {step} on rank {node.rank}")
        machine = system_busy_seconds() - machine0
        after = [_threads(n) for n in nodes]
        cpu = [n.cpu_seconds() - c for n, c in zip(nodes, cpu0, strict=True)]
        ended = max(done_at(n.log, p) for n, p in zip(nodes, patterns, strict=True))
        if scenario == "local":
            prune_backups(bucket, job)
        spent = [
            {tid: t - was.get(tid, 0.0) for tid, t in now.items()}
            for now, was in zip(after, before, strict=True)
        ]
        others = max(machine - sum(cpu), 0.0)
        return Saved(max(ended - started, 0.001), cpu, spent, others)


def _threads(node: Node) -> dict[int, float]:
    assert node.proc is not None
    return thread_cpu_seconds(node.proc.pid)


@dataclass(frozen=True)
class Row:
    """One scenario at one count of cores, over its rounds."""

    scenario: str
    cores: int
    pins: tuple[tuple[int, ...], ...]
    runs: list[Run]
    code: str = ""
    """``before`` or ``after`` with ``--before``: whose daemons."""

    def median(self, figure: str) -> float:
        return float(statistics.median(getattr(r, figure) for r in self.runs))

    def json(self, base: Row | None) -> dict[str, object]:
        out: dict[str, object] = {
            **({"code": self.code} if self.code else {}),
            "cores": self.cores,
            "pinned_to": [list(p) for p in self.pins],
            "shared_cores": shared(self.pins),
            "gib_per_second": round(self.median("throughput"), 3),
            "gib_per_second_range": [round(r.throughput, 3) for r in self.runs],
            "cpu_seconds_per_gib": round(self.median("cpu_per_gib"), 2),
            "cores_busy": round(self.median("busy"), 2),
            "busiest_thread": round(self.median("busiest_share"), 2),
            "others_busy": round(self.median("others_busy"), 2),
            "save_seconds": [[round(w, 3) for w in r.walls] for r in self.runs],
        }
        if base is not None:
            out["x_one_core"] = round(self.median("throughput") / base.median("throughput"), 2)
        return out


def table(rows: list[Row]) -> str:
    lines = [
        "| scenario | cores | GiB/s per node (median; rounds) | x 1 core | CPU s/GiB "
        "| cores busy | busiest thread | others busy |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        figures = row.json(_base(rows, row))
        spread = ", ".join(f"{r.throughput:.2f}" for r in row.runs)
        pins = "shared" if figures["shared_cores"] else "own"
        cores = f"{row.cores} ({pins})" if len(row.pins) > 1 else str(row.cores)
        name = f"{row.scenario} ({row.code})" if row.code else row.scenario
        lines.append(
            f"| {name} | {cores} | {figures['gib_per_second']:.2f} ({spread}) "
            f"| {figures.get('x_one_core', 1.0):.2f}x | {figures['cpu_seconds_per_gib']:.2f} "
            f"| {figures['cores_busy']:.2f} | {figures['busiest_thread']:.2f} "
            f"| {figures['others_busy']:.2f} |"
        )
    return "\n".join(lines)


def _base(rows: list[Row], row: Row) -> Row | None:
    """The row ``row``'s ratio is over: the same scenario and code on 1 core."""
    alike = (r for r in rows if (r.scenario, r.code, r.cores) == (row.scenario, row.code, 1))
    return next(alike, None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cores", type=parse_cores, default=[1, 2], help="counts of cores (default 1,2)"
    )
    parser.add_argument(
        "--scenarios",
        type=lambda text: [s.strip() for s in text.split(",") if s.strip()],
        default=list(SCENARIOS),
        help=f"which of {','.join(SCENARIOS)} (default: all)",
    )
    parser.add_argument("--step-mib", type=int, default=512, help="each node's step (MiB)")
    parser.add_argument("--files", type=int, default=8, help="files per step (default 8)")
    parser.add_argument("--saves", type=int, default=3, help="saves measured per run")
    parser.add_argument("--warmup", type=int, default=2, help="saves first, not measured")
    parser.add_argument("--rounds", type=int, default=3, help="runs per scenario and count")
    parser.add_argument(
        "--before",
        type=Path,
        help="a checkout of the code before a change: its daemons run beside this one's in "
        "every round, and each row says whose (before, after)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.before is not None and not (args.before / "mtc_replicator").is_dir():
        parser.error(f"--before {args.before}: no mtc_replicator package there (a checkout?)")
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown or not args.scenarios:
        parser.error(f"--scenarios: {unknown or 'none'} not among {', '.join(SCENARIOS)}")
    for flag in ("step_mib", "files", "saves", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    """Every scenario's rows, counts of cores (and with ``--before``, the two codes)
    interleaved in each round; and the counts left out (more cores than the machine lets
    this process run on)."""
    available = sorted(os.sched_getaffinity(0))
    counts = [n for n in args.cores if n <= len(available)]
    skipped = [
        f"{n} cores (this machine has {len(available)})" for n in args.cores if n > len(available)
    ]
    codes: list[tuple[str, Path | None]] = [("", None)]
    if args.before is not None:
        codes = [("before", args.before.resolve()), ("after", None)]
    ram = Path(tempfile.mkdtemp(prefix="mtc-cores-", dir="/dev/shm"))
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory(prefix="mtc-cores-") as tmp:
            scenario = Scenario(args, Path(tmp), ram, ram / "buckets")
            for name in args.scenarios:
                own = own_cores(counts, DAEMONS[name], available)
                pins = {n: core_sets(n, DAEMONS[name], available, own=own) for n in counts}
                runs: dict[tuple[str, int], list[Run]] = {}
                for r in range(args.rounds):
                    for label, code in codes:
                        for n in counts:
                            run = scenario.run(name, pins[n], f"{name}{label}{n}r{r}", code)
                            runs.setdefault((label, n), []).append(run)
                rows += [
                    Row(name, n, pins[n], runs[label, n], label)
                    for label, _ in codes
                    for n in counts
                ]
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    return rows, skipped


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC)
    rows, skipped = measure(args)
    load_after = os.getloadavg()
    header: dict[str, object] = {
        "date": started.strftime("%Y-%m-%dT%H:%MZ"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "machine_cores": len(os.sched_getaffinity(0)),
        "step_mib": args.step_mib,
        "files": args.files,
        "saves": args.saves,
        "warmup_saves": args.warmup,
        "rounds": args.rounds,
        "before": None if args.before is None else str(args.before),
        "skipped": skipped,
    }
    if args.json:
        scenarios: dict[str, object] = {
            name: {
                "what": WHAT[name],
                "counts": [r.json(_base(rows, r)) for r in rows if r.scenario == name],
            }
            for name in args.scenarios
        }
        print(json.dumps({**header, "scenarios": scenarios}))
        return
    for key, value in header.items():
        print(f"{key}: {value}")
    print()
    print(table(rows))
    if any(shared(r.pins) for r in rows):
        print(
            "\npair (shared): both daemons run on the same cores, two processes sharing "
            "them: this does not isolate one node's scaling; read it on a machine with 2N "
            "cores, where each daemon gets N of its own."
        )


if __name__ == "__main__":
    main()
