"""Ray Train's checkpointer on the replicator: every few steps to the node's RAM disk, now and
then a full checkpoint to Ray's ``storage_path``.

Owns: finding the job's layout from Ray's context, the handshake (once per node, by local
rank 0), agreeing on the restored step across workers, and choosing between the replicator's
step and Ray's own checkpoint (``ray.train.get_checkpoint()``). The pure decisions live in
``mtc_replicator.core.raytrain``; saving and loading go through ``torch_io`` and
``handshake``. Does file I/O in CHECKPOINT_DIR and torch.distributed collectives; Ray and
torch are imported inside the functions, so ``import mtc_replicator.client`` never imports
them. docs/ray.md tells the user's side.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from mtc_replicator.client import torch_io
from mtc_replicator.client.async_save import AsyncSaver, PendingSave, Staged, WhenBusy
from mtc_replicator.client.handshake import (
    DEFAULT_POLL_INTERVAL,
    DEFAULT_TIMEOUT,
    ConfigFields,
    RestoreResult,
    await_restore,
    job_config,
    publish_config,
    wait_config_consumed,
)
from mtc_replicator.client.ray_checkpoint import (
    RAY_META_FILE,
    HostCopy,
    rank_file,
    read_meta,
    write_part,
)
from mtc_replicator.client.ray_collectives import (
    all_or_none,
    collective_group,
    decode_place,
    encode_place,
    gather,
    node_group,
)
from mtc_replicator.core import raytrain
from mtc_replicator.core.contract import JOB_DIRS, Framework
from mtc_replicator.core.raytrain import (
    DatedRunName,
    ElasticWorkers,
    ForeignCheckpoint,
    RanksDisagree,
    RayLayout,
    RayTrainRefused,
    SharedNodes,
    UnevenPlacement,
    WorkerPlace,
)

__all__ = [
    "CLAIM_FILE",
    "RAY_META_FILE",
    "DatedRunName",
    "ElasticWorkers",
    "ForeignCheckpoint",
    "RanksDisagree",
    "RayCheckpointer",
    "RayLayout",
    "RayTrainRefused",
    "Restored",
    "SharedNodes",
    "UnevenPlacement",
]

log = logging.getLogger(__name__)

CLAIM_FILE = "ray-train.claim"
"""In CHECKPOINT_DIR: which job uses this node's replicator (a name the daemon ignores)."""
Mode = Literal["files", "dcp"]


@dataclass(frozen=True)
class Restored:
    """What ``RayCheckpointer.restore`` loaded."""

    step: int
    """The last step the state holds; train from ``step + 1``."""
    state: dict[str, Any]
    """This worker's state (``files``), or the state dict passed in, filled in (``dcp``)."""
    source: str
    """``local``, ``peer`` or ``backup`` (the replicator's tiers), or ``ray``."""


class RayCheckpointer:
    """Checkpoints a Ray Train ``train_func`` through the node's replicator.

    Create one at the top of ``train_func`` and call ``restore()`` once, on every worker,
    before training; then ``save(step, state)`` on every worker (all the replicator needs),
    and ``report(metrics)`` on every worker as often as Ray should hear of the metrics.
    ``mode="files"``: each worker saves its own state dict (one ``.save`` file each);
    ``mode="dcp"``: torch.distributed.checkpoint over each node's ranks (FSDP-style sharded
    state, one ``<N>/`` per node). ``checkpoint_dir``: the node's CHECKPOINT_DIR (default
    ``$MTC_CHECKPOINT_DIR``), or a function returning it (run on the worker).
    ``ray_checkpoint_every=K``: once K saves were made since the last Ray checkpoint, the next
    ``report`` also writes the newest save, as it was saved, to Ray's ``storage_path``.
    ``job_name``: default the stable ``RunConfig(name=...)``. ``job_directory``: hand the
    job's files to its own job directory, ``CHECKPOINT_DIR/jobs/<job>/`` (docs/protocol.md),
    so that several jobs (Ray Tune's concurrent trials) share the nodes, each with its own
    handshake, claim and steps; default the node's root, one job at a time.
    ``asynchronous`` (default): a save returns once the state is snapshotted and is written
    in the background (``client.async_save.AsyncSaver``: one save in flight, ``when_busy``
    says whether the next waits or is skipped); ``close()`` at the end of ``train_func``
    publishes the last one and gives the node back to the next job (``with
    RayCheckpointer(...) as ckpt:`` does it when the block ends without an exception).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str] | Callable[[], str | os.PathLike[str]] | None = None,
        *,
        mode: Mode = "files",
        job_name: str | None = None,
        backup_interval_steps: int | None = None,
        backup_interval_minutes: int | None = None,
        peers_per_node: int | None = None,
        data_parallelism: int | None = None,
        ray_checkpoint_every: int = 0,
        claim_lease_seconds: float = 120.0,
        timeout: float = DEFAULT_TIMEOUT,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        asynchronous: bool = True,
        when_busy: WhenBusy = "wait",
        job_directory: bool = False,
    ) -> None:
        if mode not in ("files", "dcp"):
            raise ValueError(f"mode must be 'files' or 'dcp', not {mode!r}")
        if ray_checkpoint_every < 0:
            raise ValueError(f"ray_checkpoint_every must be >= 0, got {ray_checkpoint_every}")
        self.mode: Mode = mode
        self._dir_arg = checkpoint_dir
        self._job_arg = job_name
        self._intervals = (backup_interval_steps, backup_interval_minutes)
        self._peers = peers_per_node
        self._dp = data_parallelism
        self.ray_checkpoint_every = ray_checkpoint_every
        self.claim_lease_seconds = claim_lease_seconds
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.asynchronous = asynchronous
        self.when_busy: WhenBusy = when_busy
        self.job_directory = job_directory
        self._saver: AsyncSaver | None = None
        self._session: _Session | None = None
        self._last: Staged | None = None
        """The newest save as it was saved: what the next Ray checkpoint holds."""
        self._copy = HostCopy(mode)
        self._closed = False
        self._saves_since_ray = 0

    @property
    def layout(self) -> RayLayout:
        return self._started().layout

    @property
    def job(self) -> str:
        return self._started().job

    @property
    def checkpoint_dir(self) -> Path:
        return self._started().directory

    def restore(
        self, state: dict[str, Any] | None = None, *, checkpoint: Any = None
    ) -> Restored | None:
        """Hand this job to the node's replicator and load what it offers; collective.

        Returns None on a fresh start. Raises a ``RayTrainRefused`` (the same on every
        worker) for a setup that cannot work. ``state`` is required in ``dcp`` mode: the
        state dict to load into, in place (DCP loads into existing tensors).
        ``checkpoint``: a ``ray.train.Checkpoint`` the job was asked to continue from (under
        Ray Tune, the one ``tune.get_checkpoint()`` hands the trial, passed in through
        ``train_loop_config``). This job's own is one more candidate beside Ray's newest;
        another job's (a PopulationBasedTraining exploit) is refused with
        ``ForeignCheckpoint`` before the handshake, never answered with this job's state.
        """
        if self.mode == "dcp" and state is None:
            raise ValueError("mode='dcp' restores in place: pass the state dict to load into")
        if checkpoint is not None and not hasattr(checkpoint, "filesystem"):
            raise TypeError(
                f"checkpoint must be a ray.train.Checkpoint (or tune.Checkpoint), not "
                f"{type(checkpoint).__name__}: wrap a path as ray.train.Checkpoint(path)"
            )
        session = self._session = _Session.start(self, checkpoint)
        step = session.agree_on_step()
        ray_step, ray_checkpoint = _ray_checkpoint(session)
        if session.handed_step is not None and (ray_step is None or session.handed_step > ray_step):
            ray_step, ray_checkpoint = session.handed_step, checkpoint
        source = raytrain.pick_source(step, ray_step)
        if source is None:
            log.info(
                "job %s rank %s: fresh start",
                session.job,
                session.place.world_rank,
                extra={"job": session.job},
            )
            return None
        if source == "ray":
            assert ray_step is not None
            loaded = session.load_ray(ray_checkpoint, state)
            return Restored(ray_step, loaded, "ray")
        assert step is not None
        loaded = session.load_replicator(state)
        return Restored(step, loaded, session.result.source or "unknown")

    def save(self, step: int, state: Mapping[str, Any]) -> PendingSave | None:
        """Publish this worker's ``state`` as step ``step`` to the RAM disk; collective in
        ``dcp`` mode. Asynchronous: returns once the state is snapshotted (the save being
        written, or None when skipped); otherwise once the step is on the RAM disk (None).
        The daemon replicates it and backs it up; no ``report`` is needed for that."""
        session = self._started()
        if session.place.local_rank == 0:
            session.write_claim()  # renewed by every save (a skipped one too), not by report
        pending = None
        if self.asynchronous:
            pending = self._save_async(session, step, state)
            if pending is None:
                return None
            assert self._saver is not None
            self._last = self._saver.staged
        elif self.mode == "files":
            torch_io.save_file(
                session.directory,
                step,
                state,
                job=session.job,
                rank=session.node_rank,
                worker=session.place.local_rank,
            )
        else:
            torch_io.save_distributed(
                session.directory, step, dict(state), process_group=session.node_group
            )
        if not self.asynchronous and self.ray_checkpoint_every > 0:
            self._last = self._copy.take(step, state)
        self._saves_since_ray += 1
        return pending

    def _save_async(
        self, session: _Session, step: int, state: Mapping[str, Any]
    ) -> PendingSave | None:
        if self._saver is None:
            when_busy = self.when_busy
            if when_busy == "skip" and session.layout.world_size > 1:
                # Each worker would decide alone: a step saved by some workers only (an
                # incomplete step on the node) and Ray checkpoints mixing steps. A skip
                # would have to be decided alike on every worker; waiting is.
                log.warning(
                    "job %s: when_busy='skip' is not applied with %d workers: a busy save "
                    "waits, so that every worker saves the same steps",
                    session.job,
                    session.layout.world_size,
                    extra={"job": session.job},
                )
                when_busy = "wait"
            self._saver = AsyncSaver(session.directory, when_busy=when_busy)
        if self.mode == "files":
            return self._saver.save_file(
                step,
                state,
                job=session.job,
                rank=session.node_rank,
                worker=session.place.local_rank,
            )
        return self._saver.save_distributed(step, dict(state), process_group=session.node_group)

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the save in flight is on the RAM disk (its path; None: none in
        flight); a failure of a background save is raised here or by the next ``save``."""
        return None if self._saver is None else self._saver.wait(timeout)

    def close(self) -> None:
        """Publish the save in flight, free the staging buffers and release the node's claim
        (``ray-train.claim``, if this job's incarnation still holds it), so that the next job
        (the next Tune trial, a new run name) is accepted on these nodes at once. Call it at
        the end of ``train_func``, not on an error: a worker that returns while a save is
        written may be stopped, and a job that failed keeps its nodes for the claim's lease,
        so that Ray's restart finds them free of other jobs."""
        self._last, self._closed = None, True
        self._copy.release()
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()
        if self._session is not None:
            self._session.release_claim()

    def __enter__(self) -> RayCheckpointer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """``close()`` when the block ends normally; on an exception the claim is kept (Ray
        restarts the job's workers on the same nodes) and the error goes on."""
        if kind is None:
            self.close()

    def report(self, metrics: Mapping[str, Any], *, ray_checkpoint: bool | None = None) -> None:
        """``ray.train.report(metrics)``, on every worker alike (a collective), as often as
        the metrics need; with a Ray checkpoint of the newest save, as it was saved though
        the loop changed the tensors since, when ``ray_checkpoint`` is True, or (None) when
        ``ray_checkpoint_every`` saves were made since the last one. Before ``close()``."""
        import ray.train

        due = (
            ray_checkpoint
            if ray_checkpoint is not None
            else self.ray_checkpoint_every > 0
            and self._saves_since_ray >= self.ray_checkpoint_every
        )
        if due and self._last is None and self._saves_since_ray > 0:
            raise RuntimeError(
                "report: a Ray checkpoint is due, but close() freed the copy of the newest save "
                "it is written from: report before close()"
                if self._closed
                else "report(ray_checkpoint=True): asynchronous=False keeps a copy of the newest "
                "save for Ray's checkpoint only with ray_checkpoint_every > 0: set it, or save "
                "asynchronously"
            )
        if not due or self._last is None:
            ray.train.report(dict(metrics))
            return
        session = self._started()
        with tempfile.TemporaryDirectory(prefix="mtc-ray-") as tmp:
            session.write_ray_checkpoint(Path(tmp), self._last)
            ray.train.report(dict(metrics), checkpoint=ray.train.Checkpoint.from_directory(tmp))
        self._saves_since_ray = 0

    def _started(self) -> _Session:
        if self._session is None:
            raise RuntimeError("call restore() first, on every worker, before save or report")
        return self._session


def _ray_checkpoint(session: _Session) -> tuple[int | None, Any]:
    """The step of Ray's newest registered checkpoint and the checkpoint, if this
    checkpointer wrote it; only its small ``mtc-ray.json`` is read here, also remotely."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None, None
    meta = read_meta(checkpoint)
    if meta is None:
        log.warning(
            "job %s rank %s: Ray's checkpoint %s was not written by RayCheckpointer.report; "
            "ignoring it",
            session.job,
            session.place.world_rank,
            checkpoint.path,
            extra={"job": session.job},
        )
        return None, None
    raytrain.check_fixed_workers(False, session.layout.world_size, meta.world_size)
    return meta.step, checkpoint


def _handed_step(checkpoint: Any, job: str, world_size: int) -> int:
    """The step of the checkpoint ``restore`` was asked to continue from, if it is this
    job's own; ``ForeignCheckpoint`` otherwise (nothing loaded, the replicator untouched)."""
    meta = read_meta(checkpoint)
    raytrain.check_handed(job, meta, str(getattr(checkpoint, "path", checkpoint)))
    assert meta is not None
    raytrain.check_fixed_workers(False, world_size, meta.world_size)
    return meta.step


@dataclass
class _Session:
    """One incarnation of the job on this worker: its place, layout, and the handshake."""

    owner: RayCheckpointer
    directory: Path
    place: WorkerPlace
    layout: RayLayout
    job: str
    group: Any
    """The process group of our own small collectives (gloo), or None without torch.distributed."""
    node_group: Any
    """This node's ranks (``dcp`` mode), or None."""
    result: RestoreResult = field(default_factory=lambda: RestoreResult(None, None))
    node_results: tuple[RestoreResult, ...] = ()
    handed_step: int | None = None
    """The step of the checkpoint ``restore`` was asked to continue from (this job's own)."""
    holder: str = field(default_factory=lambda: uuid.uuid4().hex)
    """This incarnation's token in the node's claim: what it may release."""

    @property
    def node_rank(self) -> int:
        return self.place.node_rank

    @classmethod
    def start(cls, owner: RayCheckpointer, handed: Any = None) -> _Session:
        import ray.train

        ctx = ray.train.get_context()
        place = WorkerPlace(
            world_rank=ctx.get_world_rank(),
            local_rank=ctx.get_local_rank(),
            local_world_size=ctx.get_local_world_size(),
            node_rank=ctx.get_node_rank(),
        )
        group = collective_group()
        places = [decode_place(p) for p in gather(group, encode_place(place))]
        layout = raytrain.layout_of(places, ctx.get_world_size())
        raytrain.check_fixed_workers(_elastic(), layout.world_size, None)
        job = owner._job_arg or raytrain.job_name_of(ctx.get_experiment_name())
        nodes = node_group(layout, place, cpu=owner.asynchronous) if owner.mode == "dcp" else None
        directory = _resolve_dir(owner._dir_arg)
        if owner.job_directory:
            # Its own job directory (docs/protocol.md): jobs side by side on one node.
            directory = directory / JOB_DIRS / job
            directory.mkdir(parents=True, exist_ok=True)
        session = cls(owner, directory, place, layout, job, group, nodes)
        if handed is not None:
            # Before the handshake: a refused restore leaves the node's replicator untouched.
            steps = all_or_none(group, lambda: _handed_step(handed, job, layout.world_size))
            session.handed_step = steps[place.world_rank]
        session.handshake()
        return session

    def handshake(self) -> None:
        """Local rank 0 publishes the node's config; then every worker (``files``) or the
        node's local rank 0 (``dcp``) waits for its marker. Failures reach every worker."""
        leader = self.place.local_rank == 0
        config = self._config()
        all_or_none(self.group, lambda: self._publish(config) if leader else None)
        waits = leader or self.owner.mode == "files"
        worker = self.place.local_rank if self.owner.mode == "files" else 0

        def wait() -> RestoreResult | None:
            if not waits:
                return None
            wait_config_consumed(
                self.directory, timeout=self.owner.timeout, poll_interval=self.owner.poll_interval
            )
            return await_restore(
                self.directory,
                config,
                worker=worker,
                timeout=self.owner.timeout,
                poll_interval=self.owner.poll_interval,
                rename="step",
            )

        results = all_or_none(self.group, wait)
        leader_rank = self.layout.node_members[self.node_rank][0]
        own = results[self.place.world_rank] if waits else results[leader_rank]
        assert isinstance(own, RestoreResult)
        self.result = own
        self.node_results = tuple(
            r for r in (results[m[0]] for m in self.layout.node_members) if r is not None
        )

    def _config(self) -> Any:
        steps, minutes = self.owner._intervals
        fields: ConfigFields = {
            "job_name": self.job,
            "framework": Framework.PYTORCH
            if self.owner.mode == "files"
            else Framework.PYTORCH_DISTRIBUTED,
            "node_rank": self.node_rank,
            "nodes": self.layout.nodes,
            "workers_per_node": self.layout.workers_per_node if self.owner.mode == "files" else 1,
            "peers_per_node": self.owner._peers
            if self.owner._peers is not None
            else min(1, self.layout.nodes - 1),
        }
        if steps is not None:
            fields["backup_interval_steps"] = steps
        if minutes is not None:
            fields["backup_interval_minutes"] = minutes
        if self.owner._dp is not None:
            fields["data_parallelism"] = self.owner._dp
        return job_config(**fields)

    def _publish(self, config: Any) -> None:
        claim = _read_claim(self.directory)
        where = str(self.directory / CLAIM_FILE)
        raytrain.check_claim(claim, self.job, time.time(), self.owner.claim_lease_seconds, where)
        if claim is not None and claim.job == self.job:
            raytrain.check_fixed_workers(False, self.layout.world_size, claim.world_size)
        self.write_claim()
        publish_config(
            self.directory,
            config,
            timeout=self.owner.timeout,
            poll_interval=self.owner.poll_interval,
        )

    def write_claim(self) -> None:
        claim = raytrain.Claim(self.job, self.layout.world_size, time.time(), self.holder)
        path = self.directory / CLAIM_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(claim.to_json()), encoding="utf-8")
        os.replace(tmp, path)

    def release_claim(self) -> None:
        """Delete the node's claim if this incarnation wrote it (local rank 0 does); a
        claim another job wrote since ours ran out is left alone."""
        path = self.directory / CLAIM_FILE
        if not raytrain.may_release(_read_claim(self.directory), self.holder):
            return
        path.unlink(missing_ok=True)
        log.info(
            "job %s node rank %s: released %s",
            self.job,
            self.node_rank,
            path,
            extra={"job": self.job},
        )

    def agree_on_step(self) -> int | None:
        return raytrain.agree_step({node: r.step for node, r in enumerate(self.node_results)})

    def load_replicator(self, state: dict[str, Any] | None) -> dict[str, Any]:
        assert self.result.path is not None
        if self.owner.mode == "files":
            return torch_io.load_state_dict(self.result.path)
        assert state is not None
        torch_io.load_distributed(self.result.path, state, process_group=self.node_group)
        return state

    def load_ray(self, checkpoint: Any, state: dict[str, Any] | None) -> dict[str, Any]:
        """Load from Ray's checkpoint (downloaded first when its storage is remote)."""
        with checkpoint.as_directory() as local:
            directory = Path(local)
            if self.owner.mode == "files":
                return torch_io.load_state_dict(directory / rank_file(self.place.world_rank))
            assert state is not None
            torch_io.load_distributed(directory, state)
            return state

    def write_ray_checkpoint(self, directory: Path, staged: Staged) -> None:
        """This worker's part of a Ray checkpoint of ``staged``; collective in ``dcp`` mode."""
        rank, mode = self.place.world_rank, self.owner.mode
        meta = raytrain.RayMeta(staged.step, self.layout.world_size, mode, self.job)
        write_part(directory, staged, mode, rank, meta if rank == 0 else None)


def _resolve_dir(arg: str | os.PathLike[str] | Callable[[], Any] | None) -> Path:
    if arg is None:
        value = os.environ.get("MTC_CHECKPOINT_DIR")
        if not value:
            raise RayTrainRefused(
                "no checkpoint directory: set MTC_CHECKPOINT_DIR on the Ray worker (the "
                "replicator's volume) or pass RayCheckpointer(checkpoint_dir=...)"
            )
        return Path(value)
    return Path(arg() if callable(arg) else arg)


def _read_claim(directory: Path) -> raytrain.Claim | None:
    try:
        return raytrain.Claim.from_json(json.loads((directory / CLAIM_FILE).read_text("utf-8")))
    except (OSError, ValueError):
        return None


def _elastic() -> bool:
    """Whether the run's ScalingConfig is elastic; Ray tells it only through an internal
    module, so a Ray without it reads as fixed (the saved world size still guards)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        scaling = get_train_context().train_run_context.scaling_config
    except (ImportError, AttributeError, RuntimeError):
        return False
    return bool(getattr(scaling, "elasticity_enabled", False))
