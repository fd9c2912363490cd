"""Ray Train on the replicator, on one machine: kill a worker, watch it resume from RAM.

What it starts (all stopped at the end): two ``mtc-replicator`` daemons as ``mtc demo --nodes``
starts them (each its own RAM-disk directory under /dev/shm, mutual TLS from a throwaway CA,
one shared ``file://`` backup), and a local Ray cluster whose two worker nodes stand on
127.0.0.2 and 127.0.0.3, each with its daemon's directory in ``MTC_CHECKPOINT_DIR``. A
2-worker ``TorchTrainer`` (gloo, CPU) trains a small model and saves every step through
``RayCheckpointer``; at step ``--kill-at`` worker 1 kills itself (SIGKILL), Ray restarts the
whole worker group, and both workers resume from the RAM tier. The final weights must
equal an uninterrupted run's: exit status 0 when they do. docs/ray.md explains it.

    pip install -e '.[daemon,ray]'       # or: make venv
    python examples/ray_train.py         # --workdir DIR keeps the daemons' logs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAD_IP = "127.0.0.10"  # Not 127.0.0.1: Ray rewrites that bootstrap address to the host's IP.
WORKERS = 2


def build() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def gradients(model: Any, step: int, rank: int) -> list[Any]:
    """This worker's gradients on a batch derived from (step, rank): reproducible."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step + 7919 * rank)
    x = torch.randn(16, 8, generator=gen)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
    return [p.grad.clone() for p in model.parameters()]


def digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train_func(config: dict[str, Any]) -> None:
    import ray.train
    import torch.distributed as dist

    from mtc_replicator.client import RayCheckpointer

    rank = ray.train.get_context().get_world_rank()
    model, opt = build()
    ckpt = RayCheckpointer(backup_interval_steps=4)  # changed: the checkpointer
    restored = ckpt.restore()  # changed: what the replicator (or Ray) holds
    start = 1
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
        start = restored.step + 1  # changed: resume after the restored step
    event = {"rank": rank, "step": restored.step, "source": restored.source} if restored else {}
    with open(Path(config["events"]) / f"{os.getpid()}.json", "w") as f:
        json.dump({"event": "restored" if restored else "fresh", "rank": rank, **event}, f)
    for step in range(start, config["steps"] + 1):
        for param, grad in zip(model.parameters(), gradients(model, step, rank), strict=True):
            dist.all_reduce(grad)
            param.grad = grad / WORKERS
        opt.step()
        ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})  # changed
        time.sleep(0.2)  # A real step takes longer; this gives the daemons time to replicate.
        marker = Path(config["events"]) / "killed"
        if rank == 1 and step == config["kill_at"] and not marker.exists():
            marker.touch()
            print(f"worker 1: saved step {step}, now killing myself (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 4 == 0:
            ckpt.report({"step": step})  # Ray's report (a barrier); no Ray checkpoint here
    ckpt.close()  # changed: publish the last save, then give the nodes back to the next run
    with open(Path(config["events"]) / f"{os.getpid()}-done.json", "w") as f:
        json.dump({"event": "done", "rank": rank, "digest": digest(model)}, f)


def reference_digest(steps: int) -> str:
    """The weights after ``steps`` uninterrupted steps of both workers, in one process."""
    model, opt = build()
    for step in range(1, steps + 1):
        per_rank = [gradients(model, step, rank) for rank in range(WORKERS)]
        for i, param in enumerate(model.parameters()):
            param.grad = (per_rank[0][i] + per_rank[1][i]) / WORKERS
        opt.step()
    return digest(model)


def run(work: Path, steps: int, kill_at: int) -> int:
    import ray
    from ray.cluster_utils import Cluster
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from mtc_replicator.demo.cluster import FAST
    from mtc_replicator.demo.single import Daemon, ram_disk, store_of, throwaway_tls
    from mtc_replicator.tools import certs

    backup, events = work / "backup", work / "events"
    events.mkdir(parents=True, exist_ok=True)
    ca = certs.new_ca()
    dirs = [ram_disk(work, f"ray-node{i}") for i in range(WORKERS)]
    daemons = [
        Daemon(d, backup, work / f"node{i}.log", (*FAST, *throwaway_tls(work, ca, f"node{i}")))
        for i, d in enumerate(dirs)
    ]
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    # Every node is given its IP: Ray's agents need not look this host up through DNS (slow
    # enough to fail the start where the hostname does not resolve and there is no route).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cluster = None
    try:
        for d in daemons:
            d.start()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "node_ip_address": HEAD_IP, "include_dashboard": False},
        )
        for i, d in enumerate(dirs):
            env = {"MTC_CHECKPOINT_DIR": str(d)}
            cluster.add_node(num_cpus=1, node_ip_address=f"127.0.0.{2 + i}", env_vars=env)
        ray.init(address=cluster.address, _node_ip_address=HEAD_IP)
        TorchTrainer(
            train_func,
            train_loop_config={"steps": steps, "kill_at": kill_at, "events": str(events)},
            scaling_config=ScalingConfig(num_workers=WORKERS, placement_strategy="STRICT_SPREAD"),
            run_config=RunConfig(
                name="ray-example",  # A stable name: the replicator's job name.
                storage_path=str(work / "ray"),
                failure_config=FailureConfig(max_failures=1),
            ),
        ).fit()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for d in daemons:
            d.stop()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(store_of(d), ignore_errors=True)
    return report(events, steps, kill_at)


def report(events: Path, steps: int, kill_at: int) -> int:
    seen = [json.loads(p.read_text()) for p in sorted(events.glob("*.json"))]
    restored = sorted((e["rank"], e["step"], e["source"]) for e in seen if e["event"] == "restored")
    for rank, step, source in restored:
        print(f"worker {rank}: resumed after step {step} from {source}")
    want = reference_digest(steps)
    finals = {e["digest"] for e in seen if e["event"] == "done"}
    print(f"final weights {sorted(finals)}; an uninterrupted run's: {want}")
    ok = [s for _, s, _ in restored] == [kill_at] * WORKERS and finals == {want}
    print("OK: both workers resumed from the RAM tier" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, help="keep logs here (default: a temp dir, removed)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at", type=int, default=8)
    a = p.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="mtc-ray-example-"))
    try:
        return run(work, a.steps, a.kill_at)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
