"""Saving and loading PyTorch checkpoints in the layout the replicator daemon expects.

Owns: publishing a finished step as ONE rename of a complete temp directory (``<N>/``) or
temp file (``<job>-s<N>-n<rank>-w<worker>.save``), and reading a restore path back. Does file
I/O in CHECKPOINT_DIR. torch is imported inside the functions only, so ``import
mtc_replicator.client`` works without torch installed.

The daemon moves a published step into its store at once, so the returned path may already
be gone when the caller looks; load from the path ``handshake`` returns instead.

``torch.distributed.checkpoint`` (DCP) assumptions, documented here because the daemon's
restore depends on them: the ranks of one node write ONE shared ``<N>/`` (framework
``pytorch.distributed``, ``workers-per-node: 1``), and DCP runs over a process group made of
exactly this node's ranks. Then the group's rank 0 writes DCP's ``.metadata`` for this
node's shards and replicated tensors are deduplicated within the node only, so every node's
``<N>/`` is a self-contained checkpoint that the daemon can replicate and restore on its own.
Restoring requires the same ranks on the node (or a data-parallel equivalent with the same
layout). The node's group rank 0 prepares the temp dir and renames it after all ranks wrote.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from mtc_replicator.client import election
from mtc_replicator.client.handshake import RestoreResult
from mtc_replicator.core import contract
from mtc_replicator.core.jobname import check_job_name
from mtc_replicator.local.fsutil import fsync_dir

log = logging.getLogger(__name__)

DEFAULT_FILENAME = "state.pt"
RAM_DISK_SIZING = "docs/deploy.md#ram-disk-sizing"
"""Where ``CheckpointDirFull`` sends a user: the formula for the RAM disk's size."""


class CheckpointDirFull(OSError):
    """CHECKPOINT_DIR (the RAM disk) has no room for the step: said with the bytes free and
    the bytes the step needs, instead of torch's "unexpected pos 704 vs 598"."""

    def __init__(self, directory: Path, free: int, needed: int) -> None:
        super().__init__(
            errno.ENOSPC,
            f"CHECKPOINT_DIR full: {free} bytes free, the step needs {needed} "
            f"(at least; {directory}). Give the RAM disk more room: it holds several steps "
            f"per node (the restored one, those kept, the one being written, peers' copies), "
            f"see {RAM_DISK_SIZING}; or lower the daemon's --keep-steps (MTC_KEEP_STEPS) if "
            "it was raised",
        )
        self.free = free
        self.needed = needed


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _tensor_bytes(state: object, seen: set[int] | None = None) -> int:
    """The bytes of every tensor storage in ``state`` (nested mappings and sequences), each
    storage once: what ``torch.save`` writes at least."""
    seen = set() if seen is None else seen
    if isinstance(state, Mapping):
        return sum(_tensor_bytes(v, seen) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in state)
    storage = getattr(state, "untyped_storage", None)
    if storage is None:
        return 0
    untyped = storage()
    key = untyped.data_ptr() or id(untyped)
    if key in seen:
        return 0
    seen.add(key)
    return int(untyped.nbytes())


def _check_room(directory: Path, state_dict: Mapping[str, Any]) -> int:
    """Refuse a step that cannot fit before writing a byte of it; the bytes it needs."""
    needed = _tensor_bytes(state_dict)
    free = _free_bytes(directory)
    if needed > free:
        raise CheckpointDirFull(directory, free, needed)
    return needed


def _out_of_room(exc: BaseException) -> bool:
    """Whether a failed write ran out of space: ENOSPC, or torch's zip writer's way of
    saying so (``unexpected pos``: the bytes it wrote fell short)."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return isinstance(exc, RuntimeError) and (
        "unexpected pos" in str(exc) or "No space left" in str(exc)
    )


@contextlib.contextmanager
def _saying_when_full(directory: Path, needed: int) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        if _out_of_room(exc):
            raise CheckpointDirFull(directory, _free_bytes(directory), needed) from exc
        raise


def save_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    state_dict: Mapping[str, Any],
    *,
    filename: str = DEFAULT_FILENAME,
    zip_crc32: bool = False,
) -> Path:
    """``torch.save`` a state dict as step ``step``: temp dir, fsync, one rename to ``<N>``.

    The temp dir is ``step=<N>-unfinished``, a name the daemon ignores; it is removed when
    saving fails, so a partial ``<N>`` is never visible. Returns ``<checkpoint_dir>/<N>``.
    Raises ``CheckpointDirFull`` when CHECKPOINT_DIR has no room for it (checked before
    writing, and said again if the write runs out of space).
    ``zip_crc32``: see ``_torch_save``. Raises ``NotLocalRankZero`` in a process that the
    launcher says is not the node's local rank 0 (``election.check_saves_step_dir``).
    """
    election.check_saves_step_dir("save_state_dict")
    final, tmp = _step_paths(checkpoint_dir, step)
    _check_plain_name(filename)
    started = time.monotonic()
    needed = _check_room(final.parent, state_dict)
    _prepare_temp_dir(final, tmp)
    try:
        with _saying_when_full(final.parent, needed):
            _write_synced(tmp / filename, lambda f: _torch_save(state_dict, f, zip_crc32))
        _publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log_saved(final, step, started)
    return final


def load_state_dict(
    path: str | os.PathLike[str],
    *,
    filename: str = DEFAULT_FILENAME,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> dict[str, Any]:
    """Load a state dict from a restore path (a step directory, or a ``.save`` file).

    ``weights_only`` stays True by default: a checkpoint may have travelled through peers and
    a bucket, and unpickling arbitrary objects from it would run arbitrary code.
    """
    import torch

    source = Path(path)
    if source.is_dir():
        _check_plain_name(filename)
        source = source / filename
    with open(source, "rb") as f:
        loaded = torch.load(f, map_location=map_location, weights_only=weights_only)
    if not isinstance(loaded, dict):
        raise TypeError(f"{source} holds a {type(loaded).__name__}, not a state dict")
    return loaded


def save_file(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    state_dict: Mapping[str, Any],
    *,
    job: str,
    rank: int,
    worker: int,
    zip_crc32: bool = False,
) -> Path:
    """``torch.save`` one worker's checkpoint FILE for framework ``pytorch``.

    Written as ``<name>.tmp`` (ignored by the daemon), fsynced, then renamed to
    ``<job>-s<N>-n<rank>-w<worker>.save``: the daemon counts a step complete when all
    ``workers-per-node`` names exist, so a name must never point at a partial file.
    ``zip_crc32``: see ``_torch_save``.
    """
    final, tmp = _save_file_paths(checkpoint_dir, step, job, rank, worker)
    directory = final.parent
    started = time.monotonic()
    needed = _check_room(directory, state_dict)
    try:
        with _saying_when_full(directory, needed):
            _write_synced(tmp, lambda f: _torch_save(state_dict, f, zip_crc32))
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    _log_saved(final, step, started)
    return final


# --- torch.distributed.checkpoint --------------------------------------------------------------


def node_process_group(local_world_size: int | None = None) -> Any:
    """The process group of this node's ranks, for ``save_distributed`` on several nodes.

    Collective: every rank of the job calls it once, in the same order as its other group
    creations. Assumes torchrun's numbering (node ``k`` holds ranks ``k*L .. k*L+L-1``);
    ``local_world_size`` defaults to ``$LOCAL_WORLD_SIZE``.
    """
    import torch.distributed as dist

    size = local_world_size if local_world_size is not None else _env_local_world_size()
    if size is None:
        raise ValueError("pass local_world_size or set LOCAL_WORLD_SIZE (torchrun sets it)")
    group, _ = dist.new_subgroups(group_size=size)  # type: ignore[no-untyped-call]
    return group


def save_distributed(
    checkpoint_dir: str | os.PathLike[str],
    step: int,
    state_dict: dict[str, Any],
    *,
    process_group: Any = None,
) -> Path:
    """Save with ``torch.distributed.checkpoint`` as step ``step`` of this node.

    Collective over ``process_group``, which must hold exactly this node's ranks (see the
    module docstring); None means the default group, allowed for a single-node job only.
    Without an initialized process group this saves from this process alone. All ranks
    write into ``step=<N>-unfinished``; the group's rank 0 renames it to ``<N>`` once DCP has
    finished on every rank, and every rank returns only after that rename.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    final, tmp = _step_paths(checkpoint_dir, step)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        started = time.monotonic()
        _prepare_temp_dir(final, tmp)
        try:
            dcp_save(state_dict, checkpoint_id=tmp, no_dist=True)
            _publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _log_saved(final, step, started)
        return final

    _check_node_group(dist, process_group)
    leader = dist.get_rank(process_group) == 0
    started = time.monotonic()
    _agree(dist, process_group, lambda: _prepare_temp_dir(final, tmp), leader)
    try:
        dcp_save(state_dict, checkpoint_id=tmp, process_group=process_group)
    except BaseException:
        # DCP re-raises a failure on every rank after its collectives, so nobody is still
        # writing into the temp dir when the leader removes it.
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _agree(dist, process_group, lambda: _publish_dir(tmp, final), leader)
    if leader:
        _log_saved(final, step, started)
    return final


def load_distributed(
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    *,
    process_group: Any = None,
) -> None:
    """Load a DCP checkpoint from a restore path into ``state_dict``, in place.

    Collective over ``process_group`` (the same node group used to save) when a process
    group is initialized; otherwise this process loads alone.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    distributed = dist.is_available() and dist.is_initialized()
    dcp_load(
        state_dict,
        checkpoint_id=Path(path),
        process_group=process_group if distributed else None,
        no_dist=not distributed,
    )


def share_restore(result: RestoreResult | None, *, process_group: Any = None) -> RestoreResult:
    """Give every rank of ``process_group`` the ``RestoreResult`` of its rank 0.

    With ``pytorch.distributed`` only the node's local rank 0 runs ``handshake`` (one
    ``<N>/`` per node); the others pass None and receive its result. Collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if result is None:
            raise ValueError("without a process group, pass this process's own result")
        return result
    box: list[RestoreResult | None] = [result]
    dist.broadcast_object_list(
        box, src=_leader_global_rank(dist, process_group), group=process_group
    )
    shared = box[0]
    if not isinstance(shared, RestoreResult):
        raise TypeError("rank 0 of the group passed no RestoreResult")
    return shared


# --- Helpers -----------------------------------------------------------------------------------


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


def _check_plain_name(name: str) -> None:
    if not name or name in {".", ".."} or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(f"filename must be a plain file name, got {name!r}")


def _step_paths(checkpoint_dir: str | os.PathLike[str], step: int) -> tuple[Path, Path]:
    """``(<N>, step=<N>-unfinished)`` for one step."""
    _check_step(step)
    directory = Path(checkpoint_dir)
    return directory / str(step), directory / contract.client_step_tmp_name(step)


def _save_file_paths(
    checkpoint_dir: str | os.PathLike[str], step: int, job: str, rank: int, worker: int
) -> tuple[Path, Path]:
    """``(<job>-s<N>-n<rank>-w<worker>.save, <that>.tmp)``, checked; refused when the
    ``.save`` name exists already."""
    _check_step(step)
    check_job_name(job)
    for label, value in (("rank", rank), ("worker", worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{label} must be an integer >= 0, got {value!r}")
    final = Path(checkpoint_dir) / contract.save_file_name(job, step, rank, worker)
    if os.path.lexists(final):
        raise FileExistsError(f"{final} already exists; a step is saved once")
    return final, final.with_name(final.name + contract.SAVE_TMP_SUFFIX)


def _prepare_temp_dir(final: Path, tmp: Path) -> None:
    if os.path.lexists(final):
        # A renamed restore marker of the same step is a symlink named <N>: renaming onto it
        # would fail, and renaming onto an empty directory would silently replace it.
        raise FileExistsError(f"{final} already exists; a step is saved once")
    if os.path.lexists(tmp):
        log.warning("step %s: removing %s left by an interrupted save", final.name, tmp)
        shutil.rmtree(tmp)
    tmp.mkdir()


class _ZipCrc32Off:
    """Turns torch's process-wide zip CRC32 switch off while any save here needs it off.

    Counted, so that concurrent saves in several threads run in parallel and the caller's
    own setting comes back when the last one ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saves = 0
        self._previous = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        from torch import serialization

        with self._lock:
            if self._saves == 0:
                self._previous = serialization.get_crc32_options()
                serialization.set_crc32_options(False)
            self._saves += 1
        try:
            yield
        finally:
            with self._lock:
                self._saves -= 1
                if self._saves == 0:
                    serialization.set_crc32_options(self._previous)


_zip_crc32_off = _ZipCrc32Off()


def _torch_save(state_dict: Mapping[str, Any], f: Any, zip_crc32: bool) -> None:
    """``torch.save``, by default without the zip format's CRC32 of every record.

    ``torch.load`` never checks those CRCs (only zip tools do), and computing them is about a
    third of a save's time on tmpfs (0.19 s of 0.57 s per GiB here): time the training loop
    waits. Integrity is the replicator's job: it checksums every file (crc32c) as it takes
    the step and checks every byte again on every copy and restore. ``zip_crc32=True``
    writes them, for files that zip tools must accept. torch's switch is process-wide: a
    plain ``torch.save`` in another thread during this save skips its CRCs too, which costs
    it nothing but the zip tools' check.
    """
    import torch

    if zip_crc32 or not hasattr(torch.serialization, "set_crc32_options"):
        torch.save(dict(state_dict), f)  # (the switch came with torch 2.3)
        return
    with _zip_crc32_off.held():
        torch.save(dict(state_dict), f)


def _write_synced(path: Path, write: Callable[[Any], object]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _publish_dir(tmp: Path, final: Path) -> None:
    """Make the complete temp dir visible as ``<N>`` with one rename."""
    for sub in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        fsync_dir(sub)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def _log_saved(final: Path, step: int, started: float) -> None:
    seconds = time.monotonic() - started
    size = _size_of(final)
    log.info(
        "step %s: saved %s (%d bytes, %.3f s, %.1f MB/s)",
        step,
        final,
        size,
        seconds,
        size / 1e6 / seconds if seconds > 0 else 0.0,
    )


def _size_of(path: Path) -> int:
    # The daemon may already have moved the step away; the size is for the log only.
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def _env_local_world_size() -> int | None:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def _check_node_group(dist: Any, process_group: Any) -> None:
    if process_group is not None:
        return
    local = _env_local_world_size()
    world = dist.get_world_size()
    if local is not None and local != world:
        raise ValueError(
            f"the default process group spans {world} ranks but this node runs {local}: pass "
            "process_group=node_process_group() so that each node saves its own <N>/"
        )


def _leader_global_rank(dist: Any, process_group: Any) -> int:
    return 0 if process_group is None else int(dist.get_global_rank(process_group, 0))


def _agree(dist: Any, process_group: Any, action: Callable[[], None], leader: bool) -> None:
    """Run ``action`` on the group's rank 0 and raise its failure on every rank.

    A broadcast of the outcome doubles as the barrier: nobody proceeds before rank 0 acted.
    """
    failure: Exception | None = None
    outcome: list[str | None] = [None]
    if leader:
        try:
            action()
        except Exception as exc:
            failure = exc
            outcome[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(
        outcome, src=_leader_global_rank(dist, process_group), group=process_group
    )
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise RuntimeError(f"rank 0 of this node's group failed: {outcome[0]}")
