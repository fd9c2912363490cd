"""The training job of ``mtc demo``: a small deterministic PyTorch loop using
``mtc_replicator/client/``.

Run as its own process. Every batch is derived from its step number, so a run resumed from
a checkpoint must reach bit-identical weights to an uninterrupted run: the demo checks it.
Prints one JSON object per line on stdout (events the orchestrator reads).

With ``--nodes N`` (``mtc demo --nodes N``) it is rank ``--rank`` of an N-process job: each
rank draws its own batches, and with ``--dist-port`` the ranks form a gloo process group on
loopback and average their gradients with ``all_reduce`` (data parallelism). Each rank saves
its own checkpoint, tagged with its rank, so a restore of another rank's data is detected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

from mtc_replicator import client

HIDDEN = 64


def build(seed: int = 0) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: Any, opt: Any, step: int, rank: int = 0, world: int = 1) -> float:
    """One step on a batch derived from (step, rank); gradients averaged over ``world`` ranks."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step + 7919 * rank)
    x = torch.randn(32, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    if world > 1:
        import torch.distributed as dist

        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
    opt.step()
    return float(loss.detach())


def digest(model: Any, owner: int | None = None) -> str:
    """sha256 over every parameter's bytes (and the owning rank, if given)."""
    h = hashlib.sha256()
    if owner is not None:
        h.update(f"rank={owner};".encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def reference_digest(total_steps: int) -> str:
    """Weights after ``total_steps`` of uninterrupted training, for comparison."""
    model, opt = build()
    for step in range(1, total_steps + 1):
        train_step(model, opt, step)
    return digest(model)


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--job", default="demo")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--backup-interval-steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--step-seconds", type=float, default=0.0, help="pretend a step takes this long")
    p.add_argument("--rank", type=int, default=0, help="this process's rank = its node's rank")
    p.add_argument("--nodes", type=int, default=1, help="ranks (one per node) in the job")
    p.add_argument("--dist-port", type=int, default=0, help="gloo rendezvous port on 127.0.0.1")
    p.add_argument("--hang-after", type=int, default=0, help="after saving this step, wait to die")
    a = p.parse_args(argv)

    multi = a.nodes > 1
    fields: client.ConfigFields = {
        "job_name": a.job,
        "framework": "pytorch.distributed",
        "node_rank": a.rank,
        "nodes": a.nodes,
        "backup_interval_steps": a.backup_interval_steps,
    }
    # No peers_per_node: a multi-node job gets one peer by default, as docs/client.md says.
    result = client.handshake(a.dir, timeout=a.timeout, poll_interval=0.2, **fields)
    world = 1
    if multi and a.dist_port:
        import datetime

        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{a.dist_port}",
            rank=a.rank,
            world_size=a.nodes,
            timeout=datetime.timedelta(seconds=a.timeout),
        )
        world = a.nodes
    owner = a.rank if multi else None
    model, opt = build()
    start = 1
    if result.step is not None and result.path is not None:
        state = client.load_state_dict(result.path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = result.step + 1
        got_owner = int(state["rank"]) if multi else None
        emit(
            event="restored",
            step=result.step,
            source=result.source,
            digest=digest(model, got_owner),
            replica=digest(model),
        )
    else:
        emit(event="fresh")
    for step in range(start, a.steps + 1):
        train_step(model, opt, step, a.rank, world)
        time.sleep(a.step_seconds)
        if step % a.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            if multi:
                state["rank"] = a.rank
            client.save_state_dict(a.dir, step, state)
            emit(event="saved", step=step, digest=digest(model, owner))
            if step == a.hang_after:
                emit(event="hanging", step=step)
                while True:  # The orchestrator kills this process, as a node crash would.
                    time.sleep(60)
    emit(event="done", step=a.steps, digest=digest(model, owner), replica=digest(model))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
