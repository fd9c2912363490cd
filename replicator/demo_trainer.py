"""The training job of ``mtc demo``: a small deterministic PyTorch loop using ``client/``.

Run as its own process. Every batch is derived from its step number, so a run resumed from
a checkpoint must reach bit-identical weights to an uninterrupted run: the demo checks it.
Prints one JSON object per line on stdout (events the orchestrator reads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import client

HIDDEN = 64


def build(seed: int = 0) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: Any, opt: Any, step: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(loss.detach())


def digest(model: Any) -> str:
    """sha256 over every parameter's bytes: equal digests mean identical weights."""
    h = hashlib.sha256()
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
    a = p.parse_args(argv)

    result = client.handshake(
        a.dir,
        job_name=a.job,
        framework="pytorch.distributed",
        node_rank=0,
        nodes=1,
        backup_interval_steps=a.backup_interval_steps,
        timeout=a.timeout,
        poll_interval=0.2,
    )
    model, opt = build()
    start = 1
    if result.step is not None and result.path is not None:
        state = client.load_state_dict(result.path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = result.step + 1
        emit(event="restored", step=result.step, source=result.source, digest=digest(model))
    else:
        emit(event="fresh")
    for step in range(start, a.steps + 1):
        train_step(model, opt, step)
        time.sleep(a.step_seconds)
        if step % a.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            client.save_state_dict(a.dir, step, state)
            emit(event="saved", step=step, digest=digest(model))
    emit(event="done", step=a.steps, digest=digest(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
