"""Which process of a node talks to the replicator, and how the node's other processes learn
what it was told.

A launcher that runs several processes per node (``torchrun --nproc-per-node=8``, Ray Train,
``srun``, ``mpirun``) says which one each is in an environment variable
(``LOCAL_RANK_VARIABLES``). Local rank 0 runs the handshake and writes its outcome to
``replicator.result`` (``core.contract.RESULT_FILE``); the others never write
``replicator.yaml`` (a second one would restart the daemon's incarnation) and wait for that
file instead. The file names the launch it belongs to (``launch_key``), so a process never
takes the outcome of an earlier launch left in CHECKPOINT_DIR, whichever process starts
first. ``local_rank``, ``launch_key``, ``render_result`` and ``parse_result`` are pure; the
rest reads ``/proc`` and CHECKPOINT_DIR.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mtc_replicator.core import contract
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.repeats import differences

log = logging.getLogger(__name__)

LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
"""Read in this order: ``LOCAL_RANK`` (torchrun and torch's launchers, Ray Train, Accelerate,
DeepSpeed, Lightning), ``SLURM_LOCALID`` (``srun``), ``OMPI_COMM_WORLD_LOCAL_RANK``
(Open MPI's ``mpirun``). A torchrun under ``srun`` sets ``LOCAL_RANK``, which wins."""

LAUNCH_ID_VARIABLE = "MTC_LAUNCH_ID"
"""Names the launch explicitly: the same value in every process of one node's launch, a new
one at every launch. Needed where the parent process outlives launches (a Ray worker's
parent is the raylet)."""

RESTART_COUNT_VARIABLE = "TORCHELASTIC_RESTART_COUNT"
"""torchrun restarts its workers under the same agent process and counts the restarts here."""

_RESULT_TMP = contract.RESULT_FILE + ".tmp"
_PROGRESS_EVERY = 30.0

Clock = Callable[[], float]
Sleep = Callable[[float], None]


class Waits(NamedTuple):
    """How long and how often to look, and the clock and sleep to do it with."""

    timeout: float
    poll_interval: float
    clock: Clock = time.monotonic
    sleep: Sleep = time.sleep


class NotLocalRankZero(RuntimeError):
    """A call that only the node's local rank 0 may make came from another process."""


class LaunchUnknown(ValueError):
    """This process cannot tell which launch it belongs to; the message says what to set."""


@dataclass(frozen=True)
class LocalRank:
    """This process's place on its node, as its launcher said."""

    rank: int
    variable: str
    """The environment variable that said it."""


def local_rank(env: Mapping[str, str]) -> LocalRank | None:
    """This process's local rank from the launcher's environment; None when no launcher
    said (one process per node, or a launcher we do not know)."""
    for variable in LOCAL_RANK_VARIABLES:
        raw = env.get(variable, "").strip()
        if not raw:
            continue
        if not contract.ascii_digits(raw):
            raise ValueError(
                f"{variable}={raw!r} is not a local rank (an integer >= 0): fix the launcher's "
                "environment, or pass write_config= to handshake() to choose explicitly"
            )
        return LocalRank(int(raw), variable)
    return None


def start_time(stat_text: str) -> int:
    """A process's start time (clock ticks after boot) from its ``/proc/<pid>/stat``: field
    22, counted after the command name, which may hold spaces and parentheses."""
    fields = stat_text[stat_text.rindex(")") + 2 :].split()
    return int(fields[19])


def launch_key(
    env: Mapping[str, str],
    *,
    parent: int,
    parent_stat: str | None,
    boot_id: str | None,
    explicit: str | None = None,
) -> str:
    """What tells this launch of the node's processes from every other one.

    ``explicit`` or ``$MTC_LAUNCH_ID`` when given; otherwise the parent process (its pid and
    start time: the launcher, torchrun's agent) with torchrun's restart count, which is the
    same in every process of one launch and differs at the next one.
    """
    given = explicit if explicit is not None else env.get(LAUNCH_ID_VARIABLE, "").strip()
    if given:
        return f"id:{given}"
    if env.get("RAY_RAYLET_PID", "").strip():
        raise LaunchUnknown(
            "this is a Ray worker: its parent is the raylet, which outlives runs and trials, "
            "so it does not tell one launch from the next. Use RayCheckpointer (docs/ray.md), "
            f"which elects local rank 0 itself, or set {LAUNCH_ID_VARIABLE} (or pass "
            "launch_id=) to the same new value in every process of the node at each launch"
        )
    if parent_stat is None:
        raise LaunchUnknown(
            f"cannot read the parent process {parent} in /proc to tell this launch from "
            f"earlier ones: set {LAUNCH_ID_VARIABLE} (or pass launch_id=) to the same new "
            "value in every process of the node at each launch"
        )
    restarts = env.get(RESTART_COUNT_VARIABLE, "").strip()
    return f"parent:{boot_id or '-'}:{parent}:{start_time(parent_stat)}:{restarts or '-'}"


def this_launch(explicit: str | None = None) -> str:
    """``launch_key`` for this process, reading ``/proc``."""
    parent = os.getppid()
    return launch_key(
        os.environ,
        parent=parent,
        parent_stat=_read(f"/proc/{parent}/stat"),
        boot_id=_read("/proc/sys/kernel/random/boot_id"),
        explicit=explicit,
    )


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def check_saves_step_dir(what: str) -> None:
    """Refuse ``what`` (a save of the node's one ``<N>/``) in a process that is not the
    node's local rank 0: another process's ``<N>/`` is a different checkpoint under the same
    step name, which the daemon refuses (only the first counts)."""
    here = local_rank(os.environ)
    if here is None or here.rank == 0:
        return
    raise NotLocalRankZero(
        f"{what} writes this node's one <N>/ (framework pytorch.distributed), so only the "
        f"node's local rank 0 may call it; this process is local rank {here.rank} "
        f"({here.variable}). Save on local rank 0 only, or use save_distributed() over "
        "node_process_group() so that every rank writes its shards into the node's one <N>/"
    )


# --- the result file -----------------------------------------------------------------------


@dataclass(frozen=True)
class SharedResult:
    """Local rank 0's handshake outcome, as its node's other processes read it."""

    launch: str
    config: str
    """The ``replicator.yaml`` it wrote (``contract.render_config``)."""
    step: int | None = None
    path: str | None = None
    """The renamed marker's name in CHECKPOINT_DIR."""
    source: str | None = None
    error: str | None = None
    """Why the handshake failed, when it did."""
    error_kind: str | None = None
    """``ReplicatorFailed``, ``HandshakeTimeout`` or another exception's class name."""


def render_result(result: SharedResult) -> bytes:
    return json.dumps(
        {
            "launch": result.launch,
            "config": result.config,
            "step": result.step,
            "path": result.path,
            "source": result.source,
            "error": result.error,
            "error-kind": result.error_kind,
        }
    ).encode()


def parse_result(raw: bytes) -> SharedResult | None:
    """The record in ``raw``, or None when it is not one (half written by another writer)."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    launch, config, step = data.get("launch"), data.get("config"), data.get("step")
    if not isinstance(launch, str) or not isinstance(config, str):
        return None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return None
    texts = [data.get(k) for k in ("path", "source", "error", "error-kind")]
    if any(t is not None and not isinstance(t, str) for t in texts):
        return None
    path, source, error, kind = (t if isinstance(t, str) else None for t in texts)
    if path is not None and (not path or "/" in path or path in {".", ".."}):
        return None  # a name in CHECKPOINT_DIR, never a path elsewhere
    return SharedResult(launch, config, step, path, source, error, kind)


def clear_result(directory: Path) -> None:
    """Local rank 0, before its handshake: no earlier launch's outcome stays readable."""
    (directory / contract.RESULT_FILE).unlink(missing_ok=True)


def write_result(directory: Path, result: SharedResult) -> None:
    """Publish the outcome atomically: a temp name, fsync, one rename."""
    tmp = directory / _RESULT_TMP
    with open(tmp, "wb") as f:
        f.write(render_result(result))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / contract.RESULT_FILE)


def read_result(directory: Path) -> SharedResult | None:
    try:
        raw = (directory / contract.RESULT_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return parse_result(raw)


def await_result(
    directory: Path,
    config: JobConfig,
    launch: str,
    here: LocalRank,
    waits: Waits,
) -> SharedResult:
    """Wait for local rank 0's outcome of this launch; raise ``TimeoutError`` naming what
    was found instead, and ``ValueError`` when its config is not ours."""
    timeout, poll_interval, clock, sleep = waits
    start = clock()
    deadline, next_progress = start + timeout, start + _PROGRESS_EVERY
    while True:
        found = read_result(directory)
        if found is not None and found.launch == launch:
            if found.config != contract.render_config(config):
                theirs = contract.parse_config(found.config)
                raise ValueError(
                    "local rank 0 handed the replicator another config than this process's "
                    f"({'; '.join(differences(theirs, config))}): every process of a node "
                    "must pass the same config to handshake()"
                )
            return found
        now = clock()
        if now >= deadline:
            other = f"; {contract.RESULT_FILE} there is of launch {found.launch}" if found else ""
            raise TimeoutError(
                f"local rank 0 published no handshake result for this launch ({launch}) in "
                f"{directory} within {timeout:g} s{other}: does local rank 0 call "
                "client.handshake() too, under the same launcher?"
            )
        if now >= next_progress:
            log.info(
                "job %s rank %s local rank %s: still waiting for local rank 0's handshake (%.0f s)",
                config.job_name,
                config.node_rank,
                here.rank,
                now - start,
                extra={"job": config.job_name},
            )
            next_progress = now + _PROGRESS_EVERY
        sleep(poll_interval)
