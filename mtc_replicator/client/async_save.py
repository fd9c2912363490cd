"""Asynchronous saves: the training loop waits for a snapshot, not for the write.

Owns: ``AsyncSaver``, which snapshots a state dict into staging buffers it reuses
(``client.staging``; for DCP, torch's own ``async_save`` and stager) and then serializes,
writes and publishes the step in a background thread with the same temp names and the same
ONE publishing rename as ``client.torch_io``'s synchronous saves; at most one save in
flight; the newest save's staged state (``staged``: what a second copy of it is written
from); errors of the background surfacing on the next call and on ``wait()``; and the
opt-in SIGTERM handler that finishes the save in flight before the process goes. Does file
I/O in CHECKPOINT_DIR (in the background thread). torch is imported when a saver is made.

What a kill leaves: the step's temp name (``step=<N>-unfinished/`` or
``<job>-s<N>-n<rank>-w<worker>.save.tmp``), which the daemon never takes as a step and
removes at the next handshake (``core.contract.is_client_temp_name``), or the complete step.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, BinaryIO, Literal

from mtc_replicator.client import election, torch_io
from mtc_replicator.client.staging import Snapshot, Staging
from mtc_replicator.local.fsutil import fsync_dir

log = logging.getLogger(__name__)

WhenBusy = Literal["wait", "skip"]
"""What a save does while the previous one is still being written: wait for it, or skip
this step (the call returns None)."""

PhaseHook = Callable[[str], None]
"""Called at each phase of a save (``snapshot``, ``write``, ``rename``, ``published``);
for tests that stop a save there."""


class AsyncSaveError(RuntimeError):
    """A background save failed; ``__cause__`` is its error (``CheckpointDirFull``, ...).
    Nothing of that step is visible: its temp name was removed."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(f"the asynchronous save of step {step} failed: {error}")
        self.step = step


class _Job:
    """One save being written in the background."""

    def __init__(self, step: int, final: Path) -> None:
        self.step = step
        self.final = final
        self.error: BaseException | None = None
        self.reported = False
        self.thread: threading.Thread | None = None
        self.finished = threading.Event()

    def join(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def outcome(self) -> Path:
        """The published path, or the failure (raised once: a reported failure is spent)."""
        if self.error is not None and not self.reported:
            self.reported = True
            raise AsyncSaveError(self.step, self.error) from self.error
        return self.final


@dataclass(frozen=True)
class Staged:
    """The newest save as it was staged, which is what it writes: its step, and its state
    with every tensor replaced by a staging buffer (the saver's own, or the DCP stager's).
    The next save reuses the buffers: read it before that, from the loop's thread."""

    step: int
    tree: Any
    ready: Callable[[], None]
    """Block until the device copies have landed (nothing to wait for on the CPU path)."""


class PendingSave:
    """A save returned to the loop before it was written."""

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.step = job.step
        self.path = job.final
        """Where the step is published (the daemon may have moved it away already)."""

    def done(self) -> bool:
        return self._job.finished.is_set()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until published; the path, or ``AsyncSaveError``. ``TimeoutError`` when
        ``timeout`` passed first."""
        if not self._job.join(timeout):
            raise TimeoutError(f"step {self.step} is still being written")
        return self._job.outcome()


class AsyncSaver:
    """Saves of one worker's state into CHECKPOINT_DIR, written in the background.

    The extra host memory is one copy of the state's tensors (staging buffers, reused;
    pinned for CUDA tensors). A save returns once the snapshot is taken: CPU tensors are
    copied, CUDA tensors' copies are enqueued on a side stream that the loop's stream then
    waits for; changing the tensors afterwards does not change what is saved. Use one saver
    per process, from the training loop's thread.
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        *,
        when_busy: WhenBusy = "wait",
        zip_crc32: bool = False,
        offload: Collection[str] = ("cuda",),
        phase_hook: PhaseHook | None = None,
    ) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        self.directory = Path(checkpoint_dir)
        self.when_busy = when_busy
        self.zip_crc32 = zip_crc32
        self.staging = Staging(offload=offload)
        self._hook = phase_hook
        self._job: _Job | None = None
        self._dcp_stager: Any = None
        self._dcp_staged: Any = None
        self._staged: Staged | None = None
        self._sigterm: tuple[Callable[..., Any], Any] | None = None
        self.last_stall = 0.0
        """Seconds the last save blocked its caller (waiting for the previous one included)."""

    # --- saving -------------------------------------------------------------------------------

    def save_state_dict(
        self, step: int, state_dict: Mapping[str, Any], *, filename: str = "state.pt"
    ) -> PendingSave | None:
        """``torch_io.save_state_dict``, asynchronously: ``<N>/<filename>`` published by one
        rename of ``step=<N>-unfinished/``. None when skipped (``when_busy="skip"``).
        ``NotLocalRankZero`` outside the node's local rank 0, as the synchronous save."""
        election.check_saves_step_dir("AsyncSaver.save_state_dict")
        started = time.monotonic()
        if not self._settle(step):
            return None
        final, tmp = torch_io._step_paths(self.directory, step)
        torch_io._check_plain_name(filename)
        if os.path.lexists(final):
            raise FileExistsError(f"{final} already exists; a step is saved once")
        needed = torch_io._check_room(self.directory, state_dict)
        snap = self._snapshot(step, state_dict)

        def write() -> None:
            torch_io._prepare_temp_dir(final, tmp)
            try:
                self._write(tmp / filename, snap, needed)
                self._phase("rename")
                torch_io._publish_dir(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

        return self._start(step, final, snap, write, started)

    def save_file(
        self, step: int, state_dict: Mapping[str, Any], *, job: str, rank: int, worker: int
    ) -> PendingSave | None:
        """``torch_io.save_file``, asynchronously: ``<job>-s<N>-n<rank>-w<worker>.save``,
        written as ``<that>.tmp`` and renamed. None when skipped."""
        started = time.monotonic()
        if not self._settle(step):
            return None
        final, tmp = torch_io._save_file_paths(self.directory, step, job, rank, worker)
        needed = torch_io._check_room(self.directory, state_dict)
        snap = self._snapshot(step, state_dict)

        def write() -> None:
            try:
                self._write(tmp, snap, needed)
                self._phase("rename")
                os.rename(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(self.directory)

        return self._start(step, final, snap, write, started)

    def save_distributed(
        self, step: int, state_dict: dict[str, Any], *, process_group: Any = None
    ) -> PendingSave | None:
        """``torch_io.save_distributed`` through torch's ``dcp.async_save``: DCP stages the
        state with its own stager (kept, so its buffers are reused), writes into
        ``step=<N>-unfinished/`` in the background, and the node group's rank 0 then renames
        it to ``<N>``. Collective, as the synchronous one; ``process_group`` must have a CPU
        backend (gloo) and be used for nothing else while a save is in flight, because the
        background thread runs DCP's collectives and the rename's agreement on it. In a
        process group a busy saver always waits (``when_busy`` is not applied): a skip
        would have to be decided alike on every rank."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import async_save

        started = time.monotonic()
        distributed = dist.is_available() and dist.is_initialized()
        # Skipping would have to be decided by every rank alike; waiting is.
        if not self._settle(step, may_skip=not distributed):
            return None
        final, tmp = torch_io._step_paths(self.directory, step)
        group = process_group if distributed else None
        leader = not distributed or dist.get_rank(process_group) == 0

        def prepare() -> None:
            torch_io._prepare_temp_dir(final, tmp)

        if distributed:
            torch_io._check_node_group(dist, process_group)
            torch_io._agree(dist, process_group, prepare, leader)
        else:
            prepare()
        try:
            response = async_save(
                state_dict,
                checkpoint_id=tmp,
                process_group=group,
                no_dist=not distributed,
                async_stager=self._stager(),
            )
        except BaseException:
            if leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        # Staging is synchronous with this stager: a plain Future of the upload comes back.
        upload = response if isinstance(response, Future) else response.upload_completion
        self._staged = Staged(step, self._dcp_staged, _staged_already)
        self._phase("snapshot")

        def write() -> None:
            try:
                upload.result()
            except BaseException:
                if leader:  # DCP raised on every rank: nobody writes into tmp any more
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._phase("rename")

            def publish() -> None:
                torch_io._publish_dir(tmp, final)

            if distributed:
                torch_io._agree(dist, process_group, publish, leader)
            else:
                publish()

        return self._start(step, final, None, write, started)

    @property
    def staged(self) -> Staged | None:
        """The newest save's state as staged (None before the first save and after
        ``close()``): what a copy of that save elsewhere is written from, though the loop
        changed its tensors since, until the next save reuses the buffers."""
        return self._staged

    # --- waiting ------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether a save is being written now."""
        return self._job is not None and not self._job.finished.is_set()

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the save in flight is published: its path (None when there was none),
        or ``AsyncSaveError`` for a failure not reported yet. ``TimeoutError`` on timeout."""
        job = self._job
        if job is None:
            return None
        if not job.join(timeout):
            raise TimeoutError(f"step {job.step} is still being written")
        return job.outcome()

    def close(self) -> None:
        """Wait for the save in flight (raising its failure), then free the staging buffers
        and put back the SIGTERM handler ``finish_on_sigterm`` replaced."""
        try:
            self.wait()
        finally:
            self._staged = self._dcp_staged = None
            self.staging.release()
            if self._dcp_stager is not None:
                self._dcp_stager.close()
                self._dcp_stager = None
            self._restore_sigterm()

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except AsyncSaveError as failure:  # the loop's own exception is the one to see
            log.error("%s", failure)

    # --- preemption ---------------------------------------------------------------------------

    def finish_on_sigterm(self) -> None:
        """On SIGTERM, finish and publish the save in flight, then do what the previous
        handler did (call it; the default: terminate by SIGTERM; ignored: go on).

        Opt-in; from the main thread (Python's rule for signal handlers). A save whose
        snapshot was still being taken when the signal came is not written.
        """
        if self._sigterm is not None:
            return
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm = (self._on_sigterm, previous)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        job = self._job
        if job is not None and not job.finished.is_set():
            log.warning("step %s: SIGTERM, finishing its save before exiting", job.step)
        try:
            self.wait()
        except AsyncSaveError as failure:
            log.error("SIGTERM: %s", failure)
        previous = self._sigterm[1] if self._sigterm is not None else signal.SIG_DFL
        self._restore_sigterm()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)  # the default action, now that it is back

    def _restore_sigterm(self) -> None:
        if self._sigterm is None:
            return
        ours, previous = self._sigterm
        self._sigterm = None
        if signal.getsignal(signal.SIGTERM) == ours:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    # --- the parts ----------------------------------------------------------------------------

    def _settle(self, step: int, *, may_skip: bool = True) -> bool:
        """Deal with the previous save before this one: False to skip this one. Raises the
        previous save's failure when nobody was told of it yet."""
        job = self._job
        if job is None:
            return True
        if not job.finished.is_set():
            if self.when_busy == "skip" and may_skip:
                log.info("step %s: skipped, step %s is still being written", step, job.step)
                return False
            waited = time.monotonic()
            job.join()
            log.info(
                "step %s: waited %.3f s for step %s to be written",
                step,
                time.monotonic() - waited,
                job.step,
            )
        self._job = None
        job.outcome()
        return True

    def _snapshot(self, step: int, state_dict: Mapping[str, Any]) -> Snapshot:
        snap = self.staging.snapshot(state_dict)
        self._staged = Staged(step, snap.tree, functools.partial(_staged_ready, snap))
        self._phase("snapshot")
        return snap

    def _phase(self, name: str) -> None:
        if self._hook is not None:
            self._hook(name)

    def _write(self, path: Path, snap: Snapshot, needed: int) -> None:
        hook = self._hook

        def save(f: BinaryIO) -> None:
            # Waited for with the temp file already there: a preStop wait (``wait_saves``)
            # sees the save in flight while the device copies land.
            snap.ready()
            torch_io._torch_save(
                snap.tree, f if hook is None else _Watched(f, hook), self.zip_crc32
            )

        with torch_io._saying_when_full(self.directory, needed):
            torch_io._write_synced(path, save)

    def _start(
        self,
        step: int,
        final: Path,
        snap: Snapshot | None,
        write: Callable[[], None],
        started: float,
    ) -> PendingSave:
        job = _Job(step, final)
        self.last_stall = time.monotonic() - started
        if snap is not None:
            log.info(
                "step %s: snapshot of %d bytes taken in %.3f s; writing %s in the background",
                step,
                snap.nbytes,
                self.last_stall,
                final,
            )

        def run() -> None:
            try:
                write()
                self._phase("published")
                torch_io._log_saved(final, step, started)
            except BaseException as exc:
                job.error = exc
                log.error("step %s: the asynchronous save failed: %s", step, exc)
            finally:
                job.finished.set()

        job.thread = threading.Thread(target=run, name=f"mtc-save-{step}")
        # Started before it is recorded as in flight: a SIGTERM handler that ran in between
        # (this thread) would otherwise wait forever for a thread that cannot start until
        # the handler returns.
        job.thread.start()
        self._job = job
        return PendingSave(job)

    def _stager(self) -> Any:
        """torch's DCP stager, kept for the saver's life so that its buffers are reused."""
        if self._dcp_stager is None:
            import torch

            try:
                from torch.distributed.checkpoint.staging import DefaultStager
            except ImportError as exc:
                raise RuntimeError(
                    f"torch {torch.__version__} has no DCP DefaultStager, which the "
                    "asynchronous DCP save stages with: use torch_io.save_distributed, or a "
                    "newer torch"
                ) from exc

            saver = self

            class KeepingStager(DefaultStager):
                """Remembers what it staged last: the saver's ``staged`` for DCP."""

                def stage(self, state_dict: Any, **kwargs: Any) -> Any:
                    saver._dcp_staged = super().stage(state_dict, **kwargs)
                    return saver._dcp_staged

            self._dcp_stager = KeepingStager(dcp_staging_options())
        return self._dcp_stager


def dcp_staging_options() -> Any:
    """How a DCP stager copies a state dict to host memory here, before the call returns:
    into pinned buffers, without blocking each copy, when CUDA is there."""
    import torch
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = bool(torch.cuda.is_available())
    return StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=False,
        use_non_blocking_copy=cuda,
    )


def _staged_ready(snap: Snapshot) -> None:
    """``snap.ready()`` beside the writer's own: the writer empties ``snap.waits`` once it
    waited, so this waits on a copy of the list (a device event may be waited on again, from
    any thread)."""
    for wait in list(snap.waits):
        wait()


def _staged_already() -> None:
    """DCP's stager returns once its copies are done."""


class _Watched:
    """A file torch writes into that reports the ``write`` phase at its first bytes."""

    def __init__(self, f: BinaryIO, phase: PhaseHook) -> None:
        self._f = f
        self._phase: PhaseHook | None = phase

    def write(self, data: Any) -> int:
        written = self._f.write(data)
        if self._phase is not None:
            phase, self._phase = self._phase, None
            phase("write")
        return written

    def flush(self) -> None:
        self._f.flush()
