"""What one node's stack uses: the figures behind the DaemonSet's resource requests, and
where each GiB of its checkpoint's CPU goes, stage by stage, beside each stage's floor.

The node: four real daemons (mutual TLS, one rank each, ``peers-per-node: 1``, a backup of
every step to ``file://``), each with its RAM disk on tmpfs (``/dev/shm``), and one real CSI
plugin (``mtc-csi``) serving its socket over a RAM disk of its own. The ranks save a step
of ``--step-mib`` each, ``--warmup`` times unmeasured and then ``--saves`` times, waiting
for every step to be backed up before the next; the bucket is pruned to its newest
committed step as it goes (``footprint_stages.prune_backups``). Measured from ``/proc``,
per daemon: resident memory idle before the job, the peak (``VmHWM``) over the run, CPU
seconds per GiB of the node's own checkpoint over the measured saves (its ingest, its push
to its peer, the peer's copy it receives, its upload: the node's cycle), and CPU while idle
after them. ``--no-backup``: the same without a backup (the next save waits for every
push), to tell the tiers' shares apart. The plugin: its resident memory and CPU while idle.

The stages (``footprint_stages``): ingest with both digests, push send, push receive and
verify, upload, restore receive (and serve), each on real daemons in a scenario that
isolates it, with the same step size and counts. Each beside its floor
(``footprint_floors``): the sum of the bare primitives it must do (a read, a write,
crc32c, BLAKE3, a TLS send or receive), measured in this process on a step's bytes with
the product's libraries, three rounds before the stages, three after them and three after
the node's run: each primitive's least. The node's cycle is set beside the sum of its
stages' floors. ``--no-stages``: the node alone; ``--no-node``: the stages alone.

    .venv/bin/python scripts/bench_footprint.py                  # 256 MiB steps, 2 + 4 saves
    .venv/bin/python scripts/bench_footprint.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.tools import certs  # noqa: E402
from mtc_replicator.transport.tls import TlsMaterial  # noqa: E402
from scripts import footprint_floors as floors  # noqa: E402
from scripts.bench_scale import Node, make_tls  # noqa: E402
from scripts.footprint_stages import (  # noqa: E402
    MiB,
    Stages,
    daemon_argv,
    handshake,
    prune_backups,
    save,
    wait_logged,
)
from tests.proc import cpu_seconds, memory_mib  # noqa: E402

JOB = "footprint"
NODES = 4


def wait_step(nodes: list[Node], step: int, backup: bool, timeout: float = 120.0) -> None:
    """Until ``step`` is backed up (every rank's item committed), or without a backup,
    until every rank pushed its item to its peer."""
    logs = [n.log for n in nodes]
    if backup:
        wait_logged(logs, rf"backup committed job={JOB} step={step} ", 1, f"step {step}'s backup")
    else:
        pushed = rf"pushed {JOB}/s{step}/n\d+-w\d+ to "
        wait_logged(logs, pushed, NODES, f"step {step}'s pushes", timeout)


def start_plugin(root: Path) -> subprocess.Popen[bytes]:
    """The CSI plugin over a RAM disk (a tmpfs it mounts: root only) of its own."""
    env = {
        **os.environ,
        "MTC_CSI_ENDPOINT": f"unix://{root}/csi/csi.sock",
        "MTC_CSI_NODE_ID": "node-footprint",
        "MTC_RAM_DIR": str(root / "plugin-ram"),
        "MTC_RAM_SIZE": "64Mi",
        "MTC_CSI_ALLOWED_NAMESPACES": "default",
    }
    (root / "csi").mkdir()
    log = (root / "plugin.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtc_replicator.csi.plugin"], env=env, stdout=log, stderr=log
    )
    deadline = time.monotonic() + 30
    while not (root / "csi" / "csi.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((root / "plugin.log").read_text())
        time.sleep(0.05)
    return proc


# Long: one run of the node, start to idle, read in order; its parts share every process.
def measure(
    args: argparse.Namespace, root: Path, ram: Path, bucket: Path, ca: certs.Pair
) -> dict[str, object]:
    """The node's run: four daemons and the plugin, their memory and CPU."""
    bucket.mkdir(parents=True)
    nodes: list[Node] = []
    plugin = None
    try:
        for rank in range(NODES):
            ckpt = ram / f"node{rank}" / "ckpt"
            ckpt.mkdir(parents=True)
            tls = make_tls(root, ca, f"node{rank}")
            # Without a backup, the bucket's directory is the job's registry alone.
            argv = daemon_argv(ckpt, tls, bucket, backup=not args.no_backup)
            nodes.append(Node(rank, ckpt, argv, root / f"node{rank}.log"))
        for node in nodes:
            node.start()
        if os.geteuid() == 0:
            plugin = start_plugin(root)
        time.sleep(args.idle_seconds)
        pids = [n.proc.pid for n in nodes if n.proc is not None]
        idle_rss = [memory_mib(p, "VmRSS") for p in pids]
        for node in nodes:
            handshake(node, JOB, NODES)
        time.sleep(2)
        for i in range(args.warmup + args.saves):
            if i == args.warmup:  # the steps before it are not measured (Stages.saves_measured)
                cpu_before = [cpu_seconds(p) for p in pids]
                started = time.monotonic()
            step = (i + 1) * 10
            for node in nodes:
                save(node.ckpt, step, args.step_mib * MiB)
            wait_step(nodes, step, backup=not args.no_backup)
            prune_backups(bucket, JOB)
        busy = time.monotonic() - started
        cpu_saves = [cpu_seconds(p) - c for p, c in zip(pids, cpu_before, strict=True)]
        cpu_idle0 = [cpu_seconds(p) for p in pids]
        time.sleep(args.idle_seconds)
        cpu_idle = [cpu_seconds(p) - c for p, c in zip(pids, cpu_idle0, strict=True)]
        peak = [memory_mib(p, "VmHWM") for p in pids]
        after = [memory_mib(p, "VmRSS") for p in pids]
        gib = args.saves * args.step_mib / 1024
        result: dict[str, object] = {
            "backup": "none" if args.no_backup else "file://, every step",
            "step_mib_per_rank": args.step_mib,
            "saves": args.saves,
            "warmup_saves": args.warmup,
            "seconds_for_the_saves": round(busy, 1),
            "replicator_rss_idle_mib": [round(x) for x in idle_rss],
            "replicator_rss_after_mib": [round(x) for x in after],
            "replicator_peak_rss_mib": [round(x) for x in peak],
            "replicator_cpu_seconds_per_gib": [round(c / gib, 2) for c in cpu_saves],
            "replicator_idle_cpu_percent": [
                round(100 * c / args.idle_seconds, 2) for c in cpu_idle
            ],
        }
        if plugin is not None:
            c0 = cpu_seconds(plugin.pid)
            time.sleep(args.idle_seconds)
            result["plugin_rss_mib"] = round(memory_mib(plugin.pid, "VmRSS"))
            result["plugin_peak_rss_mib"] = round(memory_mib(plugin.pid, "VmHWM"))
            result["plugin_idle_cpu_percent"] = round(
                100 * (cpu_seconds(plugin.pid) - c0) / args.idle_seconds, 2
            )
        return result
    finally:
        for node in nodes:
            node.stop()
        if plugin is not None:
            plugin.send_signal(signal.SIGTERM)
            plugin.wait(30)
            subprocess.run(["umount", str(root / "plugin-ram")], check=False, capture_output=True)
        shutil.rmtree(ram, ignore_errors=True)


class Floors:
    """The primitives' rounds over one step's bytes, taken at points of the run."""

    def __init__(self, root: Path, ram: Path, bucket: Path, ca: certs.Pair, step_mib: int) -> None:
        self.ram = ram
        self.backup = bucket
        self.backup.mkdir(parents=True)
        ram.mkdir(parents=True)
        save(ram, 1, step_mib * MiB)
        self.source = ram / "1" / "state"
        self.tls = (
            TlsMaterial(make_tls(root, ca, "floor-receiver")),
            TlsMaterial(make_tls(root, ca, "floor-sender")),
        )
        self.rounds: list[dict[str, float]] = []

    def measure(self, rounds: int = 3) -> None:
        for _ in range(rounds):
            self.rounds.append(floors.measure_round(self.source, self.ram, self.backup, self.tls))


@dataclass(frozen=True)
class Profile:
    """The stage table: each stage beside its floor, and the node's cycle beside the sum
    of its stages' floors."""

    rows: list[floors.Row]
    cycle: floors.Row | None
    cycle_range: tuple[float, float] | None
    stages_apart: float | None
    """The cycle's stages measured one by one, added up."""
    between_steps: float | None = None
    """CPU s/GiB the daemons would spend over the saves' seconds at their idle rate (the
    median daemon's): what the cycle costs for the time it takes, beside its bytes."""
    restore_round: tuple[float, float] | None = None
    """CPU seconds of a restore round with 4 KiB to pull: the restoring node's, the
    serving node's (left out of the restore rows)."""
    per_step: dict[str, float] | None = None
    """CPU seconds of a step of 4 KiB, by scenario (left out of the stage rows)."""

    @classmethod
    def of(
        cls, result: dict[str, object], stages: dict[str, float], measured: dict[str, float]
    ) -> Profile:
        backup = result.get("backup") != "none"
        rows = floors.stage_rows(stages, measured) if stages else []
        restore_round = None
        if "restore_round_restoring" in stages:
            restore_round = (stages["restore_round_restoring"], stages["restore_round_serving"])
        per_step = {k.removeprefix("step_"): v for k, v in stages.items() if k.startswith("step_")}
        per_gib = result.get("replicator_cpu_seconds_per_gib")
        if not isinstance(per_gib, list) or not per_gib:
            return cls(rows, None, None, None, None, restore_round, per_step or None)
        cycle = floors.cycle_row(statistics.median(per_gib), measured, backup=backup)
        apart = floors.stages_sum(stages, backup=backup) if stages else None
        span = (min(per_gib), max(per_gib))
        between = _between_steps(result)
        return cls(rows, cycle, span, apart, between, restore_round, per_step or None)

    def json(self) -> dict[str, object]:
        out: dict[str, object] = {"stages": [_row_json(r) for r in self.rows]}
        if self.restore_round is not None:
            restoring, serving = self.restore_round
            out["restore_round_cpu_seconds"] = {
                "restoring": round(restoring, 2),
                "serving": round(serving, 2),
            }
        if self.per_step is not None:
            out["step_of_4_kib_cpu_seconds"] = {k: round(v, 3) for k, v in self.per_step.items()}
        if self.cycle is not None:
            out["cycle"] = {
                **_row_json(self.cycle),
                "range": self.cycle_range,
                "stages_measured_apart": _round(self.stages_apart),
                "between_steps_at_idle_rate": _round(self.between_steps),
            }
        return out

    def text(self) -> str:
        lines = [floors.table(self.rows, self.cycle, self.stages_apart)]
        if self.restore_round is not None:
            lines.append(
                "a restore round with 4 KiB to pull (left out of the restore rows): "
                f"{self.restore_round[0]:.2f} CPU s restoring, {self.restore_round[1]:.2f} serving"
            )
        if self.per_step is not None:
            lines.append(
                "a step of 4 KiB (taken off the stage rows), CPU s per daemon: "
                + ", ".join(f"{k} {v:.3f}" for k, v in self.per_step.items())
            )
        if self.cycle_range is not None:
            low, high = self.cycle_range
            lines.append(f"the node's cycle, per daemon: {low:.2f}-{high:.2f} CPU s/GiB")
        if self.between_steps is not None:
            lines.append(
                f"  of which {self.between_steps:.2f} CPU s/GiB at the daemons' idle rate over "
                "the saves' seconds"
            )
        return "\n".join(lines)


def _between_steps(result: dict[str, object]) -> float | None:
    """The median daemon's idle CPU rate over the measured saves' seconds, per GiB."""
    idle = result.get("replicator_idle_cpu_percent")
    seconds = result.get("seconds_for_the_saves")
    saves, mib = result.get("saves"), result.get("step_mib_per_rank")
    if not isinstance(idle, list) or not idle or not isinstance(seconds, int | float):
        return None
    if not isinstance(saves, int) or not isinstance(mib, int) or saves * mib <= 0:
        return None
    rate: float = statistics.median(float(v) for v in idle) / 100
    return rate * seconds / (saves * mib / 1024)


def _row_json(row: floors.Row) -> dict[str, object]:
    return {
        "stage": row.stage,
        "cpu_seconds_per_gib": _round(row.cpu),
        "floor_seconds_per_gib": round(row.floor, 2),
        "ratio": _round(row.ratio),
        "floor": list(row.formula),
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def primitives_text(measured: dict[str, float]) -> str:
    lines = ["| primitive | CPU s/GiB |", "|---|---:|"]
    lines += [f"| {floors.PRIMITIVE_NAMES[p]} | {v:.2f} |" for p, v in measured.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-mib", type=int, default=256, help="each rank's step (MiB)")
    parser.add_argument("--saves", type=int, default=4, help="steps measured (default 4)")
    parser.add_argument(
        "--warmup", type=int, default=2, help="steps saved first, not measured (default 2)"
    )
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle windows (s)")
    parser.add_argument(
        "--no-backup", action="store_true", help="the node without a backup: local and peer tiers"
    )
    parser.add_argument(
        "--bucket-dir",
        help="where the file:// buckets go (default: tmpfs, /dev/shm; docs/performance.md)",
    )
    parser.add_argument("--no-stages", action="store_true", help="the node's run alone")
    parser.add_argument("--no-node", action="store_true", help="the stages and floors alone")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    ca = certs.new_ca()
    ram = Path(tempfile.mkdtemp(prefix="mtc-footprint-", dir="/dev/shm"))
    buckets = Path(tempfile.mkdtemp(prefix="mtc-footprint-buckets-", dir=args.bucket_dir or ram))
    result: dict[str, object] = {}
    stages: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="mtc-footprint-") as tmp:
            root = Path(tmp)
            floor = Floors(root, ram / "floor", buckets / "floor", ca, args.step_mib)
            floor.measure()
            if not args.no_stages:
                where = (root / "stages", ram / "stages", buckets / "stages")
                run = Stages(*where, ca, args.step_mib, args.saves, args.warmup)
                stages = run.measure()
                floor.measure()
            if not args.no_node:
                result.update(measure(args, root / "node", ram / "node", buckets / "node", ca))
            floor.measure()
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(buckets, ignore_errors=True)
    result["backup"] = "none" if args.no_backup else "file://, every step"
    measured = floors.least(floor.rounds)
    table = Profile.of(result, stages, measured)
    if args.json:
        rounds = [{p: round(v, 3) for p, v in r.items()} for r in floor.rounds]
        figures = {p: round(v, 3) for p, v in measured.items()}
        extra = {"primitives_cpu_seconds_per_gib": figures, "primitive_rounds": rounds}
        print(json.dumps({**result, **extra, **table.json()}))
        return
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"\n{primitives_text(measured)}\n\n{table.text()}")


if __name__ == "__main__":
    main()
