"""A Ray Tune trial checkpointing on the replicator beside Tune's own sync, in one run: the
stall per checkpoint, the restore of a trial that Tune moved to another node, and the bytes
sent to the bucket per trial-hour.

Per mode (``--modes``), a fresh local Ray cluster (a head on 127.0.0.10 with no CPUs, two
one-CPU nodes on 127.0.0.2 and 127.0.0.3) runs one trial of the function API that holds
``--state-mib`` of tensors (8, updated in place every step), sleeps ``--step-seconds`` a
step (a stand-in for accelerator compute) and checkpoints every ``--every`` steps:

- ``tune-local``: ``torch.save`` to a temp directory and ``tune.report(metrics,
  checkpoint=...)``, Tune copying it to a ``storage_path`` on this machine's disk;
- ``tune-s3``: the same to an S3 bucket (a moto server started for this run, through
  ``RunConfig(storage_filesystem=...)``);
- ``mtc``: ``TuneCheckpointer.save`` + ``report`` (a checkpoint of a few bytes naming the
  step), one real ``mtc-replicator`` daemon per node (mutual TLS, a ``file://`` backup on
  disk every ``--backup-every`` saves), started for this run only.

After ``--checkpoints`` checkpoints the trial's node is lost: its Ray node removed and, in
``mtc`` mode, its daemon killed and its RAM disk and store wiped. Tune restarts the trial on
the other node (``FailureConfig(max_failures=1)``). Figures:

- stall: the seconds the loop spends in its checkpoint call (save + report), median;
- restore: from the restarted trial's entry to its state loaded (``tune.get_checkpoint()``
  downloaded and ``torch.load``, or ``TuneCheckpointer.restore``); the restart itself is
  Ray's, the same in every mode, and reported apart (from the loss to the trial's entry);
- floor: a ``torch.load`` of the same state from the node's RAM disk, timed in the trial
  after its restore: what any restore that hands the trial its tensors spends at the least;
- bucket bytes per trial-hour: what reached the storage_path (or the daemons' backup) while
  the trial ran, scaled to an hour of it.

Targets (issue 36): our stall at most 0.3x of Tune's synchronous checkpoint, our restore on
another node at most 0.5x of Tune's from its storage_path. Compare within one run only:
this box has 2 shared, noisy cores.

    .venv/bin/python scripts/bench_tune.py [--state-mib 128] [--checkpoints 5] [--every 3]
        [--step-seconds 0.3] [--backup-every 5] [--modes tune-local,tune-s3,mtc] [--json]
"""

from __future__ import annotations

import argparse
import json
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

from mtc_replicator.core.storedir import default_store_dir  # noqa: E402
from mtc_replicator.tools import certs  # noqa: E402
from tests.daemon_process import DaemonProcess  # noqa: E402
from tests.storage_servers import start_moto  # noqa: E402
from tests.tls import node_tls  # noqa: E402

SHM = Path("/dev/shm")  # noqa: S108 (tmpfs: the nodes' RAM disks)
HEAD_IP = "127.0.0.10"
NODE_IPS = ("127.0.0.2", "127.0.0.3")
MODES = ("tune-local", "tune-s3", "mtc")
TENSORS = 8
STALL_TARGET = 0.3
RESTORE_TARGET = 0.5
BUCKET = "tune-bench"
MOTO_KEYS = {"aws_access_key_id": "test", "aws_secret_access_key": "test"}
"""moto takes any credentials."""


# --- The trial (pickled by value into Ray's workers) ----------------------------------------


def _emit(config: dict[str, Any], **event: object) -> None:
    event.update(t=time.time(), dir=os.environ.get("MTC_CHECKPOINT_DIR", ""))
    with (Path(config["events"]) / f"{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(event) + "\n")


def _tensors(mib: int) -> dict[str, Any]:
    import torch

    n = mib * 1024 * 1024 // 4 // TENSORS
    return {f"t{i}": torch.zeros(n) for i in range(TENSORS)}


def _restore(config: dict[str, Any], ckpt: Any) -> tuple[int, dict[str, Any] | None]:
    import torch
    from ray import tune

    if ckpt is not None:
        restored = ckpt.restore(tune.get_checkpoint())
        return (0, None) if restored is None else (restored.step, restored.state)
    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as local:
        state = torch.load(Path(local) / "state.pt", weights_only=True)
    return int(state["step"]), state


def _load_floor(state: dict[str, Any] | None) -> float:
    """Seconds a ``torch.load`` of the restored state takes from this node's RAM disk: what
    any restore that hands the trial its tensors spends at the least."""
    import torch

    path = Path(os.environ["MTC_CHECKPOINT_DIR"]) / f"floor-{os.getpid()}.pt"
    torch.save(state, path)
    try:
        t0 = time.perf_counter()
        torch.load(path, weights_only=True)
        return time.perf_counter() - t0
    finally:
        path.unlink()


def trial(config: dict[str, Any]) -> None:
    import torch
    from ray import tune

    t0 = time.time()
    _emit(config, event="entry")
    ckpt = None
    if config["mode"] == "mtc":
        from mtc_replicator.client import TuneCheckpointer

        ckpt = TuneCheckpointer(backup_interval_steps=config["backup_every"] * config["every"])
    step, state = _restore(config, ckpt)
    big = _tensors(config["state_mib"]) if state is None else {
        k: v for k, v in state.items() if k.startswith("t")
    }  # fmt: skip
    if step:
        seconds = time.time() - t0
        _emit(config, event="restored", step=step, seconds=seconds, floor=_load_floor(state))
    checkpoints = 0
    while step < config["steps"]:
        step += 1
        for tensor in big.values():
            tensor.add_(1.0)
        time.sleep(config["step_seconds"])
        if step % config["every"]:
            tune.report({"step": step})
            continue
        c0 = time.perf_counter()
        if ckpt is not None:
            ckpt.save(step, {**big, "step": torch.tensor(step)})
            ckpt.report({"step": step})
        else:
            with tempfile.TemporaryDirectory(dir=config["tmp"]) as tmp:
                torch.save({**big, "step": step}, Path(tmp) / "state.pt")
                tune.report({"step": step}, checkpoint=tune.Checkpoint.from_directory(tmp))
        checkpoints += 1
        _emit(config, event="checkpoint", step=step, seconds=time.perf_counter() - c0)
        if checkpoints == config["checkpoints"] and not Path(config["lost"]).exists():
            _emit(config, event="holding", step=step)
            while True:  # the bench removes this trial's node
                time.sleep(1)
    if ckpt is not None:
        ckpt.close()


# --- The driver -------------------------------------------------------------------------------


@dataclass
class Figures:
    mode: str
    stall_median_s: float
    restore_s: float
    load_floor_s: float
    restart_s: float
    restored_step: int
    bucket_bytes_per_trial_hour: float
    bucket_bytes_per_checkpoint: float
    trial_seconds: float


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(tempfile.mkdtemp(prefix="mtc-tune-bench-", dir=SHM))
        self.disk = Path(tempfile.mkdtemp(prefix="mtc-tune-bench-disk-"))
        """The storage_path, the daemons' backup and the temp checkpoints: on disk."""

    def dirs(self, mode: str) -> list[Path]:
        return [self.root / mode / f"node{i}" / "ckpt" for i in range(len(NODE_IPS))]

    def run(self, mode: str) -> Figures:
        import ray
        from ray import tune
        from ray.cluster_utils import Cluster

        args = self.args
        dirs = self.dirs(mode)
        for d in dirs:
            d.mkdir(parents=True)
        events, tmp = self.root / mode / "events", self.disk / mode / "tmp"
        events.mkdir()
        tmp.mkdir(parents=True)
        lost = self.root / mode / "lost"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        daemons, moto, backup = [], None, self.disk / mode / "backup"
        if mode == "mtc":
            daemons = self._daemons(dirs, backup)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": HEAD_IP, "include_dashboard": False},
        )
        nodes = [
            cluster.add_node(
                num_cpus=1,
                node_ip_address=ip,
                include_dashboard=False,
                object_store_memory=256 * 1024 * 1024,
                env_vars={"MTC_CHECKPOINT_DIR": str(dirs[i])},
            )
            for i, ip in enumerate(NODE_IPS)
        ]
        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        try:
            storage: dict[str, Any] = {"storage_path": str(self.disk / mode / "storage")}
            if mode == "tune-s3":
                moto = start_moto(self.disk)
                storage = self._s3(moto.url)
            config = {
                "mode": mode,
                "events": str(events),
                "tmp": str(tmp),
                "lost": str(lost),
                "state_mib": args.state_mib,
                "every": args.every,
                "step_seconds": args.step_seconds,
                "checkpoints": args.checkpoints,
                "backup_every": args.backup_every,
                "steps": args.every * (args.checkpoints + 2),
            }
            tuner = tune.Tuner(
                tune.with_resources(trial, {"cpu": 1}),
                param_space=config,
                run_config=tune.RunConfig(
                    name=f"bench-{mode}",
                    failure_config=tune.FailureConfig(max_failures=1),
                    **storage,
                ),
            )
            runner = _Thread(tuner.fit)
            held = _wait_for(events, "holding")
            victim = [str(d) for d in dirs].index(held["dir"])
            lost.touch()
            if daemons:
                daemons[victim].kill()
                shutil.rmtree(dirs[victim])
                shutil.rmtree(default_store_dir(PurePosixPath(dirs[victim])), ignore_errors=True)
            lost_at = time.time()
            cluster.remove_node(nodes[victim], allow_graceful=False)
            runner.join(600)
            measured = _events(events)
            bucket = _bucket_bytes(mode, self.disk / mode, backup, moto)
        finally:
            ray.shutdown()
            cluster.shutdown()
            for d in daemons:
                if d.running:
                    d.stop()
            if moto is not None:
                moto.stop()
        return _figures(mode, measured, lost_at, bucket)

    def _daemons(self, dirs: list[Path], backup: Path) -> list[DaemonProcess]:
        ca = certs.new_ca()
        out = []
        for i, d in enumerate(dirs):
            tls = node_tls(d.parent / "tls", ca, node=f"node{i}")
            log = d.parent / "daemon.log"
            out.append(
                DaemonProcess(d, backup=backup.as_uri(), extra_args=tls.args(), log_path=log)
            )
        return [d.start() for d in out]

    def _s3(self, url: str) -> dict[str, Any]:
        import boto3
        import pyarrow.fs

        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **MOTO_KEYS)
        s3.create_bucket(Bucket=BUCKET)
        fs = pyarrow.fs.S3FileSystem(
            access_key=MOTO_KEYS["aws_access_key_id"],
            secret_key=MOTO_KEYS["aws_secret_access_key"],
            endpoint_override=url.removeprefix("http://"),
            scheme="http",
            region="us-east-1",
        )
        return {"storage_path": f"{BUCKET}/tune", "storage_filesystem": fs}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.disk, ignore_errors=True)


class _Thread:
    def __init__(self, fn: Any) -> None:
        import threading

        self.error: BaseException | None = None

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported by join
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the Tune run did not end")
        if self.error is not None:
            raise self.error


def _events(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in directory.glob("*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(out, key=lambda e: e["t"])


def _wait_for(directory: Path, event: str, timeout: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in _events(directory) if e["event"] == event]
        if found:
            return found[0]
        time.sleep(0.2)
    raise TimeoutError(f"no {event!r} event in {timeout:.0f} s")


def _bucket_bytes(mode: str, base: Path, backup: Path, moto: Any) -> int:
    if mode == "mtc":
        root = backup
    elif mode == "tune-local":
        root = base / "storage"
    else:
        import boto3

        s3 = boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1", **MOTO_KEYS)
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
        return sum(o["Size"] for page in pages for o in page.get("Contents", []))
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _figures(mode: str, events: list[dict[str, Any]], lost_at: float, bucket: int) -> Figures:
    stalls = [e["seconds"] for e in events if e["event"] == "checkpoint"]
    restored = [e for e in events if e["event"] == "restored"]
    entries = [e for e in events if e["event"] == "entry" and e["t"] > lost_at]
    if not restored or not entries:
        raise RuntimeError(f"{mode}: the trial was not restored after its node was lost")
    trial_seconds = events[-1]["t"] - events[0]["t"]
    return Figures(
        mode=mode,
        stall_median_s=statistics.median(stalls),
        restore_s=restored[-1]["seconds"],
        load_floor_s=restored[-1]["floor"],
        restart_s=entries[0]["t"] - lost_at,
        restored_step=restored[-1]["step"],
        bucket_bytes_per_trial_hour=bucket / trial_seconds * 3600,
        bucket_bytes_per_checkpoint=bucket / len(stalls),
        trial_seconds=trial_seconds,
    )


def _ratio(ours: float, theirs: float, target: float) -> str:
    ratio = ours / theirs if theirs > 0 else float("inf")
    return f"{ratio:.2f}x (target <= {target}x: {'PASS' if ratio <= target else 'MISS'})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=int, default=128)
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--step-seconds", type=float, default=0.3)
    p.add_argument("--backup-every", type=int, default=5)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    bench = Bench(args)
    figures: dict[str, Figures] = {}
    try:
        for mode in args.modes.split(","):
            figures[mode] = bench.run(mode)
    finally:
        bench.close()
    if args.json:
        print(json.dumps({m: asdict(f) for m, f in figures.items()}, indent=2))
        return 0
    print(
        f"Ray Tune, one trial of {args.state_mib} MiB, a checkpoint every {args.every} steps of "
        f"{args.step_seconds}s, its node lost after {args.checkpoints} checkpoints"
    )
    print(
        f"{'mode':12} {'stall':>9} {'restore':>9} {'floor':>9} {'restart':>9} {'step':>5} "
        f"{'MB/trial-h':>11} {'MB/ckpt':>8}"
    )
    for f in figures.values():
        print(
            f"{f.mode:12} {f.stall_median_s:8.3f}s {f.restore_s:8.3f}s {f.load_floor_s:8.3f}s "
            f"{f.restart_s:8.2f}s "
            f"{f.restored_step:5d} {f.bucket_bytes_per_trial_hour / 1e6:11.0f} "
            f"{f.bucket_bytes_per_checkpoint / 1e6:8.1f}"
        )
    ours = figures.get("mtc")
    for base in ("tune-local", "tune-s3"):
        theirs = figures.get(base)
        if ours is None or theirs is None:
            continue
        hourly = ours.bucket_bytes_per_trial_hour / theirs.bucket_bytes_per_trial_hour
        per_checkpoint = ours.bucket_bytes_per_checkpoint / theirs.bucket_bytes_per_checkpoint
        print(
            f"vs {base}: stall {_ratio(ours.stall_median_s, theirs.stall_median_s, STALL_TARGET)}"
            f", restore {_ratio(ours.restore_s, theirs.restore_s, RESTORE_TARGET)}, bucket "
            f"bytes per trial-hour {hourly:.2f}x, per checkpoint {per_checkpoint:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
