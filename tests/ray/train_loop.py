"""The ``train_func`` of the Ray tests and its uninterrupted reference. Imported by Ray's
workers (this package is on their ``PYTHONPATH``), so it holds no pytest and no fixtures.

Every batch is derived from (step, world rank) and the gradients are averaged over the
workers, so a run resumed from any checkpoint must end with bit-identical weights to an
uninterrupted one. Each worker appends JSON events to ``<events>/<pid>.jsonl``; the test
reads them. ``kill_rank_at`` and ``hold_at`` act once per fit (a flag file each), after the
step was replicated to every node, so that the restart finds it on a peer too;
``ray_every`` makes every K-th save also a Ray checkpoint (at the next report, every 3
steps); ``save_at`` and ``report_at`` list the steps that save and report (default: every
step saves, every third reports); ``backup_every`` is the job's ``backup-interval-steps``;
``fail_at`` raises at that step (the job never closes); ``workers``: the job's worker
count (2; 1 for a one-node trial); ``exploit_from``: once trained, the
job is asked to continue
from that Ray checkpoint, as PopulationBasedTraining's exploit asks a trial (expected to be
refused). ``tune_trial`` is a Ray Tune trial that runs this ``train_func`` in a
``TorchTrainer`` of its own name, as docs/ray.md shows.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path, PurePosixPath
from typing import Any

from mtc_replicator.client.ray_train import RayCheckpointer, Restored
from mtc_replicator.core.storedir import default_store_dir

WORLD = 2


def build() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def gradients(model: Any, step: int, rank: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(1000 + step + 7919 * rank)
    x = torch.randn(16, 8, generator=gen)
    model.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def train_step(model: Any, opt: Any, step: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    grads = gradients(model, step, rank)
    for param, grad in zip(model.parameters(), grads, strict=True):
        if world > 1:
            dist.all_reduce(grad)
        param.grad = grad / world
    opt.step()


def digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def reference_digest(steps: int, world: int = WORLD) -> str:
    """The weights after ``steps`` uninterrupted steps of ``world`` workers, in one process
    (gloo's sum of two gradients is the same sum in either order)."""
    model, opt = build()
    for step in range(1, steps + 1):
        per_rank = [gradients(model, step, rank) for rank in range(world)]
        for i, param in enumerate(model.parameters()):
            total = per_rank[0][i]
            for grads in per_rank[1:]:
                total = total + grads[i]
            param.grad = total / world
        opt.step()
    return digest(model)


def replicated(dirs: list[str], job: str, step: int, nodes: int) -> bool:
    """Whether every node rank's item of ``step`` is committed on every node (home + peer)."""
    for d in dirs:
        store = Path(default_store_dir(PurePosixPath(d))) / "items" / job / str(step)
        if not all((store / f"{n}-0" / "MANIFEST.json").exists() for n in range(nodes)):
            return False
    return True


def wait_replicated(config: dict[str, Any], job: str, step: int) -> None:
    """Until every node holds every node rank's item of ``step`` (a one-worker job's one
    item: at home and as the pool copy on the other node)."""
    deadline = time.monotonic() + 60
    while not replicated(config["dirs"], job, step, config.get("workers", WORLD)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was not replicated to every node in 60 s")
        time.sleep(0.1)


def train_func(config: dict[str, Any]) -> None:
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    events = Path(config["events"]) / f"{os.getpid()}.jsonl"

    def emit(**event: object) -> None:
        event.update(
            rank=rank, pid=os.getpid(), dir=os.environ["MTC_CHECKPOINT_DIR"], t=time.time()
        )
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")

    ckpt = RayCheckpointer(
        mode=config.get("mode", "files"),
        backup_interval_steps=config.get("backup_every", 3),
        ray_checkpoint_every=config.get("ray_every", 0),
        claim_lease_seconds=config.get("claim_lease_seconds", 120.0),
        timeout=90,
        job_directory=config.get("job_directory", False),
    )
    model, opt = build()
    restored = _restore(ckpt, model, opt)
    start = 1
    if restored is None:
        model, opt = build()  # DCP's optimizer state dict initialized Adam's state: rebuild.
        emit(event="fresh")
    else:
        start = restored.step + 1
        emit(event="restored", step=restored.step, source=restored.source, digest=digest(model))
    if config.get("meet"):
        _meet(Path(config["events"]), config["meet"], rank)
    flag, killed = Path(config["events"]) / "acted", Path(config["events"]) / "killed"
    for step in range(start, config["steps"] + 1):
        if step == config.get("fail_at"):
            raise RuntimeError(f"failed at step {step}, as the test asked")
        train_step(model, opt, step, rank, world)
        if step in config.get("save_at", [step]):
            ckpt.save(step, _state(ckpt, model, opt))
            emit(event="saved-step", step=step)
        if step == config.get("hold_at") and not flag.exists():
            wait_replicated(config, ckpt.job, step)
            emit(event="holding", step=step)
            while True:  # The test kills this worker (or removes its Ray node).
                time.sleep(1)
        if [rank, step] == config.get("kill_rank_at") and not killed.exists():
            wait_replicated(config, ckpt.job, step)
            killed.touch()
            emit(event="killed", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(config.get("step_seconds", 0.15))
        if step in config.get("report_at", [step] if step % 3 == 0 else []):
            ckpt.report({"step": step})
    ckpt.close()  # the last save, written in the background, is published
    emit(event="done", step=config["steps"], digest=digest(model))
    if config.get("exploit_from"):
        _exploit(config["exploit_from"], emit)


def _meet(events: Path, trials: list[str], rank: int, timeout: float = 90.0) -> None:
    """Wait until the rank ``rank`` of every trial in ``trials`` has restored: the trials
    then run side by side on the same nodes (each Tune trial's events are ``<shared>/<trial>``)."""
    shared = events.parent
    (shared / f"met-{events.name}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((shared / f"met-{t}-{rank}").exists() for t in trials):
        if time.monotonic() > deadline:
            raise TimeoutError(f"trials {trials} never ran side by side within {timeout:g} s")
        time.sleep(0.1)


def _exploit(path: str, emit: Any) -> None:
    """PopulationBasedTraining's exploit as the trial's new worker would meet it: restore
    asked to continue from another trial's checkpoint while this job's own steps are on the
    nodes. The refusal is recorded (Ray truncates long errors), then raised."""
    import ray.train

    from mtc_replicator.client.ray_train import RayTrainRefused

    try:
        restored = RayCheckpointer(timeout=90).restore(checkpoint=ray.train.Checkpoint(path))
    except RayTrainRefused as exc:
        emit(event="refused", error=type(exc).__name__, message=str(exc))
        raise
    emit(event="exploited", step=None if restored is None else restored.step)


def _state(ckpt: RayCheckpointer, model: Any, opt: Any) -> dict[str, Any]:
    if ckpt.mode == "files":
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optimizer": optim_state}


def _restore(ckpt: RayCheckpointer, model: Any, opt: Any) -> Restored | None:
    """Files: load the worker's state dict. DCP: load in place into the FSDP-style state
    dicts (keyed by parameter names), then set them on the model and the optimizer."""
    if ckpt.mode == "files":
        restored = ckpt.restore()
        if restored is not None:
            model.load_state_dict(restored.state["model"])
            opt.load_state_dict(restored.state["optimizer"])
        return restored
    from torch.distributed.checkpoint.state_dict import set_state_dict

    restored = ckpt.restore(_state(ckpt, model, opt))
    if restored is not None:
        set_state_dict(
            model,
            opt,
            model_state_dict=restored.state["model"],
            optim_state_dict=restored.state["optimizer"],
        )
    return restored


def tune_trial(config: dict[str, Any]) -> None:
    """A Ray Tune trial: one ``TorchTrainer`` of ``train_func`` under the stable run name
    ``tune-<trial>``, its own job; its Ray checkpoint's path goes to ``<events>/<trial>``.
    ``config["exploits"]`` maps a trial to an earlier one whose checkpoint it is then asked
    to continue from (the path travels through ``train_loop_config``, as the checkpoint
    ``tune.get_checkpoint()`` hands an exploited trial would)."""
    from ray import tune
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trial, shared = config["trial"], Path(config["loop"]["events"])
    loop = {**config["loop"], "events": str(shared / trial)}
    (shared / trial).mkdir(exist_ok=True)  # a restored experiment runs the trial again
    donor = config.get("exploits", {}).get(trial)
    if donor:
        loop["exploit_from"] = (shared / f"{donor}.checkpoint").read_text()
    result = TorchTrainer(
        train_func,
        train_loop_config=loop,
        scaling_config=ScalingConfig(
            num_workers=loop.get("workers", WORLD),
            placement_strategy="STRICT_SPREAD",
            resources_per_worker={"CPU": config.get("worker_cpus", 1)},
        ),
        run_config=RunConfig(
            name=f"tune-{trial}",
            storage_path=config["storage"],
            failure_config=FailureConfig(max_failures=config.get("max_failures", 0)),
        ),
    ).fit()
    if result.checkpoint is not None:
        (shared / f"{trial}.checkpoint").write_text(result.checkpoint.path)
    tune.report({"trained": 1})


def _score(model: Any) -> float:
    """Higher is better: the negative loss on a fixed batch (PopulationBasedTraining's metric)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 8, generator=gen)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
    return -float(loss)


def pbt_trial(config: dict[str, Any]) -> None:
    """A Ray Tune trial of the function API on ``TuneCheckpointer``: one process, saves every
    step to the RAM tier and reports every step with a pointer checkpoint. Events, per
    process in ``<events>/<pid>.jsonl``: ``entry``, ``saved`` (job, step, digest of the state) and
    ``restored`` (job, step, source, the donor's job under an exploit, digest)."""
    from ray import tune

    from mtc_replicator.client.ray_tune import TuneCheckpointer

    events = Path(config["events"]) / f"{os.getpid()}.jsonl"

    def emit(**event: object) -> None:
        event.update(pid=os.getpid(), dir=os.environ["MTC_CHECKPOINT_DIR"], t=time.time())
        with events.open("a") as f:
            f.write(json.dumps(event) + "\n")

    ckpt = TuneCheckpointer(backup_interval_steps=100, timeout=90)
    emit(event="entry", job=ckpt.job, step=None)
    restored = ckpt.restore(tune.get_checkpoint())
    model, opt = build()
    start = 1
    if restored is not None:
        model.load_state_dict(restored.state["model"])
        opt.load_state_dict(restored.state["optimizer"])
        start = restored.step + 1
        emit(
            event="restored",
            job=ckpt.job,
            step=restored.step,
            source=restored.source,
            continued_from=restored.continued_from,
            digest=digest(model),
        )
    for group in opt.param_groups:
        group["lr"] = config["lr"]
    for step in range(start, config["steps"] + 1):
        train_step(model, opt, step, 0, 1)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        ckpt.save(step, state)
        emit(event="saved", job=ckpt.job, step=step, digest=digest(model))
        time.sleep(config.get("step_seconds", 0.2))
        ckpt.report({"score": _score(model) + config.get("score_bias", 0.0), "step": step})
    ckpt.close()
