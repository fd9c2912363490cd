"""The training job's side of the handshake with the node's replicator daemon.

Owns: publishing ``replicator.yaml``, waiting for the daemon to consume it, relaying
``replicator.errors`` / ``replicator.failed``, and turning this worker's restore marker into a
step path the way Orbax (``<dir>/<N>``) or the PyTorch reference client (``<dir>/step=<N>``)
does; on a node of several processes, local rank 0's result for the others
(``client.election``). Does file I/O in CHECKPOINT_DIR only; imports the standard library,
PyYAML, ``client.election`` and ``core.contract``, nothing else. ``plan_restore`` is the pure
decision; the rest acts.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict, Unpack

import yaml

from mtc_replicator.client import election
from mtc_replicator.core import contract
from mtc_replicator.core.contract import Framework, JobConfig

log = logging.getLogger(__name__)

RenameStyle = Literal["orbax", "step"]
"""``orbax``: the marker becomes ``<dir>/<N>``; ``step``: it becomes ``<dir>/step=<N>``."""

Clock = Callable[[], float]
Sleep = Callable[[float], None]

DEFAULT_TIMEOUT = 300.0
"""Seconds; the deadline every existing client uses (docs/protocol.md, handshake step 8)."""
DEFAULT_POLL_INTERVAL = 0.02
"""Seconds between looks at CHECKPOINT_DIR while the handshake waits (a ``stat`` or a
directory listing each): each of its waits costs half of it on average, so at 1 s a
restart took about a second longer than the daemon needed (it answers in milliseconds)."""

_PROGRESS_EVERY = 30.0


class HandshakeError(Exception):
    """The handshake cannot complete; the message says what to fix."""


class ReplicatorFailed(HandshakeError):
    """The daemon wrote ``replicator.failed``: a fatal problem, usually an invalid config."""

    def __init__(self, text: str) -> None:
        self.text = text
        super().__init__(f"replicator failed: {text.strip() or '(no details given)'}")


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The daemon did not answer in time (no daemon, wrong directory, or a stuck round)."""


@dataclass(frozen=True)
class RestoreResult:
    """What the daemon offered this worker.

    ``step`` and ``path`` are None on a fresh start. ``path`` lies in CHECKPOINT_DIR and is the
    renamed marker: a relative symlink into the daemon's hidden store, returned unresolved
    because the workload and the daemon see the volume at different absolute paths.
    """

    step: int | None
    path: Path | None
    source: str | None = None
    """``restore-source`` from ``replicator.prerestore`` (``local``, ``peer``, ``backup``)."""


@dataclass(frozen=True)
class RestorePlan:
    """What to do with the markers of one worker, decided without touching the disk."""

    step: int | None
    """The step to restore, or None for "nothing to restore"."""
    chosen: str | None
    """The marker to rename; None when there is nothing to restore."""
    stale: tuple[str, ...]
    """Other markers of this worker, deleted as Orbax does."""


class ConfigFields(TypedDict, total=False):
    """Keyword form of ``JobConfig``; names follow the ``replicator.yaml`` keys."""

    job_name: str
    framework: Framework | str
    node_rank: int
    nodes: int
    peer_ranks: Iterable[int]
    peers_per_node: int
    data_parallelism: int
    workers_per_node: int
    backup_interval_minutes: int
    backup_interval_steps: int


_YAML_KEYS = {
    "job_name": "job-name",
    "framework": "framework",
    "node_rank": "node-rank",
    "nodes": "nodes",
    "peer_ranks": "peer-ranks",
    "peers_per_node": "peers-per-node",
    "data_parallelism": "assume-data-parallelism",
    "workers_per_node": "workers-per-node",
    "backup_interval_minutes": "backup-interval-minutes",
    "backup_interval_steps": "backup-interval-steps",
}


def job_config(**fields: Unpack[ConfigFields]) -> JobConfig:
    """Build a ``JobConfig`` and validate it with the daemon's own rules.

    Validating here makes a bad argument fail in the training job at once, with the same
    ``ConfigError`` text the daemon would have written to ``replicator.failed``.
    """
    data: dict[str, object] = {}
    for name, value in fields.items():
        if name not in _YAML_KEYS:
            raise TypeError(f"job_config() got an unexpected keyword argument {name!r}")
        data[_YAML_KEYS[name]] = _plain(value)
    return contract.parse_config(yaml.safe_dump(data, sort_keys=False))


def _plain(value: object) -> object:
    """A value PyYAML's safe dumper accepts; ``parse_config`` then judges it."""
    if isinstance(value, Framework):
        return value.value
    if isinstance(value, str | bool | int):
        return value
    if isinstance(value, Iterable):
        return [_plain(v) for v in value]
    try:
        return operator.index(value)  # type: ignore[arg-type]  # numpy and torch integers
    except TypeError:
        return str(value)


def plan_restore(
    markers: Iterable[tuple[str, bool]], *, job: str, rank: int, worker: int
) -> RestorePlan | None:
    """Decide what this worker restores from the ``*.restore`` names it can see.

    ``markers`` holds ``(name, is_regular_file)`` pairs. Markers of other jobs, ranks or
    workers are ignored (they belong to other processes on this volume). An empty regular
    file with step 0 means "nothing to restore"; anything else is a restore marker (the same
    rule as Orbax), and the highest step wins. Returns None while this worker has no marker.
    """
    restore: list[tuple[int, str]] = []
    nothing: list[str] = []
    for name, is_regular_file in markers:
        parts = contract.parse_marker_name(name)
        if parts is None or (parts.job, parts.rank, parts.worker) != (job, rank, worker):
            continue
        if parts.step == 0 and is_regular_file:
            nothing.append(name)
        else:
            restore.append((parts.step, name))
    if restore:
        step, chosen = max(restore)
        stale = tuple(sorted(n for _, n in restore if n != chosen)) + tuple(sorted(nothing))
        return RestorePlan(step=step, chosen=chosen, stale=stale)
    if nothing:
        return RestorePlan(step=None, chosen=None, stale=tuple(sorted(nothing)))
    return None


def restore_name(step: int, rename: RenameStyle, worker: int | None = None) -> str:
    """The name a restore marker of ``step`` is renamed to.

    ``worker`` is given when a node runs several workers: their markers cannot all become
    ``<N>``, so each gets ``<N>-w<worker>`` (or ``step=<N>-w<worker>``) instead.
    """
    if rename == "orbax":
        base = str(step)
    elif rename == "step":
        base = f"step={step}"
    else:
        raise ValueError(f"rename must be 'orbax' or 'step', not {rename!r}")
    return base if worker is None else f"{base}-w{worker}"


# --- Acting on CHECKPOINT_DIR ----------------------------------------------------------------


def publish_config(
    checkpoint_dir: str | os.PathLike[str],
    config: JobConfig,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> Path:
    """Write ``replicator.yaml`` atomically (temp name, then one rename).

    Waits first for a ``replicator.yaml`` of an earlier incarnation to be consumed, as Orbax
    and the PyTorch reference client do, so that two configs never race. Returns its path.
    """
    directory = _existing_dir(checkpoint_dir)
    text = contract.render_config(config)
    contract.parse_config(text)  # A hand-built JobConfig gets the daemon's checks here.
    wait_config_consumed(
        directory, timeout=timeout, poll_interval=poll_interval, clock=clock, sleep=sleep
    )
    tmp = directory / contract.CONFIG_TMP_FILE
    final = directory / contract.CONFIG_FILE
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    log.info(
        "job %s rank %s: wrote %s (%s, %d nodes, %d workers per node)",
        config.job_name,
        config.node_rank,
        final,
        config.framework.value,
        config.nodes,
        config.workers_per_node,
        extra={"job": config.job_name},
    )
    return final


def wait_config_consumed(
    checkpoint_dir: str | os.PathLike[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> None:
    """Wait until ``replicator.yaml`` is gone: the daemon's cue that it took the config.

    Returns at once when there is none (a worker that starts after the daemon consumed it).
    ``replicator.failed`` is deliberately not read here: until the daemon deletes the yaml,
    a failed file may be a stale one that the daemon is about to clean up.
    """
    config_path = Path(checkpoint_dir) / contract.CONFIG_FILE
    deadline = clock() + timeout
    while os.path.lexists(config_path):
        if clock() >= deadline:
            raise HandshakeTimeout(
                f"{config_path} was not consumed within {timeout:g} s: is the replicator "
                "daemon running on this node and watching this directory?"
            )
        sleep(poll_interval)


def await_restore(
    checkpoint_dir: str | os.PathLike[str],
    config: JobConfig,
    *,
    worker: int = 0,
    timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    rename: RenameStyle = "orbax",
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> RestoreResult:
    """Wait for this worker's restore marker and act on it; call after the yaml is consumed.

    Every poll relays ``replicator.errors`` (each line logged at warning, file deleted) and
    ``replicator.failed`` (file deleted, ``ReplicatorFailed`` raised with its text).
    """
    directory = _existing_dir(checkpoint_dir)
    _check_worker(config, worker)
    restore_name(0, rename)  # Reject a bad style before waiting minutes.
    who = _Who(
        config.job_name,
        config.node_rank,
        worker,
        suffix=worker if config.workers_per_node > 1 else None,
    )
    start = clock()
    deadline = start + timeout
    next_progress = start + _PROGRESS_EVERY
    while True:
        _relay_errors(directory, who)
        _raise_if_failed(directory, who)
        markers = _scan_markers(directory)
        plan = plan_restore(markers, job=who.job, rank=who.rank, worker=who.worker)
        if plan is not None:
            return _apply(directory, plan, rename, who)
        now = clock()
        if now >= deadline:
            others = sorted(name for name, _ in markers)
            hint = f"; markers of other jobs, ranks or workers: {others}" if others else ""
            raise HandshakeTimeout(
                f"no restore marker {who.job}-s<N>-n{who.rank}-w{who.worker}.restore appeared "
                f"in {directory} within {timeout:g} s after {contract.CONFIG_FILE} was "
                f"consumed{hint}"
            )
        if now >= next_progress:
            log.info(
                "job %s rank %s worker %s: still waiting for a restore marker (%.0f s)",
                who.job,
                who.rank,
                who.worker,
                now - start,
                extra={"job": who.job},
            )
            next_progress = now + _PROGRESS_EVERY
        sleep(poll_interval)


def handshake(
    checkpoint_dir: str | os.PathLike[str],
    config: JobConfig | None = None,
    *,
    worker: int = 0,
    write_config: bool | None = None,
    launch_id: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    rename: RenameStyle = "orbax",
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
    **fields: Unpack[ConfigFields],
) -> RestoreResult:
    """Hand the job's config to the daemon and return what to restore.

    Give either ``config`` or its fields as keywords (see ``job_config``). Worker 0 of a node
    writes ``replicator.yaml`` (``write_config`` defaults to ``worker == 0``: a second yaml
    from another worker would make the daemon restart the incarnation); the other workers
    only wait for their own marker. Start those after worker 0's ``publish_config`` returned (a
    node-local barrier): a worker that starts earlier cannot tell a marker left over from a
    crashed incarnation, not yet cleaned up by the daemon, from a new one. Each phase (the
    daemon consuming the yaml, the marker appearing) gets ``timeout`` seconds.

    The chosen marker becomes ``<dir>/<N>`` (``rename="orbax"``) or ``<dir>/step=<N>``
    (``"step"``, as the PyTorch reference client does); on a node with several workers,
    ``<N>-w<worker>`` or ``step=<N>-w<worker>``, so that workers do not overwrite each other.

    Several processes per node (one worker, ``write_config`` not given): when the launcher
    says this process is not the node's local rank 0 (``election.LOCAL_RANK_VARIABLES``), it
    writes nothing and returns local rank 0's result, which local rank 0 shares through
    ``replicator.result`` for this launch (``launch_id``, default ``election.this_launch``);
    such a process may start before or after local rank 0. Its wait gets ``2 * timeout``.
    """
    if config is None:
        config = job_config(**fields)
    elif fields:
        raise TypeError("give either a JobConfig or its fields as keywords, not both")
    _check_worker(config, worker)
    restore_name(0, rename)
    directory = _existing_dir(checkpoint_dir)
    elected = write_config is None and config.workers_per_node == 1
    here = election.local_rank(os.environ) if elected else None
    if here is not None and here.rank != 0:
        waits = election.Waits(2 * timeout, poll_interval, clock, sleep)
        return _follow(directory, config, here, launch_id, waits)

    def run() -> RestoreResult:
        if write_config if write_config is not None else worker == 0:
            publish_config(
                directory,
                config,
                timeout=timeout,
                poll_interval=poll_interval,
                clock=clock,
                sleep=sleep,
            )
        wait_config_consumed(
            directory, timeout=timeout, poll_interval=poll_interval, clock=clock, sleep=sleep
        )
        return await_restore(
            directory,
            config,
            worker=worker,
            timeout=timeout,
            poll_interval=poll_interval,
            rename=rename,
            clock=clock,
            sleep=sleep,
        )

    return run() if here is None else _lead(directory, config, launch_id, run)


# --- Several processes per node ----------------------------------------------------------------


def _lead(
    directory: Path, config: JobConfig, launch_id: str | None, run: Callable[[], RestoreResult]
) -> RestoreResult:
    """Local rank 0: the handshake, then its outcome (or its failure) for the node's others."""
    try:
        launch = election.this_launch(launch_id)
    except election.LaunchUnknown as exc:
        log.warning(
            "job %s rank %s: not sharing the handshake's result with this node's other "
            "processes: %s",
            config.job_name,
            config.node_rank,
            exc,
            extra={"job": config.job_name},
        )
        return run()
    election.clear_result(directory)
    rendered = contract.render_config(config)
    try:
        result = run()
    except (HandshakeError, OSError) as exc:
        text = exc.text if isinstance(exc, ReplicatorFailed) else str(exc)
        failed = election.SharedResult(launch, rendered, error=text, error_kind=type(exc).__name__)
        with contextlib.suppress(OSError):  # the failure raised says more than this one
            election.write_result(directory, failed)
        raise
    name = None if result.path is None else result.path.name
    shared = election.SharedResult(launch, rendered, result.step, name, result.source)
    election.write_result(directory, shared)
    return result


def _follow(
    directory: Path,
    config: JobConfig,
    here: election.LocalRank,
    launch_id: str | None,
    waits: election.Waits,
) -> RestoreResult:
    """A process other than local rank 0: local rank 0's outcome of this launch."""
    who = f"local rank {here.rank} ({here.variable})"
    try:
        launch = election.this_launch(launch_id)
        shared = election.await_result(directory, config, launch, here, waits)
    except election.LaunchUnknown as exc:
        raise HandshakeError(f"{who} waits for local rank 0's handshake, but {exc}") from None
    except TimeoutError as exc:
        raise HandshakeTimeout(f"{who}: {exc}") from None
    except ValueError as exc:
        raise HandshakeError(f"{who}: {exc}") from None
    if shared.error is not None:
        if shared.error_kind == ReplicatorFailed.__name__:
            raise ReplicatorFailed(shared.error)
        failure = HandshakeTimeout if shared.error_kind == HandshakeTimeout.__name__ else None
        raise (failure or HandshakeError)(f"local rank 0's handshake failed: {shared.error}")
    path = None if shared.path is None else directory / shared.path
    log.info(
        "job %s rank %s %s: local rank 0 restored step %s from %s",
        config.job_name,
        config.node_rank,
        who,
        shared.step,
        shared.source or "unknown source",
        extra={"job": config.job_name},
    )
    return RestoreResult(step=shared.step, path=path, source=shared.source)


# --- Helpers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Who:
    job: str
    rank: int
    worker: int
    suffix: int | None
    """The worker index in the renamed marker's name; None when the node runs one worker."""


def _existing_dir(checkpoint_dir: str | os.PathLike[str]) -> Path:
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"checkpoint directory {directory} does not exist: is the replicator's volume "
            "mounted into this container?"
        )
    return directory


def _check_worker(config: JobConfig, worker: int) -> None:
    if not 0 <= worker < config.workers_per_node:
        raise ValueError(
            f"worker must satisfy 0 <= worker < workers-per-node ({config.workers_per_node}), "
            f"got {worker}"
        )


def _scan_markers(directory: Path) -> list[tuple[str, bool]]:
    with os.scandir(directory) as entries:
        return [
            (e.name, e.is_file(follow_symlinks=False))
            for e in entries
            if e.name.endswith(".restore")
        ]


def _relay_errors(directory: Path, who: _Who) -> None:
    # Claim the file by renaming it first: the daemon appends lines at any time, and a line
    # appended between our read and our delete would otherwise be lost. The claimed name
    # ends in `.tmp`, which the daemon ignores.
    claimed = directory / f"{contract.ERRORS_FILE}.{uuid.uuid4().hex}.tmp"
    try:
        os.rename(directory / contract.ERRORS_FILE, claimed)
    except FileNotFoundError:
        return
    try:
        text = claimed.read_text(encoding="utf-8", errors="replace")
    finally:
        claimed.unlink(missing_ok=True)
    for line in text.splitlines():
        if line.strip():
            log.warning(
                "job %s rank %s worker %s: replicator: %s",
                who.job,
                who.rank,
                who.worker,
                line,
                extra={"job": who.job},
            )


def _raise_if_failed(directory: Path, who: _Who) -> None:
    path = directory / contract.FAILED_FILE
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    path.unlink(missing_ok=True)
    log.error(
        "job %s rank %s worker %s: replicator failed: %s",
        who.job,
        who.rank,
        who.worker,
        text.strip(),
        extra={"job": who.job},
    )
    raise ReplicatorFailed(text)


def _read_prerestore(directory: Path, who: _Who) -> tuple[int | None, str | None]:
    """``(restore-step, restore-source)`` from ``replicator.prerestore``, when readable."""
    try:
        data = yaml.safe_load((directory / contract.PRERESTORE_FILE).read_text("utf-8"))
    except FileNotFoundError:
        return None, None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        log.warning(
            "job %s rank %s worker %s: unreadable %s: %s",
            who.job,
            who.rank,
            who.worker,
            contract.PRERESTORE_FILE,
            exc,
            extra={"job": who.job},
        )
        return None, None
    if not isinstance(data, dict):
        return None, None
    step_raw = data.get("restore-step")
    step = (
        int(step_raw)
        if isinstance(step_raw, int | str) and contract.ascii_digits(str(step_raw))
        else None
    )
    source = data.get("restore-source")
    if source is None and data.get("restore-backup") is not None:
        source = "backup"  # The prior daemon names the backup instead.
    return step, None if source is None else str(source)


def _apply(directory: Path, plan: RestorePlan, rename: RenameStyle, who: _Who) -> RestoreResult:
    announced_step, source = _read_prerestore(directory, who)
    if plan.chosen is None or plan.step is None:
        _delete(directory, plan.stale)
        log.info(
            "job %s rank %s worker %s: nothing to restore, starting from scratch",
            who.job,
            who.rank,
            who.worker,
            extra={"job": who.job},
        )
        return RestoreResult(step=None, path=None, source=source)
    if announced_step is not None and announced_step != plan.step:
        log.warning(
            "job %s rank %s worker %s: %s announced step %s but the marker is for step %s",
            who.job,
            who.rank,
            who.worker,
            contract.PRERESTORE_FILE,
            announced_step,
            plan.step,
            extra={"job": who.job},
        )
    target = directory / restore_name(plan.step, rename, who.suffix)
    try:
        os.replace(directory / plan.chosen, target)
    except FileNotFoundError as exc:
        raise HandshakeError(
            f"restore marker {plan.chosen} vanished before it could be renamed: does another "
            f"process on this node also use worker index {who.worker}?"
        ) from exc
    except OSError as exc:
        raise HandshakeError(
            f"cannot rename restore marker {plan.chosen} to {target} ({exc}): move away "
            f"whatever is at {target}"
        ) from exc
    _delete(directory, plan.stale)
    log.info(
        "job %s rank %s worker %s: restoring step %s from %s via %s",
        who.job,
        who.rank,
        who.worker,
        plan.step,
        source or "unknown source",
        target,
        extra={"job": who.job},
    )
    return RestoreResult(step=plan.step, path=target, source=source)


def _delete(directory: Path, names: Iterable[str]) -> None:
    for name in names:
        (directory / name).unlink(missing_ok=True)
