"""``mtc upload``: the newest step of a job that no longer runs on this node, uploaded to the
backup and committed on an operator's demand. I/O: the store, the bucket.

A job that ended here without its newest step in the backup (a drain past its deadline, a
bucket down at the time, a daemon older than the drain at job ends) keeps its items on the
node (``node.reclaim``): they may be its only copy. This uploads them: the items of that
step the ``COMMIT`` lists and this node holds (its own rank's and its peers' copies,
``core.foreign.plan_kept_upload``), then tries the ``COMMIT``, which needs every listed
item: a job of several nodes is committed by the upload that completes the set, the last
node's. The job's layout comes from the config it last ran with here
(``ForeignItems.configs``). One upload per job at a time: a second request waits for the
one in flight and gets its answer; a caller that gives up does not stop it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from mtc_replicator.core.contract import ConfigError, parse_config
from mtc_replicator.core.foreign import KeptUploadPlan, UploadRefused, plan_kept_upload
from mtc_replicator.core.layout import format_ranks
from mtc_replicator.core.manifest import CancelCheck, Cancelled, ItemId, ManifestError
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.obs.metrics import NO_METRICS, Metrics, TransferKind
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStoreError, PreconditionFailed

log = logging.getLogger(__name__)


class UploadFailed(Exception):
    """The bucket failed the upload or its COMMIT; nothing committed was touched."""


@dataclass(frozen=True)
class KeptUpload:
    """What one ``mtc upload`` did."""

    job: str
    step: int
    uploaded: tuple[ItemId, ...]
    """The items uploaded now (none when the step was committed already)."""
    bytes: int
    committed: bool
    """Whether the bucket holds the step's ``COMMIT`` now."""
    already_committed: bool
    missing: tuple[ItemId, ...]
    """Not committed: the listed items the bucket still lacks (other nodes hold them)."""
    seconds: float
    backup: str
    """The backup's URL."""


class KeptUploads:
    """The daemon's ``mtc upload``s, one per job at a time."""

    def __init__(
        self,
        store: LocalStore,
        backups: BackupStore | None,
        executor: Executor,
        foreign: ForeignItems,
        *,
        current: Callable[[], Collection[str]],
        env: Mapping[str, str],
        cancelled: CancelCheck,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        """``env``: the ``$VAR`` values a recorded config expands (as at its handshake);
        ``cancelled``: the daemon stops (its pacer halted); ``current``: the jobs running
        here now, never uploaded this way."""
        self.store = store
        self.backups = backups
        self.executor = executor
        self.env = dict(env)
        self.cancelled = cancelled
        self.metrics = metrics
        self.foreign = foreign
        self.current = current
        self._running: dict[str, asyncio.Future[KeptUpload]] = {}

    async def upload(self, job: str, step: int | None = None) -> KeptUpload:
        """Upload ``job``'s ``step`` (None: its newest held that a COMMIT lists); raises
        ``UploadRefused`` or ``UploadFailed``. Joins an upload of ``job`` in flight."""
        task = self._running.get(job)
        if task is None or task.done():
            loop = asyncio.get_running_loop()
            task = loop.run_in_executor(self.executor, self._upload, job, step)
            self._running[job] = task
            task.add_done_callback(lambda t: self._forget(job, t))
        # Shielded: the caller's deadline ends its wait, never the upload.
        return await asyncio.shield(task)

    def _forget(self, job: str, task: asyncio.Future[KeptUpload]) -> None:
        if self._running.get(job) is task:
            del self._running[job]
        if not task.cancelled():
            task.exception()  # retrieved: a caller that gave up leaves no "never retrieved"

    def _upload(self, job: str, step: int | None) -> KeptUpload:
        """In a worker thread: plan, upload, commit."""
        t0 = time.monotonic()
        plan = self._plan(job, step)
        backups = self.backups
        assert backups is not None  # _plan refused otherwise
        try:
            if backups.read_commit(job, plan.step) is not None:
                log.info(
                    "upload of job %s step %d asked: the backup holds it already",
                    job,
                    plan.step,
                    extra={"job": job},
                )
                return self._done(plan, (), 0, committed=True, already=True, t0=t0)
            log.warning(
                "uploading job %s step %d on request: %d items held here of the %d its COMMIT "
                "lists, to %s",
                job,
                plan.step,
                len(plan.items),
                len(plan.listed),
                backups.url,
                extra={"job": job},
            )
            nbytes = self._put(backups, plan)
            record = backups.try_commit(job, plan.step, [i.key for i in plan.listed])
            missing = () if record is not None else tuple(backups.missing_items(plan.listed))
        except PreconditionFailed:
            # Committed meanwhile (another node's upload, the job's own coordinator).
            return self._done(plan, (), 0, committed=True, already=True, t0=t0)
        except (ObjectStoreError, ManifestError, OSError, Cancelled) as exc:
            raise UploadFailed(f"backup of job {job} step {plan.step} failed: {exc}") from exc
        return self._done(
            plan, plan.items, nbytes, committed=record is not None, missing=missing, t0=t0
        )

    def _plan(self, job: str, step: int | None) -> KeptUploadPlan:
        if job in self.current():
            raise UploadRefused(
                f"job {job} runs on this node now: its backups follow its interval, and its "
                "newest step is uploaded when it ends (client.finish_job) or on SIGTERM"
            )
        if self.backups is None:
            raise UploadRefused("this daemon has no --backup to upload to")
        held = list(self.store.manifests(job))
        if not held:
            raise UploadRefused(f"this node holds no items of job {job}")
        text = self.foreign.configs.load(job)
        if text is None:
            raise UploadRefused(
                f"this node does not know job {job}'s layout (its ranks and workers): the "
                "job ended here before this daemon recorded it; its items can only be kept "
                "or dropped (mtc drop)"
            )
        try:
            config = parse_config(text, self.env)
        except ConfigError as exc:
            raise UploadRefused(f"job {job}'s recorded config no longer parses: {exc}") from exc
        plan = plan_kept_upload(config, held, step)
        known = self.foreign.last.get(job)
        if step is None and known is not None and (known.committed or -1) > plan.step:
            # The job went on elsewhere and backed up later: this older step adds nothing.
            raise UploadRefused(
                f"the backup holds a newer step of job {job}, {known.committed}, than the "
                f"newest held here, {plan.step}: nothing to upload (--step uploads it anyway)"
            )
        return plan

    def _put(self, backups: BackupStore, plan: KeptUploadPlan) -> int:
        """Upload the plan's items (files, then each manifest); their bytes."""
        backups.abort_leftover_uploads(plan.job, {i.key for i in plan.items})
        nbytes = 0
        t0 = time.monotonic()
        for item in plan.items:
            manifest = self.store.get(item)
            if manifest is None:
                raise UploadFailed(f"{item} was dropped from this node during the upload")
            backups.upload_item(manifest, self.store.data_path(item), self.cancelled)
            nbytes += manifest.total_bytes
        self.metrics.transfer(TransferKind.BACKUP_UPLOAD, nbytes, max(time.monotonic() - t0, 1e-9))
        return nbytes

    def _done(
        self,
        plan: KeptUploadPlan,
        uploaded: tuple[ItemId, ...],
        nbytes: int,
        *,
        committed: bool,
        already: bool = False,
        missing: tuple[ItemId, ...] = (),
        t0: float,
    ) -> KeptUpload:
        job = plan.job
        assert self.backups is not None
        done = KeptUpload(
            job,
            plan.step,
            uploaded,
            nbytes,
            committed,
            already,
            missing,
            time.monotonic() - t0,
            self.backups.url,
        )
        if not already:
            if committed:
                log.warning(
                    "upload of job %s step %d on request: %d items, %d bytes in %.2fs; "
                    "committed in the backup",
                    job,
                    plan.step,
                    len(uploaded),
                    nbytes,
                    done.seconds,
                    extra={"job": job},
                )
            else:
                log.warning(
                    "upload of job %s step %d on request: %d items, %d bytes in %.2fs; not "
                    "committed: the backup lacks the items of ranks %s (run mtc upload --job "
                    "%s on the nodes that hold them)",
                    job,
                    plan.step,
                    len(uploaded),
                    nbytes,
                    done.seconds,
                    format_ranks({i.rank for i in missing}),
                    job,
                    extra={"job": job},
                )
        # The bucket changed: read it again, so that mtc status and the reclaim see it.
        self.foreign.recheck(job)
        self.foreign.held(self.current())
        return done
