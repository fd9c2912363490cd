"""Ray Train checkpointing beside Ray's own, in one run: the training stall per checkpoint and
the time from a worker's failure to its first step after the restore.

One local Ray cluster (``ray.cluster_utils.Cluster``: a head on 127.0.0.10 with no CPUs, two
one-CPU nodes on 127.0.0.2 and 127.0.0.3) runs the same ``TorchTrainer`` (2 workers, gloo on
CPU, ``STRICT_SPREAD``) once per mode (``--modes``; the first three by default):

- ``ray-sync``: each checkpoint is ``torch.save`` of the worker's state to a temp directory
  and ``ray.train.report(metrics, checkpoint=..., checkpoint_upload_mode=SYNC)`` (Ray's
  default: the copy to ``storage_path`` blocks the loop);
- ``ray-async``: the same with ``CheckpointUploadMode.ASYNC`` (the copy runs in Ray's thread
  pool; the loop waits only for the ``torch.save`` and the report's barrier);
- ``mtc``: ``RayCheckpointer.save(step, state)`` + ``report(metrics)`` (no Ray checkpoint),
  with one real ``mtc-replicator`` daemon per simulated node (mutual TLS, a ``file://``
  backup on disk every second checkpoint), started for this run only;
- ``mtc-save``: the same without any ``report``: ``save`` alone, all the replicator needs;
- ``mtc-report10``: ``save`` every step from step ``--every`` on (the steps before are the
  plain ones), ``report(metrics)`` after every 10th save (the cadence of a job's metrics).

``storage_path`` and the temp directories are on ``/dev/shm`` (tmpfs; ``--storage-dir`` moves
them), as are the daemons' RAM disks: the fastest storage Ray can be given here, so Ray's
figures are a lower bound of what a bucket or a network filesystem would cost. Ray's own
settings are its defaults (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` 2 s); checkpoints are more
than 2 s apart, so that ``report`` is not throttled by the controller's poll, and far enough
apart for the daemons to finish replicating one step before the next.

Each worker holds ``--state-mib`` of tensors (8 tensors, updated in place every step, so every
checkpoint holds new bytes) and a small ``nn.Module`` whose gradients are all-reduced every
step; a step also sleeps ``--step-seconds`` (a stand-in for accelerator compute, which leaves
the CPUs to background copies as a GPU would). Every step, each worker stamps the end of its
all-reduce: the period between two stamps is the job's step time, both workers included.

- stall per checkpoint: the period of a checkpoint step minus the median period of the steps
  without one (same run, same mode), the larger of the two workers; median over
  ``--checkpoints`` (``mtc-report10``: x 10 saves); beside it the mean, which spreads a
  report every 10th save over the saves. Also: the seconds the loop sat in save + report.
- recovery: world rank 1 calls ``os._exit(1)`` ``--every``/2 steps after the last checkpoint
  (after waiting, outside the clock, until that checkpoint is durable for its mode: registered
  by Ray's controller, or replicated to the peer node); the clock runs from that moment to the
  end of the first all-reduce after the restore on the last worker (Ray restarts the whole
  group). ``--failures`` times per mode (each restart is killed again at the same step),
  median (none with ``--failures 0``). In parts: Ray's restart (to the first ``train_func``
  entry), setup (to the last worker's model and tensors built: the user's own code, the same
  in every mode), restore (to the last worker's state loaded) and the first step.

Targets: our stall at most 0.2x of Ray's SYNC report, our recovery at most 0.5x of Ray's.
Numbers are only comparable within one run: this box has 2 shared, noisy cores.

    .venv/bin/python scripts/bench_ray.py [--state-mib 256] [--checkpoints 5] [--every 16]
        [--failures 2] [--modes ray-sync,ray-async,mtc] [--storage-dir /dev/shm] [--keep DIR]
        [--json]

About 5 minutes with the defaults here. The stall of each way of calling RayCheckpointer,
against Ray's own checkpoint, in about 2 minutes (docs/performance.md):

    .venv/bin/python scripts/bench_ray.py --state-mib 32 --every 10 --failures 0 \
        --modes ray-sync,mtc-save,mtc,mtc-report10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.client import RayCheckpointer  # noqa: E402
from mtc_replicator.core.storedir import default_store_dir  # noqa: E402
from mtc_replicator.tools import certs  # noqa: E402
from tests.daemon_process import DaemonProcess  # noqa: E402
from tests.tls import node_tls  # noqa: E402

SHM = Path("/dev/shm")  # noqa: S108 (tmpfs: the RAM disks and Ray's storage_path)
HEAD_IP = "127.0.0.10"
"""Not 127.0.0.1: Ray rewrites a bootstrap address on 127.0.0.1 to the host's own IP."""
NODE_IPS = ("127.0.0.2", "127.0.0.3")
MODES = ("ray-sync", "ray-async", "mtc", "mtc-save", "mtc-report10")
DEFAULT_MODES = MODES[:3]
REPORT_EVERY = 10
"""``mtc-report10``: saves per report."""
TENSORS = 8
STALL_TARGET = 0.2
RECOVERY_TARGET = 0.5


# --- The worker side (pickled by value into Ray's workers) ------------------------------------


def _emit(config: dict[str, Any], **event: object) -> None:
    """Append one event to this worker process's own JSONL file (read by the driver)."""
    event["t"] = time.time()
    with (Path(config["events"]) / f"{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(event) + "\n")


def _build(config: dict[str, Any], rank: int) -> tuple[Any, Any, dict[str, Any]]:
    """The small model, its optimizer, and ``state-mib`` of tensors filled with ``rank``."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    numel = config["state_mib"] * 1024 * 1024 // 4 // TENSORS
    big = {f"w{i}": torch.full((numel,), float(rank)) for i in range(TENSORS)}
    return model, opt, big


def _step(model: Any, opt: Any, big: dict[str, Any], step: int, rank: int) -> None:
    """A real synchronous step: gradients all-reduced over gloo; the big tensors +1."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(step * 31 + rank)
    x = torch.randn(32, 64, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).tanh()).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    for t in big.values():
        t.add_(1.0)


def _state(model: Any, big: dict[str, Any], step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "big": big, "step": step}


def _holds(big: dict[str, Any], rank: int, step: int) -> bool:
    """Whether the restored tensors are this rank's after ``step`` steps (rank + step)."""
    want = float(rank + step)
    return all(t[0].item() == want and t[-1].item() == want for t in big.values())


def _ray_save(config: dict[str, Any], state: dict[str, Any], rank: int, step: int) -> float:
    """Save and report as Ray's docs show; returns when the ``torch.save`` ended (monotonic)."""
    import ray.train
    import torch

    mode = ray.train.CheckpointUploadMode
    upload = mode.ASYNC if config["mode"] == "ray-async" else mode.SYNC
    # ASYNC deletes the directory after its upload; SYNC leaves it to the caller.
    tmp = tempfile.mkdtemp(prefix="ckpt-", dir=config["tmp"])
    torch.save(state, f"{tmp}/rank-{rank}.pt")
    saved = time.monotonic()
    checkpoint = ray.train.Checkpoint.from_directory(tmp)
    ray.train.report({"step": step}, checkpoint=checkpoint, checkpoint_upload_mode=upload)
    if upload is mode.SYNC:
        shutil.rmtree(tmp)
    return saved


def _ray_restore(rank: int) -> dict[str, Any] | None:
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        loaded: dict[str, Any] = torch.load(f"{d}/rank-{rank}.pt", map_location="cpu")
    return loaded


def _replicated(config: dict[str, Any], job: str, step: int) -> bool:
    """Every node's item of ``step`` committed on every node (its own copy and the peer's)."""
    for d in config["dirs"]:
        items = Path(default_store_dir(PurePosixPath(d))) / "items" / job / str(step)
        if not all((items / f"{n}-0" / "MANIFEST.json").exists() for n in range(len(NODE_IPS))):
            return False
    return True


def _wait_durable(config: dict[str, Any], ckpt: RayCheckpointer | None, step: int) -> None:
    """Outside the clock: the last checkpoint is where a restart finds it (every mode)."""
    import ray.train

    if ckpt is None:
        ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED
        )
        return
    deadline = time.monotonic() + 120
    while not _replicated(config, ckpt.job, step):
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was not replicated to every node in 120 s")
        time.sleep(0.05)


def _resume(
    config: dict[str, Any], ckpt: RayCheckpointer | None, rank: int, model: Any, big: Any
) -> int:
    """Restore into ``model`` and ``big``; the step restored, 0 on a fresh start."""
    if ckpt is None:
        state, source = _ray_restore(rank), "ray"
    else:
        restored = ckpt.restore()
        state, source = (None, "") if restored is None else (restored.state, restored.source)
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    for name, tensor in big.items():
        tensor.copy_(state["big"][name])
    step = int(state["step"])
    ok = _holds(big, rank, step)
    attempt = config["attempt"]
    _emit(config, event="restored", rank=rank, step=step, source=source, ok=ok, attempt=attempt)
    return step


def _saves_at(config: dict[str, Any], step: int) -> bool:
    every, mode = config["every"], config["mode"]
    return step >= every if mode == "mtc-report10" else step % every == 0


def _reports_at(config: dict[str, Any], step: int) -> bool:
    """Whether the save of ``step`` is followed by ``RayCheckpointer.report``."""
    every, mode = config["every"], config["mode"]
    return (step - every + 1) % REPORT_EVERY == 0 if mode == "mtc-report10" else mode == "mtc"


def _checkpoint(
    config: dict[str, Any], ckpt: RayCheckpointer | None, state: dict[str, Any], rank: int
) -> None:
    step = state["step"]
    began = time.monotonic()
    if ckpt is not None:
        ckpt.save(step, state)
        saved = time.monotonic()
        if _reports_at(config, step):
            ckpt.report({"step": step})
    else:
        saved = _ray_save(config, state, rank, step)
    end = time.monotonic()
    _emit(config, event="saved", rank=rank, step=step, s=end - began, report=end - saved)


def train_func(config: dict[str, Any]) -> None:
    """The loop every mode runs; ``config["mode"]`` picks how it checkpoints. Attempt k
    (1, 2, ...) kills world rank 1 at ``kill_step`` while k <= ``failures``."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    events = Path(config["events"])
    attempt = config["attempt"] = 1 + len(list(events.glob("killed-*")))
    _emit(config, event="entry", rank=rank, attempt=attempt)
    model, opt, big = _build(config, rank)
    _emit(config, event="built", rank=rank, attempt=attempt)
    ckpt = None
    if config["mode"].startswith("mtc"):
        ckpt = RayCheckpointer(backup_interval_steps=2 * config["every"], timeout=120)
    restored = last = _resume(config, ckpt, rank, model, big)
    for step in range(restored + 1, config["steps"] + 1):
        _step(model, opt, big, step, rank)
        _emit(config, event="sync", rank=rank, step=step, attempt=attempt)
        time.sleep(config["step_seconds"])
        if _saves_at(config, step):
            _checkpoint(config, ckpt, _state(model, big, step), rank)
            last = step
        if step == config["kill_step"] and attempt <= config["failures"]:
            if last > restored:  # (a restored step is where the previous restart found it)
                _wait_durable(config, ckpt, last)
            if rank == 1:
                (events / f"killed-{attempt}").touch()
                _emit(config, event="killed", rank=rank, step=step, attempt=attempt)
                os._exit(1)
    if ckpt is not None:
        ckpt.close()  # the nodes go to the next mode's job at once
    _emit(config, event="done", rank=rank)


# --- The driver ----------------------------------------------------------------------------------


@dataclass
class Figures:
    """One mode's medians (seconds) and what its restarts restored."""

    mode: str
    blocked: float
    """In save + report per checkpoint, the slower worker, median."""
    blocked_mean: float
    """The same, mean: reports every few saves included."""
    report: float
    """Of which in ``ray.train.report`` (for Ray's modes: after the ``torch.save``), median."""
    stall: float
    """Checkpoint step's period minus a plain step's, the larger worker, median."""
    stall_mean: float
    """The same, mean: a save's cost on average, reports every few saves included."""
    plain: float
    """A step without a checkpoint: the slower worker's median period."""
    recovery: float
    """The failure to the first all-reduce after the restore, median over the failures (NaN
    without failures, as every recovery figure)."""
    recoveries: list[float]
    """Each failure's."""
    restart: float
    """The failure to the first ``train_func`` entry: Ray's restart of the worker group."""
    setup: float
    """That entry to the last worker's state built (allocating the tensors)."""
    restore: float
    """Then to the last worker's restored state loaded into its tensors."""
    first_step: float
    restored: int
    failed: int
    source: str
    checked: bool
    """Every worker's restored tensors held its rank's values at the restored step."""


def _events(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in directory.glob("*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


def _step_figures(events: list[dict[str, Any]]) -> tuple[float, ...]:
    """(blocked, its mean, report, stall, its mean, plain) of the first attempt, from its
    all-reduce stamps; a checkpoint step is one that saved."""
    stalls: dict[int, float] = {}
    plains: list[float] = []
    saving = {e["step"] for e in events if e["event"] == "saved"}
    for rank in (0, 1):
        syncs = {
            e["step"]: e["t"]
            for e in events
            if e["event"] == "sync" and e["rank"] == rank and e["attempt"] == 1
        }
        periods = {k: syncs[k + 1] - syncs[k] for k in syncs if k + 1 in syncs and k > 1}
        plain = statistics.median(p for k, p in periods.items() if k not in saving)
        plains.append(plain)
        for k, p in periods.items():
            if k in saving:
                stalls[k] = max(stalls.get(k, float("-inf")), p - plain)
    blocked: dict[int, float] = {}
    reports: dict[int, float] = {}
    for e in events:
        if e["event"] == "saved" and e["step"] in stalls:
            blocked[e["step"]] = max(blocked.get(e["step"], 0.0), e["s"])
            reports[e["step"]] = max(reports.get(e["step"], 0.0), e["report"])
    return (
        statistics.median(blocked.values()),
        statistics.fmean(blocked.values()),
        statistics.median(reports.values()),
        statistics.median(stalls.values()),
        statistics.fmean(stalls.values()),
        max(plains),
    )


def _recovery(events: list[dict[str, Any]], attempt: int) -> dict[str, Any]:
    """The failure in ``attempt`` to the first all-reduce of the next one, in parts."""
    killed = next(e for e in events if e["event"] == "killed" and e["attempt"] == attempt)
    nxt = [e for e in events if e.get("attempt") == attempt + 1]
    entry = min(e["t"] for e in nxt if e["event"] == "entry")
    built = max(e["t"] for e in nxt if e["event"] == "built")
    restored = [e for e in nxt if e["event"] == "restored"]
    firsts: dict[int, float] = {}
    for e in nxt:
        if e["event"] == "sync":
            firsts.setdefault(e["rank"], e["t"])
    if len(restored) != 2 or len(firsts) != 2:
        raise RuntimeError(f"attempt {attempt + 1} did not restore and step on both workers")
    loaded, first = max(e["t"] for e in restored), max(firsts.values())
    return {
        "recovery": first - killed["t"],
        "restart": entry - killed["t"],
        "setup": built - entry,
        "restore": loaded - built,
        "first_step": first - loaded,
        "restored": min(e["step"] for e in restored),
        "failed": killed["step"],
        "sources": {e["source"] for e in restored},
        "checked": all(e["ok"] for e in restored),
    }


def _figures(mode: str, events: list[dict[str, Any]], failures: int) -> Figures:
    blocked, blocked_mean, report, stall, stall_mean, plain = _step_figures(events)
    runs = [_recovery(events, k) for k in range(1, failures + 1)]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs) if runs else math.nan

    return Figures(
        mode=mode,
        blocked=blocked,
        blocked_mean=blocked_mean,
        report=report,
        stall=stall,
        stall_mean=stall_mean,
        plain=plain,
        recovery=median("recovery"),
        recoveries=[round(r["recovery"], 2) for r in runs],
        restart=median("restart"),
        setup=median("setup"),
        restore=median("restore"),
        first_step=median("first_step"),
        restored=min((r["restored"] for r in runs), default=0),
        failed=max((r["failed"] for r in runs), default=0),
        source="/".join(sorted(set().union(*(r["sources"] for r in runs)))),
        checked=all(r["checked"] for r in runs),
    )


@dataclass
class Bench:
    """The Ray cluster, the nodes' RAM disks, and where each run writes."""

    root: Path
    """On /dev/shm: the nodes' RAM disks, the events, the daemons' logs and certificates."""
    ray_dir: Path
    """Ray's ``storage_path`` and the workers' temp checkpoint directories."""
    args: argparse.Namespace
    cluster: Any = None
    backup: Path | None = None
    """The daemons' ``file://`` backup, on disk, while they run."""

    @property
    def dirs(self) -> list[Path]:
        return [self.root / f"node{i}" / "ckpt" for i in range(len(NODE_IPS))]

    def start(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        for d in self.dirs:
            d.mkdir(parents=True)
        (self.ray_dir / "tmp").mkdir()
        # Ray's workers import mtc_replicator and this tree from the raylets' environment.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        os.environ["RAY_DEDUP_LOGS"] = "0"
        # Every node is given its IP: Ray's agents need not look this host up through DNS.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": HEAD_IP, "include_dashboard": False},
        )
        for i, ip in enumerate(NODE_IPS):
            self.cluster.add_node(
                num_cpus=1,
                node_ip_address=ip,
                include_dashboard=False,
                object_store_memory=256 * 1024 * 1024,
                env_vars={"MTC_CHECKPOINT_DIR": str(self.dirs[i])},
            )
        ray.init(address=self.cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)

    def stop(self) -> None:
        import ray

        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        for d in self.dirs:
            shutil.rmtree(default_store_dir(PurePosixPath(d)), ignore_errors=True)

    def daemons(self) -> list[DaemonProcess]:
        """One daemon per node, mutual TLS, a ``file://`` backup on disk (not tmpfs)."""
        backup = self.backup = Path(tempfile.mkdtemp(prefix="mtc-ray-bench-backup-"))
        ca = certs.new_ca()
        out = []
        for i, d in enumerate(self.dirs):
            tls = node_tls(self.root / "tls" / f"node{i}", ca, node=f"node{i}")
            log = self.root / f"daemon{i}.log"
            out.append(
                DaemonProcess(d, backup=backup.as_uri(), extra_args=tls.args(), log_path=log)
            )
        return [d.start() for d in out]

    def fit(self, mode: str) -> Figures:
        from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        events = self.root / f"events-{mode}"
        events.mkdir()
        a = self.args
        last = a.checkpoints * a.every
        if mode == "mtc-report10":
            last = a.every - 1 + a.checkpoints * REPORT_EVERY
        config = {
            "mode": mode,
            "events": str(events),
            "tmp": str(self.ray_dir / "tmp"),
            "dirs": [str(d) for d in self.dirs],
            "state_mib": a.state_mib,
            "every": a.every,
            "step_seconds": a.step_seconds,
            "kill_step": last + a.every // 2,
            "failures": a.failures,
            "steps": last + a.every // 2 + 2,
        }
        trainer = TorchTrainer(
            train_func,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
            run_config=RunConfig(
                name=f"bench-{mode}",
                storage_path=str(self.ray_dir / "storage"),
                failure_config=FailureConfig(max_failures=a.failures),
                checkpoint_config=CheckpointConfig(num_to_keep=2),
            ),
        )
        trainer.fit()
        return _figures(mode, _events(events), a.failures)


def _run_mode(bench: Bench, mode: str) -> Figures:
    if not mode.startswith("mtc"):
        return bench.fit(mode)
    daemons = bench.daemons()
    try:
        return bench.fit(mode)
    finally:
        for d in daemons:
            d.stop()
        if bench.backup is not None:
            shutil.rmtree(bench.backup, ignore_errors=True)


def _verdict(ours: float, theirs: float, target: float) -> str:
    ratio = ours / theirs if theirs > 0 else float("inf")
    return f"{ratio:.2f}x (target <= {target}x: {'PASS' if ratio <= target else 'MISS'})"


def _print(figures: dict[str, Figures], args: argparse.Namespace, seconds: float) -> None:
    import ray
    import torch

    print(
        f"Ray {ray.__version__}, torch {torch.__version__}: TorchTrainer, 2 workers (gloo, CPU), "
        f"{args.state_mib} MiB of state per worker, {args.checkpoints} checkpoints every "
        f"{args.every} steps; Ray's storage_path and temp dirs in {args.storage_dir}, the "
        "RAM disks in /dev/shm. "
        f"2 shared, noisy cores: compare within this run. Whole run {seconds:.0f} s."
    )
    head = (
        "mode", "in save+report", "(mean)", "of which report", "stall", "(mean)", "plain step",
        "recovery", "= restart", "+ setup", "+ restore", "+ 1st step", "restored/failed",
        "source",
    )  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for f in figures.values():
        row = (
            f.mode, f"{f.blocked:.3f}", f"{f.blocked_mean:.3f}", f"{f.report:.3f}",
            f"{f.stall:.3f}", f"{f.stall_mean:.3f}", f"{f.plain:.3f}", *(
                "-" if math.isnan(x) else f"{x:.2f}"
                for x in (f.recovery, f.restart, f.setup, f.restore, f.first_step)
            ),
            f"{f.restored}/{f.failed}{'' if f.checked else ' WRONG STATE'}", f.source,
        )  # fmt: skip
        print("| " + " | ".join(row) + " |")
    print(
        f"(seconds; medians over the {args.checkpoints} checkpoints and the "
        f"{args.failures} failures of each mode; (mean): over the checkpoints)"
    )
    sync = figures.get("ray-sync")
    for f in (f for m, f in figures.items() if m.startswith("mtc") and sync is not None):
        keys = ("blocked", "blocked_mean", "stall", "stall_mean")
        x = {k: f"{getattr(f, k) / getattr(sync, k):.2f}x" for k in keys}
        print(f"{f.mode} of ray-sync's: in save+report {x['blocked']} ({x['blocked_mean']} mean),"
              f" stall {x['stall']} ({x['stall_mean']} mean)")  # fmt: skip
    ours = figures.get("mtc")
    if ours is None:
        return
    if sync is not None:
        print(f"target: stall vs ray-sync's: {_verdict(ours.stall, sync.stall, STALL_TARGET)}")
    if (other := figures.get("ray-async")) is not None:
        print(f"stall vs ray-async's (no target): {ours.stall / other.stall:.2f}x")
    for base in ("ray-sync", "ray-async"):
        if (theirs := figures.get(base)) is not None and args.failures > 0:
            verdict = _verdict(ours.recovery, theirs.recovery, RECOVERY_TARGET)
            part = ours.restore / theirs.restore
            print(f"target: recovery vs {base}'s: {verdict}; its restore part alone {part:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mib", type=int, default=256, help="state per worker (MiB)")
    parser.add_argument("--checkpoints", type=int, default=5, help="checkpoints per mode")
    parser.add_argument("--every", type=int, default=16, help="steps between checkpoints")
    parser.add_argument("--failures", type=int, default=2, help="worker kills per mode")
    parser.add_argument(
        "--step-seconds", type=float, default=0.25, help="sleep per step (accelerator stand-in)"
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated, of {', '.join(MODES)}",
    )
    parser.add_argument(
        "--storage-dir",
        type=Path,
        default=SHM,
        help="where Ray's storage_path and temp dirs go (default /dev/shm, tmpfs)",
    )
    parser.add_argument(
        "--keep", type=Path, help="copy the workers' timestamped events and daemon logs here"
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if args.every < 4 or min(args.checkpoints, args.state_mib) < 1 or args.failures < 0:
        parser.error("--every must be >= 4; --checkpoints, --state-mib >= 1; --failures >= 0")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    started = time.monotonic()
    bench = Bench(
        Path(tempfile.mkdtemp(prefix="mtc-ray-bench-", dir=SHM)),
        Path(tempfile.mkdtemp(prefix="mtc-ray-bench-storage-", dir=args.storage_dir)),
        args,
    )
    figures: dict[str, Figures] = {}
    try:
        bench.start()
        for mode in modes:
            figures[mode] = _run_mode(bench, mode)
            print(f"{mode}: done at {time.monotonic() - started:.0f} s", file=sys.stderr)
    finally:
        bench.stop()
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for path in bench.root.glob("daemon*.log"):
                shutil.copy(path, args.keep)
            for events in bench.root.glob("events-*"):
                shutil.copytree(events, args.keep / events.name, dirs_exist_ok=True)
        shutil.rmtree(bench.root, ignore_errors=True)
        shutil.rmtree(bench.ray_dir, ignore_errors=True)
    _print(figures, args, time.monotonic() - started)
    if args.json:
        print(json.dumps({m: asdict(f) for m, f in figures.items()}, indent=2))
    return 0 if all(f.checked for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
