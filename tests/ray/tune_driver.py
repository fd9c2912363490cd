"""A Ray Tune driver in a process of its own, so that a test can kill it (SIGKILL) as a
lost driver pod is lost: ``python -m tests.ray.tune_driver ADDRESS STORAGE EVENTS KIND``.
Tune's experiment state is saved every second. ``KIND``:

- ``function``: experiment ``restored``, two trials of ``train_loop.pbt_trial`` on
  ``TuneCheckpointer``;
- ``torch``: experiment ``restored-torch``, one trial of ``train_loop.tune_trial``, a
  ``TorchTrainer`` of two workers on ``RayCheckpointer(job_directory=True)``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HEAD_IP = "127.0.0.10"
TUNE_DRIVER = "tune-driver"
EXPERIMENTS = {"function": "restored", "torch": "restored-torch"}


def trainable(kind: str) -> Any:
    from ray import tune

    from tests.ray import train_loop

    if kind == "function":
        return tune.with_resources(train_loop.pbt_trial, {"cpu": 0.5})
    return tune.with_resources(train_loop.tune_trial, {"cpu": 0, TUNE_DRIVER: 1})


def param_space(kind: str, storage: str, events: str) -> dict[str, Any]:
    from ray import tune

    if kind == "function":
        return {
            "lr": tune.grid_search([1e-3, 3e-2]),
            "steps": 40,
            "events": events,
            "step_seconds": 0.2,
        }
    loop = {
        "steps": 30,
        "events": events,
        "dirs": os.environ["MTC_TEST_DIRS"].split(os.pathsep),
        "job_directory": True,
        "step_seconds": 0.3,
        "claim_lease_seconds": 0,
    }
    return {"trial": "r", "loop": loop, "storage": storage}


def main(argv: list[str]) -> int:
    import ray
    from ray import tune

    address, storage, events, kind = argv
    ray.init(address=address, _node_ip_address=HEAD_IP, log_to_driver=False)
    tuner = tune.Tuner(
        trainable(kind),
        param_space=param_space(kind, storage, events),
        run_config=tune.RunConfig(name=EXPERIMENTS[kind], storage_path=storage),
    )
    tuner.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
