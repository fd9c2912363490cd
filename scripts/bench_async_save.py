"""What a save stalls the training loop for: asynchronous vs synchronous, beside the floor.

One run, one state (``--size-mib`` in ``--tensors`` float32 tensors on ``--device``), every
figure the median of ``--rounds`` interleaved rounds:

- stall of ``torch.save(state, file)`` to tmpfs (``--dir``, default /dev/shm);
- stall of today's synchronous save, ``client.save_state_dict`` (temp dir, fsync, rename);
- stall of the asynchronous save, ``client.AsyncSaver.save_state_dict`` (the call's return;
  the first save, which allocates the staging buffers, is reported apart), and its write
  (from the call to the published step) as a rate;
- the floor: a plain copy of the same tensors into preallocated memory (CPU: ``copy_`` into
  buffers allocated and touched beforehand; CUDA: the device-to-host copy into pinned
  buffers, ``non_blocking``, then a synchronize). On CUDA the asynchronous save's stall is
  measured until the device is free again (its copies run on a side stream that the loop's
  stream waits for), and its host return is shown beside it;
- interference: the step time of a compute loop (matrix multiplies on ``--device``)
  without a save, and while an asynchronous save is being written in the background
  (``--quiet-steps`` steps, then steps until a save is written, per round);
- unless ``--no-daemon``: a real daemon (``python -m mtc_replicator.node.daemon``) on its
  own CHECKPOINT_DIR under ``--dir``; the seconds from the save's call to the step being
  committed in the daemon's store.

Targets (the verdict lines): asynchronous stall at most 0.3x the synchronous save and at
most 1.5x the floor. ``--no-daemon`` imports torch, PyYAML and ``mtc_replicator.client``
only (a GPU machine without the daemon's dependencies runs it).

    .venv/bin/python scripts/bench_async_save.py --size-mib 1024
    python scripts/bench_async_save.py --device cuda --no-daemon --size-mib 1024

Numbers are only comparable within one run: other work on the box moves them. The copies
(staging, the floor) use torch's intra-op threads; on cores other work keeps busy a
parallel copy waits for its slowest thread, so ``--threads 1`` gives steadier figures there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mtc_replicator.client import AsyncSaver, save_state_dict

ROOT = Path(__file__).resolve().parent.parent


def make_state(size_mib: int, tensors: int, device: str) -> dict[str, Any]:
    numel = (size_mib << 20) // 4 // tensors
    return {
        f"layer{i}.weight": torch.full((numel,), float(i), device=device) for i in range(tensors)
    }


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Floor:
    """The plain copy of the state into buffers allocated (and touched) beforehand."""

    def __init__(self, state: dict[str, Any], device: str) -> None:
        pin = device == "cuda"
        self.pairs = [
            (torch.empty(t.shape, dtype=t.dtype, pin_memory=pin), t) for t in state.values()
        ]
        self.device = device
        self()  # fault the pages in

    def __call__(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src, non_blocking=self.device == "cuda")
        sync(self.device)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Compute:
    """A stand-in training step: matrix multiplies on the device."""

    def __init__(self, device: str) -> None:
        n = 4096 if device == "cuda" else 384
        self.a = torch.rand(n, n, device=device)
        self.b = torch.rand(n, n, device=device)
        self.repeat = 40 if device == "cuda" else 6
        self.device = device

    def step(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.repeat):
            self.a = torch.tanh(self.a @ self.b)
        sync(self.device)
        return time.perf_counter() - t0


def saves_round(
    a: argparse.Namespace,
    state: dict[str, Any],
    ram: Path,
    saver: AsyncSaver,
    floor: Floor,
    *,
    step: int,
) -> dict[str, float]:
    """One interleaved round: torch.save, the synchronous save, the floor, the asynchronous
    save (the floor just before or just after it, alternately: the same conditions)."""
    out: dict[str, float] = {}
    path = ram / "plain.pt"
    sync(a.device)
    out["torch.save"] = timed(lambda: torch.save(state, path))
    path.unlink()
    sync(a.device)
    out["sync"] = timed(lambda: save_state_dict(ram, step, state))
    shutil.rmtree(ram / str(step))
    sync(a.device)
    floor_first = step % 4 == 1  # alternate which of the two goes first
    if floor_first:
        out["floor"] = timed(floor)
    t0 = time.perf_counter()
    pending = saver.save_state_dict(step + 1, state)
    out["async"] = time.perf_counter() - t0
    sync(a.device)  # CUDA: the loop's stream waits for the snapshot's copies
    out["async until device free"] = time.perf_counter() - t0
    assert pending is not None
    pending.wait()
    out["async write"] = time.perf_counter() - t0
    shutil.rmtree(ram / str(step + 1))
    if not floor_first:
        out["floor"] = timed(floor)
    return out


def interference(
    a: argparse.Namespace, state: dict[str, Any], ram: Path, saver: AsyncSaver
) -> tuple[list[float], list[float]]:
    """Compute step times without a save, and while one is being written."""
    compute = Compute(a.device)
    for _ in range(3):
        compute.step()  # warm-up
    quiet: list[float] = []
    busy: list[float] = []
    for r in range(a.rounds):  # quiet steps, then steps during a write, interleaved
        quiet.extend(compute.step() for _ in range(a.quiet_steps))
        step = 1000 + r
        pending = saver.save_state_dict(step, state)
        assert pending is not None
        while not pending.done():
            busy.append(compute.step())
        pending.wait()
        shutil.rmtree(ram / str(step))
    return quiet, busy


def daemon_rounds(a: argparse.Namespace, state: dict[str, Any], base: Path) -> list[float]:
    """Seconds from the save's call to the step committed in a real daemon's store."""
    sys.path.insert(0, str(ROOT))
    from mtc_replicator import client
    from tests.daemon_process import DaemonProcess
    from tests.integration.helpers import FAST_ARGS, item_dir

    ckpt = base / "node0" / "checkpoint"
    ckpt.mkdir(parents=True)
    job = f"bench-{uuid.uuid4().hex[:6]}"
    daemon = DaemonProcess(ckpt, extra_args=FAST_ARGS, log_path=base / "daemon.log").start()
    times: list[float] = []
    try:
        client.handshake(
            ckpt, job_name=job, framework="pytorch.distributed", node_rank=0, nodes=1, timeout=60
        )
        with AsyncSaver(ckpt) as saver:
            for r in range(a.daemon_rounds):
                step = 10 + r
                manifest = item_dir(ckpt, job, step) / "MANIFEST.json"
                t0 = time.perf_counter()
                saver.save_state_dict(step, state)
                deadline = t0 + 120
                while not manifest.is_file():
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"the daemon never took step {step}: {daemon.log()}")
                    time.sleep(0.002)
                times.append(time.perf_counter() - t0)
    finally:
        daemon.stop()
    return times


@contextmanager
def workspace(parent: str) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="bench-async-", dir=parent))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def med(values: list[float]) -> float:
    return statistics.median(values)


def report(
    a: argparse.Namespace,
    rounds: list[dict[str, float]],
    first: float,
    loops: tuple[list[float], list[float]],
    daemon: list[float] | None,
) -> bool:
    gib = a.size_mib / 1024
    cuda = a.device == "cuda"
    where = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores"
    print(
        f"\nasync save: {a.size_mib} MiB in {a.tensors} float32 tensors on {a.device} ({where}), "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), {a.rounds} rounds, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    column = {k: med([r[k] for r in rounds]) for k in rounds[0]}
    stall = column["async until device free"] if cuda else column["async"]
    base = column["floor"]
    sync_save = column["sync"]
    rows = [
        ("torch.save to tmpfs", column["torch.save"]),
        ("synchronous save (save_state_dict)", sync_save),
        ("async save: first (allocates staging)", first),
        ("async save: stall" + (" until device free" if cuda else ""), stall),
    ]
    if cuda:
        rows.append(("async save: host return", column["async"]))
    rows.append(("D2H copy into pinned (floor)" if cuda else "plain copy (floor)", base))
    print(f"{'stall of the loop per save':40} {'seconds':>8} {'GiB/s':>7} {'x floor':>8}")
    for name, secs in rows:
        print(f"{name:40} {secs:8.3f} {gib / secs:7.2f} {secs / base:8.2f}")
    write = column["async write"]
    print(f"{'async write, call to published':40} {write:8.3f} {gib / write:7.2f}")
    quiet, busy = loops
    q, b = med(quiet), med(busy) if busy else float("nan")
    print(f"compute step: {q:.4f} s alone, {b:.4f} s while a save is written ({b / q:.2f}x)")
    if daemon is not None:
        print(f"save call to the step in the daemon's store: {med(daemon):.3f} s (median)")
    ok_sync = stall <= 0.3 * sync_save
    ok_floor = stall <= 1.5 * base
    print(f"target stall <= 0.3x synchronous save: {stall / sync_save:.2f}x {_verdict(ok_sync)}")
    print(f"target stall <= 1.5x the floor: {stall / base:.2f}x {_verdict(ok_floor)}")
    return ok_sync and ok_floor


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dir", default="/dev/shm", help="a tmpfs to write into")  # noqa: S108
    p.add_argument("--no-daemon", action="store_true", help="skip the real daemon's figure")
    p.add_argument("--daemon-rounds", type=int, default=3)
    p.add_argument("--quiet-steps", type=int, default=4, help="per round, without a save")
    p.add_argument(
        "--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)"
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")
    if a.threads:
        torch.set_num_threads(a.threads)
    state = make_state(a.size_mib, a.tensors, a.device)
    with workspace(a.dir) as base:
        ram = base / "ckpt"
        ram.mkdir()
        floor = Floor(state, a.device)
        with AsyncSaver(ram) as saver:
            sync(a.device)
            t0 = time.perf_counter()
            saver.save_state_dict(0, state)
            sync(a.device)
            first = time.perf_counter() - t0
            saver.wait()
            shutil.rmtree(ram / "0")
            rounds = [
                saves_round(a, state, ram, saver, floor, step=2 * r + 1) for r in range(a.rounds)
            ]
            loops = interference(a, state, ram, saver)
        del floor
        daemon = None if a.no_daemon else daemon_rounds(a, state, base)
    met = report(a, rounds, first, loops, daemon)
    return 0 if met or not a.strict else 1


if __name__ == "__main__":
    raise SystemExit(main())
