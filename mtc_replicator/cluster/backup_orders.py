"""A rank's backups, from the coordinator's order to the ``COMMIT``: one owner for the ordered
upload and the drain's, with one error policy. I/O: the store and the bucket, in threads.

Order, upload, report, commit:

1. the coordinator orders a step in its answer to a progress report; each uploader
   (``core.layout.backup_uploaders``) takes the order (``BackupOrders.take``) and uploads
   its items (``storage.upload``), one order at a time;
2. the next progress report says the step is uploaded (``BackupOrders.uploaded``);
3. once every uploader has, the coordinator writes the ``COMMIT`` (``commit_backup``,
   called by ``cluster.coordinators``); one that cannot be written orders the step again;
4. a drain (SIGTERM, the job's end here) does 1 and 3 itself for the newest step
   (``BackupOrders.drain``): an ordered upload of that step is let end, one of another step
   cancelled, and the ``COMMIT`` tried; in a cluster the last uploader to drain writes it.

One policy for a failed upload or ``COMMIT`` (``BACKUP_FAILURES``): the bucket, this node's
disk or a record read back is at fault, and the step is tried again (an order after a
growing wait, a ``COMMIT`` after ``COMMIT_RETRY_SECONDS``) or left to the next tier; any
other exception is a bug and is not taken for a bucket's failure.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.coordination import COMMIT_RETRY_SECONDS, JobCoordinator
from mtc_replicator.core.layout import backup_items
from mtc_replicator.core.manifest import CancelCheck, Cancelled, ManifestError
from mtc_replicator.core.retry import Backoff
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStoreError, PreconditionFailed
from mtc_replicator.storage.upload import ItemNotHeld, upload_step

log = logging.getLogger(__name__)

BACKUP_FAILURES: tuple[type[Exception], ...] = (ObjectStoreError, ManifestError, OSError)
"""What an upload or a ``COMMIT`` fails with when the bucket (refused, down, slow), this
node's disk or a record read back (a manifest, a ``COMMIT`` not believed) is at fault."""

UPLOAD_RETRY_MAX = 300.0
"""Longest wait before a failed upload is tried again: the coordinator repeats its order at
every report (each second in a small job), and a bucket down for an hour must not write a
line to ``replicator.errors`` every second."""

CommitBackup = Callable[[str, int, Sequence[str]], CommitRecord | None]
"""Write the COMMIT of ``(job, step)`` naming these item keys (``BackupStore.try_commit``;
blocking I/O, run in a thread): the record, or None while an item's manifest is missing."""
RunThread = Callable[..., Awaitable[object]]
ErrorSink = Callable[[str, int | None], None]


class Uploaded(enum.Enum):
    """How one upload of this rank's items of a step ended."""

    DONE = "uploaded"
    COMMITTED = "committed already"
    NOT_HELD = "an item is no longer held"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class Upload:
    result: Uploaded
    why: str = ""


@dataclass(frozen=True)
class CommitAttempt:
    """One try of a step's ``COMMIT``."""

    record: CommitRecord | None
    """The step's ``COMMIT`` (written now, or by another writer first); None: not written."""
    failure: str | None = None
    """Why it could not be tried (``BACKUP_FAILURES``); None: tried."""

    @property
    def why(self) -> str:
        """Why the step is not committed."""
        return self.failure or "an uploaded item's manifest is missing"


async def upload_items(
    backups: BackupStore,
    store: LocalStore,
    config: JobConfig,
    step: int,
    *,
    run_thread: RunThread,
    log: JobLog,
    metrics: Metrics,
    cancelled: CancelCheck = lambda: False,
) -> Upload:
    """Upload this rank's items of ``step``; how it ended, by the one policy."""
    try:
        await upload_step(
            backups,
            store,
            config,
            step,
            run_thread=run_thread,
            log=log,
            metrics=metrics,
            cancelled=cancelled,
        )
    except ItemNotHeld as exc:
        return Upload(Uploaded.NOT_HELD, f"{exc.item} is no longer held")
    except PreconditionFailed:
        return Upload(Uploaded.COMMITTED)
    except Cancelled:
        return Upload(Uploaded.CANCELLED)
    except BACKUP_FAILURES as exc:
        return Upload(Uploaded.FAILED, str(exc))
    return Upload(Uploaded.DONE)


async def commit_backup(
    commit: CommitBackup | None,
    config: JobConfig,
    step: int,
    *,
    run_thread: RunThread = asyncio.to_thread,
) -> CommitAttempt:
    """Try the ``COMMIT`` of ``step``, naming every uploader's items (``backup_items``)."""
    if commit is None:
        return CommitAttempt(None, "this daemon has no backup store")
    keys = [i.key for i in backup_items(config, step)]
    try:
        record = await run_thread(commit, config.job_name, step, keys)
    except BACKUP_FAILURES as exc:
        return CommitAttempt(None, str(exc))
    return CommitAttempt(cast(CommitRecord | None, record))


async def commit_ordered(
    commit: CommitBackup | None,
    coordinator: JobCoordinator,
    step: int,
    clock: Callable[[], float] = time.time,
) -> None:
    """The coordinator's part: write the ``COMMIT`` of the backup it ordered, once every
    uploader reported it done (``JobCoordinator.take_commit``), and tell the state machine;
    not written, the backup is ordered again later. A bug is raised as one, after that."""
    job = coordinator.config.job_name
    extra = {"job": job, "step": step}
    try:
        attempt = await commit_backup(commit, coordinator.config, step)
    except BaseException:
        coordinator.backup_not_committed(step, clock())  # never left waiting on it
        raise
    if attempt.record is None:
        coordinator.backup_not_committed(step, clock())
        log.warning(
            "backup of step %d not committed (%s); ordering a backup again in %.0fs",
            step,
            attempt.why,
            COMMIT_RETRY_SECONDS,
            extra=extra,
        )
        return
    coordinator.backup_committed(step, attempt.record.created)
    log.info("backup of step %d committed: %d items", step, len(attempt.record.items), extra=extra)


class BackupOrders:
    """This rank's uploads: the coordinator's orders, one at a time, and the drain's.

    ``backups`` None: the daemon has no backup, and orders are ignored. ``error`` tells the
    workload of a failed ordered upload; ``clock`` (``time.monotonic``) times its retry.
    """

    def __init__(
        self,
        config: JobConfig,
        store: LocalStore,
        backups: BackupStore | None,
        *,
        run_thread: RunThread,
        error: ErrorSink,
        metrics: Metrics = NO_METRICS,
        clock: Callable[[], float] = time.monotonic,
        on_news: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.store = store
        self.backups = backups
        self.run_thread = run_thread
        self.error = error
        self.metrics = metrics
        self.clock = clock
        self.on_news = on_news
        """Called once an ordered upload is done with its step: the report that says so
        lets the coordinator write the ``COMMIT``, so it should not wait for a rescan."""
        self.uploading: int | None = None
        """The ordered step being uploaded now (retention keeps it)."""
        self.uploaded: int | None = None
        """The newest ordered step done: uploaded, committed already, or no longer held."""
        self._task: asyncio.Task[None] | None = None
        self._halt_ordered = threading.Event()
        """Set to stop the ordered upload's thread: cancelling its task leaves the thread
        uploading (the drain's upload would share the link with it)."""
        self._retry = Backoff(first=2.0, cap=UPLOAD_RETRY_MAX)
        self._retry_at = 0.0
        """After a failed upload, the order (repeated at every report) waits until then."""
        self._log = JobLog(log, config.job_name, config.node_rank)

    def take(self, step: int | None, *, reported: int | None) -> None:
        """The coordinator's order in an answer to a report that said ``reported`` was the
        newest uploaded step: upload ``step`` unless an upload is in flight or waits after
        a failure.

        An order of the step this rank finished uploading after it sent that report is
        stale: the next report says it is done. Uploaded again, it raced retention (the
        step dropped midway) and wrote objects twice.
        """
        stale = step is not None and step == self.uploaded and reported != step
        if (
            step is None
            or stale
            or self.backups is None
            or self.uploading is not None
            or self.clock() < self._retry_at
        ):
            return
        self.uploading = step
        self._halt_ordered = threading.Event()
        self._task = asyncio.create_task(self._ordered(step), name=f"backup-{step}")
        # A task cancelled before its first step never runs ``_ordered``'s ``finally``.
        self._task.add_done_callback(lambda _: self._ended(step))

    def _ended(self, step: int) -> None:
        if self.uploading == step:
            self.uploading = None

    async def _upload(
        self, backups: BackupStore, step: int, cancelled: CancelCheck = lambda: False
    ) -> Upload:
        return await upload_items(
            backups,
            self.store,
            self.config,
            step,
            run_thread=self.run_thread,
            log=self._log,
            metrics=self.metrics,
            cancelled=cancelled,
        )

    async def _ordered(self, step: int) -> None:
        backups = self.backups
        assert backups is not None
        self._log.info("backup of step %d ordered: uploading to %s", step, backups.url, step=step)
        try:
            upload = await self._upload(backups, step, self._halt_ordered.is_set)
        finally:
            self.uploading = None
        if upload.result is Uploaded.FAILED:
            wait = self._retry.next()
            self._retry_at = self.clock() + wait
            self.error(
                f"backup of step {step} to {backups.url} failed, will retry in {wait:.0f}s: "
                f"{upload.why}",
                step,
            )
        elif upload.result is not Uploaded.CANCELLED:
            # Not held: retention dropped it before the order arrived (a newer step became
            # restorable meanwhile). Done, so the coordinator's next order names a step this
            # rank holds instead of waiting on this one for ever.
            if upload.result is Uploaded.NOT_HELD:
                self._log.info("backup of step %d skipped: %s", step, upload.why, step=step)
            self.uploaded = step
            if upload.result is Uploaded.DONE:
                self._retry.reset()
            self.on_news()

    async def settle(self, step: int) -> bool:
        """Let an ordered upload of ``step`` end (True once it did), or cancel an upload of
        another step, which an upload of ``step`` would share the link with."""
        task = self._task
        if task is None or task.done():
            return self.uploaded is not None and self.uploaded >= step
        if self.uploading != step:
            # Its thread too: it stops at its next check (files in flight end).
            self._halt_ordered.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return False
        await asyncio.wait([task])
        return self.uploaded == step

    async def is_committed(self, step: int | None) -> bool:
        """Whether the bucket holds a ``COMMIT`` of ``step`` (False when it cannot say)."""
        if self.backups is None or step is None:
            return False
        job = self.config.job_name
        try:
            return await self.run_thread(self.backups.read_commit, job, step) is not None
        except BACKUP_FAILURES as exc:
            self._log.warning("drain: cannot read the backup's COMMIT: %s", exc, step=step)
            return False

    async def drain(self, step: int, cancelled: CancelCheck) -> bool | None:
        """Upload this rank's items of ``step`` and try its ``COMMIT``: True committed,
        False uploaded (other uploaders' items missing), None failed."""
        backups = self.backups
        assert backups is not None
        t0 = time.monotonic()
        if not await self.settle(step):
            upload = await self._upload(backups, step, cancelled)
            if upload.result not in (Uploaded.DONE, Uploaded.COMMITTED):
                why = upload.why or upload.result.value
                self._log.warning("drain: backup of step %d failed: %s", step, why, step=step)
                return None
        attempt = await commit_backup(
            backups.try_commit, self.config, step, run_thread=self.run_thread
        )
        if attempt.failure is not None:
            self._log.warning(
                "drain: backup of step %d failed: %s", step, attempt.failure, step=step
            )
            return None
        if attempt.record is None:
            self._log.info(
                "drain: step %d uploaded; not committed: other uploaders' items are missing "
                "(the last of them to drain, or the coordinator's next order, commits it)",
                step,
                step=step,
            )
            return False
        self.metrics.backed_up(self.config.job_name, step, attempt.record.created)
        self._log.info(
            "drain: backup of step %d committed in %.2fs", step, time.monotonic() - t0, step=step
        )
        return True

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._halt_ordered.set()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
