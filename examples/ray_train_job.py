"""Ray Train on the replicator, on a KubeRay cluster: the RayJob's entrypoint.

Unlike ``examples/ray_train.py`` (one machine: it starts its own daemons and Ray cluster),
this runs against the Ray cluster KubeRay made (``ray.init()`` finds it) and the
replicator DaemonSet already on its nodes: each worker pod mounts the RAM disk at
``$MTC_CHECKPOINT_DIR`` (deploy/examples/rayjob.yaml). One Ray Train worker per worker pod,
``STRICT_SPREAD`` so each lands on its own node; the run name is the replicator's job name
and must be the same at every retry of the job. A small model stands in for yours: replace
``build`` and the step, keep the lines marked ``changed`` (docs/ray.md).

    python examples/ray_train_job.py --workers 4 --steps 1000 --storage-path /mnt/shared/ray
"""

from __future__ import annotations

import argparse
from typing import Any


def build() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_func(config: dict[str, Any]) -> None:
    import torch
    from ray.train.torch import prepare_model

    from mtc_replicator.client import RayCheckpointer

    model, opt = build()
    model = prepare_model(model)
    ckpt = RayCheckpointer(backup_interval_steps=config["backup_every"])  # changed
    restored = ckpt.restore()  # changed
    start = 1
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
        start = restored.step + 1  # changed
    for step in range(start, config["steps"] + 1):
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % config["save_every"] == 0:
            ckpt.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})  # changed
        if step % config["report_every"] == 0:
            ckpt.report({"step": step, "loss": loss.item()})
    ckpt.close()  # changed: publish the last save, then give the nodes back to the next run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--name", default="llm-train", help="the run's and the replicator's job name")
    p.add_argument("--workers", type=int, default=4, help="one per worker pod (and node)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=10, help="steps between RAM-disk saves")
    p.add_argument("--report-every", type=int, default=50, help="steps between Ray reports")
    p.add_argument("--backup-every", type=int, default=100, help="steps between backups")
    p.add_argument("--storage-path", help="Ray's storage_path: storage every node sees")
    p.add_argument("--max-failures", type=int, default=3)
    a = p.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init()
    TorchTrainer(
        train_func,
        train_loop_config={
            "steps": a.steps,
            "save_every": a.save_every,
            "report_every": a.report_every,
            "backup_every": a.backup_every,
        },
        scaling_config=ScalingConfig(num_workers=a.workers, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(
            name=a.name,
            storage_path=a.storage_path,
            failure_config=FailureConfig(max_failures=a.max_failures),
        ),
    ).fit()


if __name__ == "__main__":
    main()
