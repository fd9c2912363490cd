"""``TuneCheckpointer`` against a real daemon, without a Ray cluster (the checkpoints Tune
would hand a trial are built as ``ray.train.Checkpoint`` of directories written here):

- a trial saves (in the background), restarts with its own checkpoint and loads its newest
  step exactly;
- handed another trial's checkpoint of its experiment (PopulationBasedTraining's exploit),
  it continues as a new job from the donor's step, and a restart of that continued trial
  restores its own steps, not the donor's again;
- a checkpoint of another experiment, or one ``report`` did not write, is refused before
  any handshake: ``ForeignCheckpoint``, nothing loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtc_replicator.client.ray_checkpoint import RAY_META_FILE
from mtc_replicator.client.ray_tune import POINTER_MODE, TuneCheckpointer
from mtc_replicator.core.raytrain import ForeignCheckpoint, RayMeta
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import running_daemon

pytestmark = pytest.mark.integration

EXPERIMENT = "sweep"


def _checkpoint(root: Path, job: str, step: int, experiment: str = EXPERIMENT) -> object:
    """What ``TuneCheckpointer.report`` hands Tune, as Tune hands it back."""
    from ray.train import Checkpoint

    where = root / f"{job}-{step}-{experiment}"
    where.mkdir(parents=True)
    meta = RayMeta(step, 1, POINTER_MODE, job, experiment)
    (where / RAY_META_FILE).write_text(json.dumps(meta.to_json()))
    return Checkpoint.from_directory(str(where))


def _trial(ckpt_dir: Path, name: str) -> TuneCheckpointer:
    return TuneCheckpointer(
        checkpoint_dir=ckpt_dir, job_name=name, experiment=EXPERIMENT, timeout=30
    )


def _state(step: int, seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(seed * 1000 + step))}


@pytest.fixture
def daemon(tmp_path: Path) -> DaemonProcess:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with running_daemon(ckpt) as d:
        yield d


def test_a_trial_restores_its_own_step_and_continues_from_another_trials(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    ckpt = daemon.checkpoint_dir
    donor = _trial(ckpt, "sweep-b")
    assert donor.restore(None) is None
    for step in (1, 2, 3):
        donor.save(step, _state(step, seed=2))
        if step == 2:  # what its report of step 2 writes (report needs a Tune session)
            (donor.directory / "replicator.keep").write_text("2\n")
    donor.close()  # the save in flight written, the job drained

    again = _trial(ckpt, "sweep-b")
    restored = again.restore(_checkpoint(tmp_path, "sweep-b", 2))
    assert restored is not None
    assert restored.step == 3  # newer than Tune's checkpoint: the RAM tier's newest
    assert torch.equal(restored.state["w"], _state(3, seed=2)["w"])
    assert restored.continued_from is None
    assert again.job == "sweep-b"
    again.close()

    trial = _trial(ckpt, "sweep-a")
    restored = trial.restore(_checkpoint(tmp_path / "pbt", "sweep-b", 2))
    assert restored is not None
    assert (restored.step, restored.continued_from) == (2, "sweep-b")
    assert torch.equal(restored.state["w"], _state(2, seed=2)["w"])
    assert trial.job.startswith("sweep-a.x")
    trial.save(3, _state(3, seed=1))
    trial.close()

    # Restarted before its next report: Tune still hands it the donor's checkpoint, and it
    # finds its own step 3 under the same continued name, not the donor's step 2.
    restart = _trial(ckpt, "sweep-a")
    restored = restart.restore(_checkpoint(tmp_path / "again", "sweep-b", 2))
    assert restored is not None
    assert restart.job == trial.job
    assert restored.step == 3
    assert torch.equal(restored.state["w"], _state(3, seed=1)["w"])
    restart.close()


def test_a_checkpoint_of_another_experiment_or_not_ours_is_refused(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    from ray.train import Checkpoint

    ckpt = daemon.checkpoint_dir
    trial = _trial(ckpt, "sweep-a")
    with pytest.raises(ForeignCheckpoint, match="only from a trial of its own experiment"):
        trial.restore(_checkpoint(tmp_path, "other-b", 2, experiment="other"))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.pt").write_bytes(b"not ours")
    with pytest.raises(ForeignCheckpoint, match=r"TuneCheckpointer\.report did not write"):
        trial.restore(Checkpoint.from_directory(str(plain)))
    assert not (ckpt / "jobs").exists()  # no handshake was made
