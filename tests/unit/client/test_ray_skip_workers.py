"""``RayCheckpointer(when_busy="skip")`` with several workers let each worker
decide alone whether to skip a save. A slow worker skipped step N that the others saved:
the node got an incomplete step N (not all ``workers-per-node`` ``.save`` files), and the
next Ray checkpoint merged rank files of different steps under rank 0's step. Skipping
must be decided alike on every worker; as ``AsyncSaver`` does for DCP, a job of several
workers waits instead."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.client import async_save
from mtc_replicator.client import ray_train as ray_train_mod
from mtc_replicator.client.ray_train import RAY_META_FILE, RayCheckpointer, _Session
from mtc_replicator.core.raytrain import WorkerPlace, layout_of

torch = pytest.importorskip("torch")


def test_workers_of_one_job_never_skip_different_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray.train

    places = [
        WorkerPlace(world_rank=r, local_rank=r, local_world_size=2, node_rank=0) for r in (0, 1)
    ]
    layout = layout_of(places, 2)
    ckpts = []
    for place in places:
        ckpt = RayCheckpointer(tmp_path, when_busy="skip", ray_checkpoint_every=1)
        ckpt._session = _Session(ckpt, tmp_path, place, layout, "trial-a", None, None)
        ckpts.append(ckpt)

    release = threading.Event()
    made: list[int] = []

    def saver(directory: Any, **kwargs: Any) -> async_save.AsyncSaver:
        made.append(1)
        slow = len(made) == 1  # worker 0's writes are slow

        def hook(phase: str) -> None:
            if slow and phase == "write":
                assert release.wait(30)

        return async_save.AsyncSaver(directory, phase_hook=hook, **kwargs)

    monkeypatch.setattr(ray_train_mod, "AsyncSaver", saver)
    seen: list[tuple[str, int]] = []

    def report(metrics: Any, checkpoint: Any = None) -> None:
        path = Path(checkpoint.path)
        if (path / RAY_META_FILE).exists():
            seen.append(("meta", json.loads((path / RAY_META_FILE).read_text())["step"]))
        for f in path.glob("rank-*.pt"):
            seen.append((f.name, int(torch.load(f)["step"])))

    monkeypatch.setattr(ray.train, "report", report)
    timer = threading.Timer(0.5, release.set)  # worker 0's step 1 lands half a second late
    timer.start()
    try:
        for step in (1, 2):
            for ckpt in ckpts:
                ckpt.save(step, {"w": torch.full((4,), float(step)), "step": step})
            ckpts[1].wait(30)  # worker 1 is fast: its save is done before the next
        for ckpt in ckpts:
            ckpt.wait(30)
        for ckpt in ckpts:
            ckpt.report({"loss": 0.0})
    finally:
        release.set()
        timer.cancel()
        for ckpt in ckpts:
            ckpt.close()
    saved = sorted(p.name for p in tmp_path.glob("*.save"))
    assert saved == [f"trial-a-s{s}-n0-w{w}.save" for s in (1, 2) for w in (0, 1)], (
        "a step saved by some workers of the node only"
    )
    assert sorted(seen) == [("meta", 2), ("rank-0.pt", 2), ("rank-1.pt", 2)], (
        "a Ray checkpoint mixing steps"
    )
