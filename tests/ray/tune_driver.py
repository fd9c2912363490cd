"""A Ray Tune driver in a process of its own, so that a test can kill it (SIGKILL) as a
lost driver pod is lost: ``python -m tests.ray.tune_driver ADDRESS STORAGE EVENTS``. It
runs two trials of ``train_loop.pbt_trial`` on ``TuneCheckpointer`` under the experiment
name ``restored``, saving Tune's experiment state every second."""

from __future__ import annotations

import os
import sys

HEAD_IP = "127.0.0.10"


def tuner_for(storage: str, events: str) -> object:
    from ray import tune

    from tests.ray import train_loop

    return tune.Tuner(
        tune.with_resources(train_loop.pbt_trial, {"cpu": 0.5}),
        param_space={
            "lr": tune.grid_search([1e-3, 3e-2]),
            "steps": 40,
            "events": events,
            "step_seconds": 0.2,
        },
        run_config=tune.RunConfig(name="restored", storage_path=storage),
    )


def main(argv: list[str]) -> int:
    import ray

    address, storage, events = argv
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "1")
    ray.init(address=address, _node_ip_address=HEAD_IP, log_to_driver=False)
    tuner = tuner_for(storage, events)
    tuner.fit()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
