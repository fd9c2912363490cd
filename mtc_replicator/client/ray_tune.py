"""Ray Tune trials of the function API on the replicator: ``TuneCheckpointer``.

A trial of the function API is one process: the trial's own job (one node, one worker) in
its own job directory, ``CHECKPOINT_DIR/jobs/<job>/``, so that any number of trials share
a node. ``save`` puts a step on the node's RAM disk (the daemon replicates it to another
node of the pool and backs it up); ``report`` hands Tune its metrics and a checkpoint of a
few bytes that names the trial's job and newest step (``mtc-ray.json``), never the state:
Tune's ``storage_path`` syncs no weights. ``restore(tune.get_checkpoint())`` then loads:

- the trial's own newest step, wherever Tune restarted it (a failure, a scheduler's pause,
  ``Tuner.restore`` after the driver was lost): from the node's RAM disk, the trial's pool
  copy on another node, or the bucket, as the daemon finds it;
- another trial's step, when PopulationBasedTraining's exploit hands it that trial's
  checkpoint: the trial continues as a new job, ``<job>.x<hash>``, whose handshake names
  the donor's job and step (``continue-from-job``, ``continue-from-step``), and the daemon
  brings that step from the fastest tier that holds it (``cluster.donor``). Only a
  checkpoint of the same Tune experiment is taken; the daemon takes only bytes attested
  for the trial's namespace.

Imports Ray and torch only when it runs (``ray.tune``'s context; ``torch.save``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtc_replicator.client import torch_io
from mtc_replicator.client.async_save import AsyncSaver, PendingSave
from mtc_replicator.client.finish import finish_job
from mtc_replicator.client.handshake import DEFAULT_TIMEOUT, handshake
from mtc_replicator.client.ray_checkpoint import RAY_META_FILE, read_meta
from mtc_replicator.core import raytrain
from mtc_replicator.core.contract import (
    JOB_DIRS,
    KEEP_FILE,
    MAX_KEPT_STEPS,
    BackupInterval,
    ContinueFrom,
    Framework,
    JobConfig,
)
from mtc_replicator.core.raytrain import ForeignCheckpoint, RayMeta

log = logging.getLogger(__name__)

POINTER_MODE = "replicator"
"""``mtc-ray.json``'s mode in a checkpoint that holds no state, only the step's name."""


@dataclass(frozen=True)
class TuneRestored:
    """What ``TuneCheckpointer.restore`` loaded."""

    step: int
    """The last step the state holds; train from ``step + 1``."""
    state: dict[str, Any]
    source: str
    """Where the daemon found it: ``local``, ``peer`` or ``backup``."""
    continued_from: str | None = None
    """The donor trial's job, when this restore continued another trial's step (an exploit)."""


class TuneCheckpointer:
    """Checkpoints one Ray Tune trial (function API) through its node's replicator."""

    def __init__(
        self,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        backup_interval_steps: int | None = None,
        backup_interval_minutes: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        job_name: str | None = None,
        experiment: str | None = None,
        keep_reported: int = 4,
        asynchronous: bool = True,
    ) -> None:
        """``checkpoint_dir``: the node's CHECKPOINT_DIR (default ``$MTC_CHECKPOINT_DIR``).
        ``job_name`` and ``experiment``: default the trial's experiment and id, as
        ``ray.tune.get_context()`` tells them (stable across ``Tuner.restore``).
        ``keep_reported``: the steps of this many latest reports stay on the RAM disk
        whatever the daemon's ``--keep-steps`` (1-16): Tune may hand any of them out, and
        PopulationBasedTraining clones the checkpoint of a trial's last perturbation, so
        keep at least ``perturbation_interval + 1``. ``asynchronous``: ``save`` returns once
        the state is copied to host staging buffers (``AsyncSaver``) and the file is written
        meanwhile; a report then names the newest step already on the RAM disk."""
        if not 1 <= keep_reported <= MAX_KEPT_STEPS:
            raise ValueError(f"keep_reported must be 1-{MAX_KEPT_STEPS}, not {keep_reported}")
        self.keep_reported = keep_reported
        self.asynchronous = asynchronous
        self._saver: AsyncSaver | None = None
        self._pending: PendingSave | None = None
        self.root = _checkpoint_dir(checkpoint_dir)
        self.timeout = timeout
        self.interval = (
            BackupInterval(steps=backup_interval_steps)
            if backup_interval_steps is not None
            else BackupInterval(minutes=backup_interval_minutes)
        )
        if job_name is None or experiment is None:
            from ray import tune

            context = tune.get_context()
            experiment = experiment or context.get_experiment_name()
            job_name = job_name or raytrain.tune_job_name(experiment, context.get_trial_id())
        self.experiment: str = experiment
        self.base: str = job_name
        """The trial's own name; its job is this, or this continued from a donor's step."""
        self.job: str = job_name
        self._newest: int | None = None
        self._reported: list[int] = []

    @property
    def directory(self) -> Path:
        return self.root / JOB_DIRS / self.job

    def restore(self, checkpoint: Any = None) -> TuneRestored | None:
        """Hand the trial to the node's replicator and load what it offers; None on a fresh
        start. ``checkpoint``: ``tune.get_checkpoint()``, the trial's own or (an exploit)
        another trial's; a checkpoint ``report`` did not write raises ``ForeignCheckpoint``."""
        meta = None if checkpoint is None else read_meta(checkpoint)
        where = str(getattr(checkpoint, "path", checkpoint))
        continued = None if checkpoint is None else self._job_for(meta, where)
        config = JobConfig(
            job_name=self.job,
            framework=Framework.PYTORCH,
            node_rank=0,
            nodes=1,
            backup_interval=self.interval,
            continue_from=continued,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self._reported = _kept(self.directory / KEEP_FILE)  # an earlier process's reports
        result = handshake(self.directory, config, timeout=self.timeout)
        if result.step is None or result.path is None:
            if meta is not None:
                raise ForeignCheckpoint(
                    f"trial {self.base!r} was asked to continue from step {meta.step} of job "
                    f"{meta.job!r}, and the replicator found no step of job {self.job!r} "
                    "(its RAM disks, its pool copy and the bucket lost it): nothing was loaded"
                )
            return None
        if meta is not None and continued is None and result.step < meta.step:
            log.warning(
                "trial %s: Tune's checkpoint names step %d, but the replicator holds step %d "
                "of job %s at the newest (the newer one was lost with every copy): training "
                "goes on from step %d",
                self.base,
                meta.step,
                result.step,
                self.job,
                result.step,
                extra={"job": self.job},
            )
        self._newest = result.step
        state = torch_io.load_state_dict(result.path)
        donor = None if continued is None else continued.job
        return TuneRestored(result.step, state, result.source or "unknown", donor)

    def _job_for(self, meta: RayMeta | None, where: str) -> ContinueFrom | None:
        """The job this trial runs as, given the checkpoint Tune handed it; the donor's step
        when that checkpoint is another trial's."""
        if meta is None or meta.job is None or meta.mode != POINTER_MODE:
            raise ForeignCheckpoint(
                f"trial {self.base!r} was handed the checkpoint at {where}, which "
                "TuneCheckpointer.report did not write: nothing was loaded"
            )
        if raytrain.own_lineage(self.base, meta.job):
            self.job = meta.job
            return None
        if meta.experiment != self.experiment:
            raise ForeignCheckpoint(
                f"trial {self.base!r} of experiment {self.experiment!r} was asked to continue "
                f"from job {meta.job!r} of experiment {meta.experiment!r}: a trial continues "
                "only from a trial of its own experiment. Nothing was loaded"
            )
        self.job = raytrain.continued_name(self.base, meta.job, meta.step)
        log.info(
            "trial %s continues from job %s's step %d as job %s",
            self.base,
            meta.job,
            meta.step,
            self.job,
            extra={"job": self.job},
        )
        return ContinueFrom(meta.job, meta.step)

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Publish ``state`` as step ``step`` on the node's RAM disk (``torch.save``); in the
        background once snapshotted, unless ``asynchronous`` is False."""
        if not self.asynchronous:
            torch_io.save_file(self.directory, step, state, job=self.job, rank=0, worker=0)
            self._newest = step
            return
        if self._saver is None:
            self._saver = AsyncSaver(self.directory)
        previous, self._pending = self._pending, None
        if previous is not None:
            # The saver would wait for it too; its failure is raised here (once), and a
            # failed step is never counted as published.
            previous.wait()
            self._newest = previous.step
        self._pending = self._saver.save_file(step, state, job=self.job, rank=0, worker=0)

    def _published(self) -> int | None:
        """The newest step on the RAM disk (a background save counts once written)."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            pending.wait(0)  # raises the background save's failure (once: then forgotten)
            self._newest = pending.step
        return self._newest

    def report(self, metrics: Mapping[str, Any], *, checkpoint: bool = True) -> None:
        """``tune.report(metrics)``, with a checkpoint naming the newest step saved (a few
        bytes: the state stays in the replicator) unless ``checkpoint`` is False or nothing
        was saved yet. Schedulers that pause or exploit trials need the checkpoint."""
        from ray import tune

        if not checkpoint or self._published() is None:
            tune.report(dict(metrics))
            return
        assert self._newest is not None
        # The step stays on the RAM disk however many saves follow, while Tune may hand
        # this checkpoint out (a restart, a pause, an exploit): kept before Tune knows it.
        self._reported = [*(s for s in self._reported if s != self._newest), self._newest]
        self._reported = self._reported[-self.keep_reported :]
        keep = self.directory / KEEP_FILE
        tmp_keep = keep.with_name(KEEP_FILE + ".tmp")
        tmp_keep.write_text("".join(f"{step}\n" for step in self._reported))
        os.replace(tmp_keep, keep)
        meta = RayMeta(self._newest, 1, POINTER_MODE, self.job, self.experiment)
        with tempfile.TemporaryDirectory(prefix="mtc-tune-") as tmp:
            (Path(tmp) / RAY_META_FILE).write_text(json.dumps(meta.to_json()))
            tune.report(dict(metrics), checkpoint=tune.Checkpoint.from_directory(tmp))

    def close(self) -> None:
        """The trial is over: the save in flight is written, then the daemon drains the
        newest step and stops serving the trial."""
        if self._saver is not None:
            self._saver.close()
            self._saver = None
        if self.directory.is_dir():
            finish_job(self.directory, timeout=self.timeout)


def _kept(path: Path) -> list[int]:
    try:
        lines = path.read_text().split()
    except (OSError, UnicodeDecodeError):
        return []
    return [int(line) for line in lines if line.isdecimal()][-MAX_KEPT_STEPS:]


def _checkpoint_dir(arg: str | os.PathLike[str] | None) -> Path:
    if arg is not None:
        return Path(arg)
    value = os.environ.get("MTC_CHECKPOINT_DIR")
    if not value:
        raise raytrain.RayTrainRefused(
            "no checkpoint directory: set MTC_CHECKPOINT_DIR on the Ray nodes (the "
            "replicator's volume) or pass TuneCheckpointer(checkpoint_dir=...)"
        )
    return Path(value)
