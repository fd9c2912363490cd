"""What a Ray Train job looks like to the replicator, and what cannot work. Pure: no Ray, no
torch, no I/O.

The Ray checkpointer (``mtc_replicator.client.ray_train``) gathers every worker's place
(world rank, node rank, local rank, local world size) and asks this module for the job's
layout: ``nodes`` from the node ranks seen, ``workers-per-node`` from the local world size.
The replicator's contract needs the same number of workers on every node and torchrun's
numbering (node ``k`` holds world ranks ``k*L .. k*L+L-1``), because a worker's data is
filed under ``(node-rank, local-rank)`` and must map back to the same world rank after a
restart. Everything that breaks this is refused here, with the Ray setting that fixes it.
Also decided here: whether another job's claim on a node's replicator refuses this one, which
claim an incarnation may release, and whether a checkpoint ``restore`` is asked to continue
from is this job's own (Ray Tune's PopulationBasedTraining hands a trial another's).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mtc_replicator.core.jobname import MAX_JOB_NAME_LEN, is_job_name

FIX_PLACEMENT = (
    'ScalingConfig(placement_strategy="STRICT_SPREAD") (one worker per node), or resources '
    "per worker that fill a whole node (e.g. resources_per_worker={'CPU': <cpus per node>})"
)
"""What the uneven-placement refusal tells the user to set."""


class RayTrainRefused(Exception):
    """A Ray Train setup the replicator cannot serve; the message says how to fix it."""


class UnevenPlacement(RayTrainRefused):
    """Ray placed a different number of workers on some nodes, or numbered them in a way
    that does not map back to the same worker after a restart."""


class ElasticWorkers(RayTrainRefused):
    """The worker count is elastic, or differs from the one the job saved with."""


class DatedRunName(RayTrainRefused):
    """The run has Ray's dated default name: a new driver would not find its checkpoints."""


class SharedNodes(RayTrainRefused):
    """Another job (another run or a concurrent Ray Tune trial) uses this node's replicator."""


class RanksDisagree(RayTrainRefused):
    """The workers were offered different steps to restore; nothing is loaded."""


class ForeignCheckpoint(RayTrainRefused):
    """``restore`` was asked to continue from a checkpoint that is not this job's own (Ray
    Tune's PopulationBasedTraining exploit hands a trial another trial's checkpoint), or one
    it cannot read; nothing is loaded."""


@dataclass(frozen=True)
class WorkerPlace:
    """One worker's place, as Ray's ``get_context()`` tells it."""

    world_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int


@dataclass(frozen=True)
class RayLayout:
    """The job's shape as the replicator sees it."""

    nodes: int
    workers_per_node: int
    world_size: int
    node_members: tuple[tuple[int, ...], ...]
    """World ranks of each node (index: node rank), in local-rank order."""

    def node_of(self, world_rank: int) -> int:
        for node, members in enumerate(self.node_members):
            if world_rank in members:
                return node
        raise ValueError(f"world rank {world_rank} is not in this layout")


def layout_of(places: Sequence[WorkerPlace], world_size: int) -> RayLayout:
    """The layout of a job whose workers stand at ``places``; ``UnevenPlacement`` when it
    cannot be served (the message names the workers per node and the fix)."""
    if sorted(p.world_rank for p in places) != list(range(world_size)):
        raise ValueError(f"expected one place per world rank 0..{world_size - 1}, got {places}")
    by_node: dict[int, list[WorkerPlace]] = {}
    for p in places:
        by_node.setdefault(p.node_rank, []).append(p)
    counts = {node: len(members) for node, members in sorted(by_node.items())}
    if len(set(counts.values())) != 1 or len({p.local_world_size for p in places}) != 1:
        raise UnevenPlacement(
            f"Ray placed the {world_size} workers unevenly (workers per node rank: {counts}); "
            f"the replicator needs the same number on every node. Set {FIX_PLACEMENT}"
        )
    nodes = len(by_node)
    per_node = world_size // nodes
    if sorted(by_node) != list(range(nodes)):
        raise UnevenPlacement(
            f"node ranks {sorted(by_node)} are not 0..{nodes - 1}: is another job's worker "
            f"group mixed into this one? Set {FIX_PLACEMENT}"
        )
    members: list[tuple[int, ...]] = []
    for node in range(nodes):
        ordered = sorted(by_node[node], key=lambda p: p.local_rank)
        want = tuple(range(node * per_node, (node + 1) * per_node))
        got = tuple(p.world_rank for p in ordered)
        if [p.local_rank for p in ordered] != list(range(per_node)) or got != want:
            raise UnevenPlacement(
                f"node rank {node} holds world ranks {got} with local ranks "
                f"{[p.local_rank for p in ordered]}; the replicator needs torchrun's numbering "
                f"{want} so that a restarted worker finds its own data. Set {FIX_PLACEMENT}"
            )
        members.append(got)
    return RayLayout(nodes, per_node, world_size, tuple(members))


_DATED = re.compile(r"(?:^|[_-])\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(?:\.\d+)?$")


def job_name_of(run_name: str) -> str:
    """The replicator's job name for a Ray run name; refuses Ray's dated default names
    (``ray_train_run-2026-01-31_12-00-00``, ``TorchTrainer_2026-...``) and names that are not
    a job name (``[A-Za-z0-9][A-Za-z0-9._-]*``, at most 127 characters, no ``..``)."""
    if _DATED.search(run_name):
        raise DatedRunName(
            f"the Ray run is named {run_name!r}, after the time it started: a restarted driver "
            "gets a new name and could not find this run's checkpoints. Give the run a stable "
            'name: RunConfig(name="my-job") (under Ray Tune: one stable name per trial)'
        )
    if not is_job_name(run_name):
        raise RayTrainRefused(
            f"the Ray run name {run_name!r:.80} cannot be the replicator's job name: use "
            f"letters, digits, '.', '_' and '-' (starting with a letter or digit, at most "
            f"{MAX_JOB_NAME_LEN} characters, no '..') in RunConfig(name=...), or pass job_name="
        )
    return run_name


def check_fixed_workers(elastic: bool, world_size: int, saved_world_size: int | None) -> None:
    """Refuse an elastic ``ScalingConfig(num_workers=(min, max))``, and a worker count that
    differs from the one this job saved with (its data is filed per worker)."""
    if elastic:
        raise ElasticWorkers(
            "ScalingConfig(num_workers=(min, max)) is elastic: the worker count can change "
            "between restarts and every worker's data is filed under its rank. Use a fixed "
            "ScalingConfig(num_workers=N)"
        )
    if saved_world_size is not None and saved_world_size != world_size:
        raise ElasticWorkers(
            f"this job saved with {saved_world_size} workers and now runs {world_size}: its "
            "checkpoints are filed per worker and cannot be restored into another count. Run "
            f"with num_workers={saved_world_size}, or start a new run under another "
            "RunConfig(name=...)"
        )


@dataclass(frozen=True)
class Claim:
    """Which job last used a node's replicator through the Ray checkpointer, and when."""

    job: str
    world_size: int
    at: float
    """Wall-clock seconds of its last handshake or save."""
    holder: str = ""
    """The incarnation that wrote it (a random token per handshake): only that one may
    release the claim. Empty in a claim written before holders existed."""

    def to_json(self) -> dict[str, object]:
        return {
            "job": self.job,
            "world-size": self.world_size,
            "at": self.at,
            "holder": self.holder,
        }

    @staticmethod
    def from_json(data: object) -> Claim | None:
        """None for anything that is not a claim (a damaged file claims nothing)."""
        if not isinstance(data, Mapping):
            return None
        job, world, at = data.get("job"), data.get("world-size"), data.get("at")
        if not isinstance(job, str) or not isinstance(world, int) or isinstance(world, bool):
            return None
        if not isinstance(at, int | float) or isinstance(at, bool):
            return None
        holder = data.get("holder", "")
        return Claim(job, world, float(at), holder if isinstance(holder, str) else "")


def may_release(claim: Claim | None, holder: str) -> bool:
    """Whether the incarnation ``holder`` may delete the claim on the node: only the claim it
    wrote itself, never another job's (one that took the node after this claim's lease ran
    out) nor another incarnation's of the same job."""
    return claim is not None and holder != "" and claim.holder == holder


def check_claim(claim: Claim | None, job: str, now: float, lease: float, where: str) -> None:
    """Refuse to take a node whose replicator another job used less than ``lease`` seconds
    ago: the daemon serves one job per node, and a second job's handshake would restart the
    first one's incarnation (concurrent runs, or Ray Tune trials sharing nodes)."""
    if claim is None or claim.job == job:
        return
    age = now - claim.at
    if age < lease:
        raise SharedNodes(
            f"the replicator at {where} serves job {claim.job!r}, which saved {max(age, 0):.0f} s "
            f"ago; job {job!r} cannot share it (one job per node: a second handshake would "
            "restart the first job). Under Ray Tune run one trial at a time per node set of "
            "nodes (TuneConfig(max_concurrent_trials=...)) or give each trial whole nodes; if "
            f"{claim.job!r} is gone, wait {lease - age:.0f} s or delete {where}"
        )


def agree_step(steps: Mapping[int, int | None]) -> int | None:
    """The one step every node was offered (None: fresh start); ``RanksDisagree`` if not."""
    offered = set(steps.values())
    if len(offered) > 1:
        raise RanksDisagree(
            f"the nodes' replicators offered different steps (node rank -> step: "
            f"{dict(sorted(steps.items()))}); refusing to load a mix of steps"
        )
    return next(iter(offered)) if offered else None


Source = Literal["replicator", "ray"]


def pick_source(replicator_step: int | None, ray_step: int | None) -> Source | None:
    """Where to restore from: the replicator's step, unless Ray holds a newer full checkpoint
    (``ray.train.get_checkpoint()``); None on a fresh start."""
    if ray_step is not None and (replicator_step is None or ray_step > replicator_step):
        return "ray"
    return None if replicator_step is None else "replicator"


@dataclass(frozen=True)
class RayMeta:
    """``mtc-ray.json`` in a Ray checkpoint that ``RayCheckpointer.report`` wrote."""

    step: int
    world_size: int
    mode: str
    job: str | None
    """The job that wrote it; None in a checkpoint written before the job was recorded."""
    experiment: str | None = None
    """The Tune experiment of the trial that wrote it (``TuneCheckpointer``); None else."""

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "step": self.step,
            "world-size": self.world_size,
            "mode": self.mode,
        }
        if self.job is not None:
            out["job"] = self.job
        if self.experiment is not None:
            out["experiment"] = self.experiment
        return out

    @staticmethod
    def from_json(data: object) -> RayMeta | None:
        """None for anything this checkpointer did not write."""
        if not isinstance(data, Mapping):
            return None
        step, world, mode, job = (data.get(k) for k in ("step", "world-size", "mode", "job"))
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return None
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            return None
        experiment = data.get("experiment")
        return RayMeta(
            step,
            world,
            mode if isinstance(mode, str) else "",
            job if isinstance(job, str) else None,
            experiment if isinstance(experiment, str) else None,
        )


# --- Ray Tune trials (``client.ray_tune``) ------------------------------------------------------

_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9._-]+")
CONTINUED = ".x"
"""Between a trial's name and the hash of the step it continued from (an exploit)."""


def tune_job_name(experiment: str, trial_id: str) -> str:
    """A trial's job: its experiment's name and its id, as characters a job name allows;
    the same after ``Tuner.restore`` (Tune keeps both)."""
    base = _NOT_IN_NAME.sub("-", f"{experiment}-{trial_id}").strip("-.") or "tune"
    base = base if base[0].isalnum() else f"t{base}"
    return base.replace("..", "-")[:100]


def continued_name(base: str, donor: str, step: int) -> str:
    """The job a trial runs as once it continues from ``donor``'s ``step`` (the same on
    every try, so a trial restarted before its next report finds its own steps)."""
    digest = hashlib.blake2b(f"{donor}@{step}".encode(), digest_size=4).hexdigest()
    return f"{base}{CONTINUED}{digest}"


def own_lineage(base: str, job: str) -> bool:
    """Whether ``job`` is the trial's own: its name, or its name continued from a step."""
    if job == base:
        return True
    tail = job.removeprefix(base + CONTINUED)
    return tail != job and re.fullmatch(r"[0-9a-f]{8}", tail) is not None


def check_handed(job: str, handed: RayMeta | None, where: str) -> None:
    """Refuse a checkpoint ``restore(checkpoint=...)`` was asked to continue from unless it is
    this job's own: the replicator serves a job only its own steps, and answering with this
    job's newest step would silently ignore what Ray Tune asked for (PopulationBasedTraining's
    exploit hands a trial another trial's checkpoint)."""
    if handed is not None and handed.job == job:
        return
    if handed is None:
        raise ForeignCheckpoint(
            f"job {job!r} was asked to continue from the checkpoint at {where}, which "
            "RayCheckpointer.report did not write (no readable mtc-ray.json): RayCheckpointer "
            "cannot restore from it, and loading this job's own newest step instead would "
            "ignore it. Nothing was loaded. Load that checkpoint yourself, without passing it "
            "to restore(checkpoint=...)"
        )
    owner = (
        f"job {handed.job!r}"
        if handed.job
        else "a job it does not name (written by an older mtc-replicator)"
    )
    raise ForeignCheckpoint(
        f"job {job!r} was asked to continue from {owner}'s checkpoint of step {handed.step} at "
        f"{where}, as Ray Tune's PopulationBasedTraining does when it exploits another trial. "
        f"RayCheckpointer restores a TorchTrainer job only from its own steps; loading "
        f"{job!r}'s own newest step instead would silently undo the exploit. Nothing was "
        "loaded and the replicator was not touched. Under PopulationBasedTraining, run the "
        "trials as Tune functions on TuneCheckpointer, whose exploit brings the other trial's "
        "step through the replicator's tiers (docs/ray.md, Ray Tune)"
    )
