"""The RAM held by jobs that no longer run on this node, given back. I/O: the store, the
bucket's COMMITs, ``statvfs``.

``core.foreign`` decides; this module looks (which jobs are held, whether their newest
step is committed in the backup, how much room is free) and drops. Called from the daemon
loop now and then (the TTL), by the agent after each ingest and before the restore (the
running job's room), and by the peer service before it refuses a push for room.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Executor
from dataclasses import dataclass

from mtc_replicator.core.foreign import (
    DEFAULT_TTL,
    DropRefused,
    HeldJob,
    check_drop,
    newest_committed,
    next_save_bytes,
    plan_eviction,
    unprotected,
)
from mtc_replicator.core.manifest import ItemId, ManifestError
from mtc_replicator.local.ended_jobs import EndedJobs
from mtc_replicator.local.store import MANIFEST_FILE, LocalStore
from mtc_replicator.obs.metrics import NO_METRICS, Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStoreError

log = logging.getLogger(__name__)

RECHECK_SECONDS = 300.0
"""How long the bucket's answer "not committed" stands for a job before it is read again
(the job may run on other nodes, and back up there). "Committed" stands while the newest
step held here does not change."""
WARN_EVERY = 3600.0
"""Seconds between two warnings about one job held here without a backup."""


@dataclass(frozen=True)
class Dropped:
    """What one drop removed: steps by rank, and bytes."""

    job: str
    steps: dict[int, list[int]]
    bytes: int
    committed: int | None


class ForeignItems:
    """This node's items of jobs other than the running one. Thread-safe; blocking calls
    run in the daemon's thread pool."""

    def __init__(
        self,
        store: LocalStore,
        backups: BackupStore | None,
        *,
        ttl: float = DEFAULT_TTL,
        clock: Callable[[], float] = time.time,
        metrics: Metrics = NO_METRICS,
        current: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """``current``: the jobs the daemon runs at the moment, read again before each drop
        (one may have been accepted since the caller named the running ones)."""
        self.current = current
        self.store = store
        self.backups = backups
        self.ttl = ttl
        self.clock = clock
        self.metrics = metrics
        self._lock = threading.Lock()
        self._dropping = threading.Lock()
        """One look-and-drop at a time: the agent, the daemon loop and a push may ask at once."""
        self._ended: dict[str, float] = {}
        """When each job stopped running here, as this daemon saw it."""
        self._committed: dict[str, tuple[int, int | None, float]] = {}
        """Per job: the newest step held when the bucket was read, its answer, when."""
        self._warned: dict[str, float] = {}
        self.last: dict[str, HeldJob] = {}
        """The jobs held at the last look, for ``mtc status`` (which does no I/O)."""
        self.configs = EndedJobs(store.root)
        """The config each job held here last ran with (``mtc upload`` needs its layout)."""

    def ended(self, job: str, config_text: str | None = None) -> None:
        """The job's incarnation stopped on this node: its items are held from now on;
        ``config_text``, its accepted ``replicator.yaml``, is kept while they are."""
        with self._lock:
            self._ended[job] = self.clock()
        if config_text is not None:
            self.configs.save(job, config_text)

    def recheck(self, job: str) -> None:
        """Forget what the bucket said of ``job``: it was just uploaded (``mtc upload``)."""
        with self._lock:
            self._committed.pop(job, None)
            self._warned.pop(job, None)

    # --- looking ---------------------------------------------------------------------------

    def held(self, running: Collection[str]) -> list[HeldJob]:
        """Every job held here but the ``running`` ones, with what the bucket says of it."""
        by_job: dict[str, list[ItemId]] = {}
        manifests = self.store.manifests()
        for item in manifests:
            if item.job not in running:
                by_job.setdefault(item.job, []).append(item)
        found = []
        for job, items in sorted(by_job.items()):
            newest = max(i.step for i in items)
            found.append(
                HeldJob(
                    job=job,
                    newest_step=newest,
                    items=len(items),
                    bytes=sum(manifests[i].total_bytes for i in items),
                    newest_step_bytes=sum(
                        manifests[i].total_bytes for i in items if i.step == newest
                    ),
                    idle_since=self._idle_since(job, items),
                    committed=self._newest_committed(job, newest),
                )
            )
        self.last = {h.job: h for h in found}
        return found

    def _idle_since(self, job: str, items: list[ItemId]) -> float:
        newest = 0.0
        for item in items:
            try:
                newest = max(newest, os.stat(self.store.item_dir(item) / MANIFEST_FILE).st_mtime)
            except OSError:
                continue
        with self._lock:
            return max(newest, self._ended.get(job, 0.0))

    def _newest_committed(self, job: str, newest_held: int) -> int | None:
        if self.backups is None:
            return None
        now = self.clock()
        with self._lock:
            cached = self._committed.get(job)
        if cached is not None and cached[0] == newest_held:
            held, committed, at = cached
            if (committed is not None and committed >= held) or now - at < RECHECK_SECONDS:
                return committed
        try:
            committed = newest_committed(self.backups.committed_steps(job))
        except (ObjectStoreError, ManifestError, OSError) as exc:
            # Asked again after RECHECK_SECONDS; meanwhile the items are kept.
            log.warning(
                "cannot tell whether job %s is in the backup: %s", job, exc, extra={"job": job}
            )
            committed = None
        with self._lock:
            self._committed[job] = (newest_held, committed, now)
        return committed

    def running_step_bytes(self, running: Collection[str]) -> int | None:
        """Bytes of the running jobs' newest steps held here (None: they hold none)."""
        total = None
        for job in running:
            manifests = self.store.manifests(job)
            if manifests:
                newest = max(i.step for i in manifests)
                size = sum(m.total_bytes for i, m in manifests.items() if i.step == newest)
                total = (total or 0) + size
        return total

    def free_bytes(self) -> int:
        st = os.statvfs(self.store.root)
        return st.f_bavail * st.f_frsize

    # --- giving back -----------------------------------------------------------------------

    def make_room(self, running: Collection[str], short: int) -> list[Dropped]:
        """A push of a running job lacks ``short`` bytes: drop what may give them."""
        return self.reclaim(running, need=self.free_bytes() + short)

    def reclaim(self, running: Collection[str], need: int | None = None) -> list[Dropped]:
        """Drop the backed-up jobs the TTL or the running jobs' room calls for.

        ``need``: bytes a running job needs now (a push); None: their next steps' size.
        With no job running, only the TTL applies.
        """
        with self._dropping:
            return self._reclaim(running, need)

    def _reclaim(self, running: Collection[str], need: int | None) -> list[Dropped]:
        held = self.held(running)
        if not held:
            self._report(held)
            return []
        free: int | None = None
        if running:
            free = self.free_bytes()
            if need is None:
                need = next_save_bytes(self.running_step_bytes(running), held)
        plan = plan_eviction(held, now=self.clock(), ttl=self.ttl, free=free, need=need or 0)
        dropped = []
        for h in held:
            if h.job in plan.jobs and h.job not in self.current():
                gone = self._drop(h)
                log.info(
                    "dropped job %s from this node (%s): %d items, %d bytes, steps %s; its "
                    "newest step held, %d, is committed in the backup (newest: %s)",
                    h.job,
                    plan.reasons[h.job],
                    h.items,
                    gone.bytes,
                    sorted({s for steps in gone.steps.values() for s in steps}),
                    h.newest_step,
                    h.committed,
                    extra={"job": h.job},
                )
                dropped.append(gone)
        self._report([h for h in held if h.job not in plan.jobs])
        return dropped

    def drop(self, job: str, running: Collection[str], *, only_copy: bool) -> Dropped:
        """An operator's drop (``mtc drop``); raises ``DropRefused``."""
        with self._dropping:
            running = frozenset(running) | (frozenset({job}) & frozenset(self.current()))
            found = [h for h in self.held(running) if h.job == job] if job not in running else []
            held = check_drop(job, running, found[0] if found else None, only_copy=only_copy)
            gone = self._drop(held)
        log.warning(
            "dropped job %s from this node on request: %d items, %d bytes (newest step held "
            "%d, newest committed in the backup %s)",
            job,
            held.items,
            gone.bytes,
            held.newest_step,
            held.committed,
            extra={"job": job},
        )
        return gone

    def purge(self) -> dict[str, int]:
        """A node handoff (``core.handoff``): every item here goes, whatever its job, and
        so does what was known of them; bytes removed by job."""
        with self._dropping:
            gone = self.store.purge()
            self.configs.forget_all()
            with self._lock:
                self._committed.clear()
                self._ended.clear()
                self._warned.clear()
            self.last = {}
        by_job: dict[str, int] = {}
        for item, manifest in gone.items():
            by_job[item.job] = by_job.get(item.job, 0) + manifest.total_bytes
        for job, nbytes in sorted(by_job.items()):
            self.metrics.foreign_dropped(job, nbytes)
        self.metrics.held_without_backup({})
        return by_job

    def _drop(self, held: HeldJob) -> Dropped:
        steps: dict[int, list[int]] = {}
        nbytes = 0
        for item, manifest in sorted(self.store.manifests(held.job).items()):
            self.store.drop_views(item)
            self.store.delete(item)
            steps.setdefault(item.rank, []).append(item.step)
            nbytes += manifest.total_bytes
        self.metrics.foreign_dropped(held.job, nbytes)
        self.configs.forget(held.job)
        with self._lock:
            self._committed.pop(held.job, None)
            self._ended.pop(held.job, None)
            self._warned.pop(held.job, None)
        return Dropped(held.job, steps, nbytes, held.committed)

    def _report(self, held: list[HeldJob]) -> None:
        """Say which jobs are held without a backup: a rate-limited warning and the metric."""
        exposed = unprotected(held)
        now = self.clock()
        for h in exposed:
            with self._lock:
                last = self._warned.get(h.job)
                if last is not None and now - last < WARN_EVERY:
                    continue
                self._warned[h.job] = now
            if self.backups is None:
                where, upload = "no backup is set", ""
            else:
                where = f"newest committed: {h.committed}"
                upload = f"`mtc upload --job {h.job}` uploads it to the backup, "
            log.warning(
                "job %s does not run here, and its newest step held here, %d, is not in the "
                "backup (%s): its %d items (%d bytes) are kept, they may be its only copy; "
                "%s`mtc drop --job %s --even-if-only-copy` drops them",
                h.job,
                h.newest_step,
                where,
                h.items,
                h.bytes,
                upload,
                h.job,
                extra={"job": h.job},
            )
        self.metrics.held_without_backup({h.job: h.bytes for h in exposed})


__all__ = ["DropRefused", "Dropped", "ForeignItems"]


RECLAIM_EVERY = 30.0
"""Seconds between two looks at the jobs that no longer run here (TTL and room)."""


class Reclaim:
    """The daemon's face of ``ForeignItems``: each drop on the thread pool, against the jobs
    running on the node at that moment."""

    def __init__(
        self, foreign: ForeignItems, executor: Executor, running: Callable[[], Collection[str]]
    ) -> None:
        self.foreign = foreign
        self.executor = executor
        self.running = running
        self._at = 0.0

    async def drop(self, job: str, only_copy: bool) -> Dropped:
        """``mtc drop``: a job's items, never a running job's (``DropRefused``)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(self.foreign.drop, job, self.running(), only_copy=only_copy),
        )

    async def room_for_push(self, short: int) -> None:
        """A push lacks ``short`` bytes of room: drop backed-up items of other jobs."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.foreign.make_room, self.running(), short
            )
        except Exception as exc:
            # The push is then refused for room, as it would have been.
            log.warning("cannot give back the room of jobs that no longer run here: %s", exc)

    async def now_and_then(self) -> None:
        """Every ``RECLAIM_EVERY``: drop the items of jobs past ``--foreign-job-ttl`` (and
        for room)."""
        now = time.monotonic()
        if now - self._at < RECLAIM_EVERY:
            return
        self._at = now
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.foreign.reclaim, self.running()
            )
        except Exception as exc:
            # Housekeeping: the daemon's loop goes on whatever it meets.
            log.exception("cannot give back the room of jobs that no longer run here: %s", exc)  # noqa: TRY401
