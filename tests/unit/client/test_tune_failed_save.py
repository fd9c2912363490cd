"""``TuneCheckpointer`` must never name a step whose asynchronous save FAILED in
a Tune checkpoint (nor keep it in ``replicator.keep``): that step is not on the RAM disk.
The failure is raised once (``AsyncSaveError``); a trial that catches it and goes on must
not have the failed step counted as published afterwards."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.tune")

import torch
from ray import tune

from mtc_replicator.client import AsyncSaveError, AsyncSaver
from mtc_replicator.client.ray_tune import TuneCheckpointer


class FailFirstThenHold:
    """A phase hook: the first save fails at its rename, later ones wait at theirs."""

    def __init__(self) -> None:
        self.renames = 0
        self.release = threading.Event()

    def __call__(self, phase: str) -> None:
        if phase != "rename":
            return
        self.renames += 1
        if self.renames == 1:
            raise OSError("injected: the first save fails")
        assert self.release.wait(30)


@pytest.fixture
def reported(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    steps: list[int | None] = []

    def report(metrics: Any, checkpoint: Any = None) -> None:
        if checkpoint is None:
            steps.append(None)
        else:
            meta = json.loads((Path(checkpoint.path) / "mtc-ray.json").read_text())
            steps.append(meta["step"])

    monkeypatch.setattr(tune, "report", report)
    return steps


def make(tmp_path: Path, hook: FailFirstThenHold) -> TuneCheckpointer:
    ckpt = TuneCheckpointer(checkpoint_dir=tmp_path, job_name="t1", experiment="e")
    ckpt.directory.mkdir(parents=True)
    ckpt._saver = AsyncSaver(ckpt.directory, phase_hook=hook)
    return ckpt


def state() -> dict[str, Any]:
    return {"w": torch.ones(16)}


def test_a_report_after_a_caught_failure_names_no_failed_step(
    tmp_path: Path, reported: list[int | None]
) -> None:
    hook = FailFirstThenHold()
    ckpt = make(tmp_path, hook)
    ckpt.save(1, state())
    assert ckpt._saver._job.join(30)  # type: ignore[union-attr]  # step 1 failed
    with pytest.raises(AsyncSaveError):
        ckpt.report({"loss": 1.0})
    ckpt.report({"loss": 1.0})  # the trial caught it and goes on
    assert reported == [None], "a Tune checkpoint named step 1, whose save failed"
    keep = ckpt.directory / "replicator.keep"
    assert not keep.exists() or "1" not in keep.read_text().split()
    hook.release.set()


def test_a_save_after_a_caught_failure_does_not_count_the_failed_step(
    tmp_path: Path, reported: list[int | None]
) -> None:
    hook = FailFirstThenHold()
    ckpt = make(tmp_path, hook)
    ckpt.save(1, state())
    with pytest.raises(AsyncSaveError) as failure:
        ckpt.save(2, state())  # waits for step 1, raises its failure
    assert failure.value.step == 1
    ckpt.save(3, state())  # the trial caught it and goes on; step 3 is being written
    ckpt.report({"loss": 1.0})
    assert reported == [None], "a Tune checkpoint named step 1, whose save failed"
    hook.release.set()
    ckpt._saver.wait(30)  # type: ignore[union-attr]
    ckpt.report({"loss": 1.0})
    assert reported == [None, 3]
    assert (ckpt.directory / "replicator.keep").read_text().split() == ["3"]
