"""One job incarnation on this node: restore, markers, then steady-state ingest, backup, GC.

Every job, one node or many, restores through its coordinator's round and backs up on its
coordinator's orders (``cluster.membership``); a one-node job's coordinator is hosted by
this daemon and called in process. The decisions come from ``core`` (pure); this module
performs them: blocking disk and object-store work runs in the daemon's bounded thread
pool, and every step is published atomically so a ``kill -9`` at any point leaves
committed data intact.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from mtc_replicator.cluster.coordinator_client import RegistryFinder
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.link import CoordinatorFinder, LocalFinder
from mtc_replicator.cluster.membership import ClusterMember, MemberContext
from mtc_replicator.cluster.pool import PoolCopies
from mtc_replicator.cluster.registry import Registry
from mtc_replicator.cluster.rounds import JobRank, RoundFailed
from mtc_replicator.cluster.sources import ItemSources
from mtc_replicator.cluster.workload_errors import WorkloadErrors
from mtc_replicator.core.admission import expected_pushers
from mtc_replicator.core.aside import passed_over, released, why_kept
from mtc_replicator.core.attestation import OPEN_MANIFESTS, ManifestTrust
from mtc_replicator.core.contract import (
    FAILED_FILE,
    JobConfig,
    parse_config,
)
from mtc_replicator.core.drain import Drained
from mtc_replicator.core.layout import no_copy_note, off_node_copies
from mtc_replicator.core.manifest import ItemId, Manifest, ManifestError
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.policy import (
    DEFAULT_KEEP_STEPS,
    Handoff,
    complete_steps,
    find_handoffs,
    newest_kept,
    retention,
    retention_of_copies,
    save_in_progress,
)
from mtc_replicator.core.timeline import RestorePhase, RestoreTimeline
from mtc_replicator.local import fsutil
from mtc_replicator.local.offload import Offload
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.node.checkpoint_dir import kept_steps, list_top, unlink_links_to
from mtc_replicator.node.first_round import CannotContinue, bring_first
from mtc_replicator.node.pool_node import PoolNode
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.node.repeats import Repeats
from mtc_replicator.node.saved_incarnation import (
    IncarnationPhase,
    SavedIncarnation,
    load_state,
    new_incarnation_id,
    save_state,
    state_file,
)
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, ErrorKind, Metrics, TransferKind
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.transport.obtaining import Obtaining
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.tls import TlsMaterial

log = logging.getLogger(__name__)


class RestoreBlocked(Exception):
    """No step could be restored although one exists: fatal, the job must not start fresh."""


@dataclass(frozen=True)
class AgentContext:
    """What every incarnation of one job directory is handed: the node's parts, assembled
    once the daemon's port is bound (``node.wiring``), and the directory's own (its path,
    ``job_dir``, ``closed_files``). Never changed after it is made."""

    checkpoint_dir: Path
    store: LocalStore
    backups: BackupStore | None
    executor: Executor
    peers: PeerClient
    """The peer data plane (replication, restores from peers, pool copies)."""
    coordinator_calls: Coordinators
    """The coordinator calls of the jobs this daemon hosts: a one-node job calls its own in
    process (``cluster.link.LocalFinder``)."""
    advertise: str
    """This node's peer address, as other nodes reach it (known once the port is bound)."""
    closed_files: set[str] = field(default_factory=set)
    """Top-level names seen closed after writing (inotify), for ``.save`` hand-offs."""
    settle_seconds: float = 10.0
    rescan_seconds: float = 2.0
    env: dict[str, str] = field(default_factory=dict)
    """The variables `$VAR` in a `replicator.yaml` may name (`--expand-vars`); no others."""
    clock: Callable[[], float] = time.time
    registry: Registry | None = None
    """Where other nodes' coordinators are found; needed by jobs with ``nodes > 1``."""
    tls: TlsMaterial | None = None
    """Mutual TLS for calls to other nodes' coordinators; None: plaintext."""
    report_after: float = 60.0
    """Seconds a restore round may wait before ``replicator.errors`` says what for."""
    metrics: Metrics = NO_METRICS
    obtaining: Obtaining | None = None
    """What the restore round is still fetching, for the peer service (fan-out pulls)."""
    pacer: Pacer = field(default_factory=Pacer)
    """The node's outgoing transfers: the agent tells it when the job is saving."""
    foreign: ForeignItems | None = None
    """Items of jobs that do not run here: they give way when this job needs the room."""
    keep_steps: int = DEFAULT_KEEP_STEPS
    """``--keep-steps``: the newest complete steps of this rank kept, besides the safety
    rules' (``core.policy.newest_kept``)."""
    manifests: ManifestTrust = OPEN_MANIFESTS
    """How this node attests the items it ingests and which items it restores."""
    job_dir: str | None = None
    """The job directory ``CHECKPOINT_DIR/jobs/<job_dir>/`` this context serves (its
    ``checkpoint_dir``); None: CHECKPOINT_DIR's root."""
    pool: PoolNode | None = None
    """This node in the pool: a one-node job in a job directory copies its steps to
    another node of it (``core.pool``); None: no registry, or ``--no-pool-copies``."""

    @property
    def state_name(self) -> str:
        return state_file(self.job_dir)


class Incarnation:
    """The life of one accepted ``replicator.yaml`` on this node."""

    def __init__(
        self,
        config: JobConfig,
        ctx: AgentContext,
        *,
        config_text: str,
        incarnation_id: str | None = None,
        resume_steady: bool = False,
        owner: str = UNOWNED,
        handshake_at: float | None = None,
    ) -> None:
        """``handshake_at``: when (``time.monotonic``) the daemon first read the yaml this
        incarnation was accepted from; the restore's timeline starts there."""
        self.config = config
        self.ctx = ctx
        self.owner = owner
        """Who this job belongs to (``core.ownership``), as read at the handshake; every
        join carries it."""
        self.id = incarnation_id or new_incarnation_id()
        self.config_text = config_text
        self.log = JobLog(log, config.job_name, config.node_rank)
        self.phase = IncarnationPhase.STEADY if resume_steady else IncarnationPhase.RESTORING
        self._wake = asyncio.Event()
        self._stopping = threading.Event()
        self._offload = Offload(ctx.executor)
        """This incarnation's blocking calls, which ``stop`` waits for."""
        self._thread = self._offload.run
        self.error = WorkloadErrors(ctx.checkpoint_dir, config, self.log, ctx.metrics).report
        """A non-fatal problem: logged, counted, and told to the workload."""
        self.repeats = Repeats(ctx, config, self.id, self.error)
        self._task: asyncio.Task[None] | None = None
        self._started_at = time.monotonic()
        self.member: ClusterMember | None = None
        """This rank in its job (every job has one once the incarnation runs)."""
        self._saving = False
        """Whether the last scan saw the job writing a checkpoint."""
        self._draining = False
        """SIGTERM: the steady loop ends after its pass in progress (``drain``)."""
        self.timeline = RestoreTimeline(
            time.monotonic,
            origin=handshake_at,
            opening=None if handshake_at is None else RestorePhase.SETTLE,
        )
        """How long each phase of this incarnation's restore took (``core.timeline``)."""
        self.pool_copies = self._pool_copies()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.ctx.metrics.serving(self.config.job_name)
        if self.config.nodes > 1:
            self.ctx.metrics.off_node_copies(self.config.job_name, off_node_copies(self.config))
        self._task = asyncio.create_task(self._run(), name=f"incarnation-{self.config.job_name}")
        self.repeats.task = self._task

    def _pool_copies(self) -> PoolCopies | None:
        ctx = self.ctx
        if ctx.pool is None or ctx.job_dir is None or self.config.nodes > 1:
            return None
        return PoolCopies(
            ctx.pool.view,
            ctx.peers,
            ctx.store,
            self.config,
            me=ctx.pool.name,
            owner=self.owner,
            run_thread=self._thread,
            trust=ctx.manifests,
            metrics=ctx.metrics,
        )

    def wake(self) -> None:
        self._wake.set()

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel in-flight work; committed data stays. Waits for worker threads to finish."""
        self._stopping.set()
        self.ctx.pacer.saving(False, self.config.job_name)  # held by nobody after it
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task], timeout=timeout)
        if self.member is not None:
            await self.member.stop()
        if self.pool_copies is not None:
            await self.pool_copies.close()
        await self._offload.wait(timeout)

    async def drain(self) -> Drained | None:
        """SIGTERM or the job's end here: get the newest step held here to the peers that
        lack it and into the backup when it is older (``core.drain``), before ``stop``. The
        caller bounds it (``--drain-seconds``). None: nothing done (not restored yet)."""
        member = self.member
        if member is None or self.phase is not IncarnationPhase.STEADY:
            return None
        self._draining = True
        self._wake.set()
        if self._task is not None and not self._task.done():
            # The steady loop ends after the pass in progress (a step being hashed is
            # committed, not hashed twice), so no retention runs beside the drain.
            await asyncio.wait([self._task])
        await self._ingest_ready(member)  # a step renamed in since that pass
        # A save in progress no longer holds the upload: the node may be gone before it ends.
        self.ctx.pacer.saving(False, self.config.job_name)
        steps = complete_steps(self.config, self.ctx.store.manifests(self.config.job_name).keys())
        # Past the deadline: SIGTERM halts the pacer, a job switch stops us.
        return await member.drain(
            steps[-1] if steps else None,
            cancelled=lambda: self.ctx.pacer.halted.is_set() or self._stopping.is_set(),
        )

    async def _run(self) -> None:
        try:
            member = self.member = self._join()
            member.running = self.phase is IncarnationPhase.STEADY  # resumed running
            if self.phase is IncarnationPhase.RESTORING:
                for assumption in self.config.assumed:
                    self.error(assumption, kind=ErrorKind.CONFIG)
                alone = no_copy_note(self.config)
                if alone is not None:
                    self.error(alone, kind=ErrorKind.CONFIG)
                self.persist()
                await self._bring_back()
                await self._make_room()  # the restore may fetch a step into this RAM disk
                await bring_first(
                    self.config,
                    self.owner,
                    self._thread,
                    store=self.ctx.store,
                    manifests=self.ctx.manifests,
                    peers=self.ctx.peers,
                    backups=self.ctx.backups,
                    pool=self.ctx.pool,
                    log=self.log,
                    pool_copies=self.pool_copies,
                )
                self.timeline.enter(RestorePhase.INGEST)
                await self._ingest_ready(member)
                await self._restore(member)
                self.phase = IncarnationPhase.STEADY
                self.persist()
            await self._steady(member)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._stopping.is_set():
                # Work cut short by stop() (Cancelled); the next incarnation owns the files.
                self.log.info("incarnation stopped: %s", exc)
                return
            if isinstance(exc, RestoreBlocked | RoundFailed | CannotContinue):
                self.log.error("incarnation failed: %s", exc)  # a refusal: its reason is all
            else:
                self.log.exception("incarnation failed: %s", exc)  # noqa: TRY401
            if self.phase is IncarnationPhase.RESTORING:
                self.ctx.metrics.restore_failed(self.config.job_name, self._since_start())
                self._report_timeline("restore failed", None)
            text = (
                f"mtc-replicator: job {self.config.job_name} rank {self.config.node_rank} failed: "
                f"{type(exc).__name__}: {exc}\nSee the replicator's log on this node; restart the "
                "job to retry (committed checkpoints are kept)."
            )
            fsutil.atomic_write_bytes(self.ctx.checkpoint_dir / FAILED_FILE, text.encode())

    def _join(self) -> ClusterMember:
        ctx = self.ctx
        finder: CoordinatorFinder
        if self.config.nodes == 1:
            finder = LocalFinder(ctx.coordinator_calls, owner=self.owner)
        elif ctx.registry is None:
            raise RestoreBlocked(
                f"a job of {self.config.nodes} nodes needs the daemon's --registry (or --backup) "
                "to find its coordinator"
            )
        else:
            finder = RegistryFinder(ctx.registry, ctx.tls, owner=self.owner)
        rank = JobRank(
            self.config, self.id, ctx.store, finder, ctx.advertise, ctx.report_after, ctx.obtaining
        )
        sources = ItemSources(
            ctx.store,
            self.config.node_rank,
            peers=ctx.peers,
            backups=ctx.backups,
            run_thread=self._thread,
            cancelled=self._stopping.is_set,
            metrics=ctx.metrics,
            trust=ctx.manifests,
            owner=self.owner,
        )
        return ClusterMember(
            MemberContext(
                rank,
                sources,
                backups=ctx.backups,
                peers=ctx.peers,
                run_thread=self._thread,
                error=self.error,
                metrics=ctx.metrics,
                news=self.wake,
            )
        )

    def _since_start(self) -> float:
        return time.monotonic() - self._started_at

    async def _restore(self, member: ClusterMember) -> None:
        started = time.monotonic()
        try:
            outcome = await member.restore(self.timeline)
        except RoundFailed as exc:
            raise RestoreBlocked(f"the restore round cannot complete: {exc}") from None
        if outcome.step is None and outcome.unavailable:
            # A checkpoint exists but this node could not get it (full disk, store down):
            # an empty marker would make the job silently train from scratch.
            raise RestoreBlocked(
                "a committed checkpoint exists but could not be restored: "
                + "; ".join(outcome.unavailable)
            )
        # Items newer than the agreed step: left in the index they would pass for the newest
        # checkpoint and make retention delete the new saves; deleted, one member's report
        # of failing its own sources would destroy the others' data. Set aside (core.aside).
        abandoned = passed_over(self.ctx.store.manifests(self.config.job_name), outcome.step)
        if outcome.step is None and abandoned:
            # Never silent: this node held parts of a checkpoint the cluster cannot complete.
            where = "in the backup" if self.ctx.backups is not None else "in a backup (none is set)"
            self.error(
                f"no step of job {self.config.job_name} is complete on every rank or {where} "
                f"(or a rank reported it cannot fetch its part): starting fresh; "
                + why_kept(abandoned, outcome.step),
                kind=ErrorKind.RESTORE,
            )
        self._tell_refused_commits()
        self.timeline.enter(RestorePhase.MARKERS)
        if abandoned:
            self.log.info("%s", why_kept(abandoned, outcome.step), step=outcome.step)
            await self._thread(self._set_aside, abandoned)
        await self._thread(self.repeats.publish, outcome)
        self._report_timeline("restore timeline", outcome.step)
        self.log.info(
            "restore round done: step=%s source=%s in %.2fs",
            outcome.step,
            outcome.source,
            time.monotonic() - started,
            step=outcome.step,
        )
        self.ctx.metrics.restore_done(self.config.job_name, outcome.step, self._since_start())

    def _report_timeline(self, what: str, step: int | None) -> None:
        """End the restore's timeline: one INFO line of every phase's seconds, at DEBUG
        each span, and the phases to ``mtc_restore_phase_seconds``."""
        timeline = self.timeline
        timeline.finish()
        self.log.info("%s: %s", what, timeline.summary(), step=step)
        for line in timeline.lines():
            self.log.debug("restore timeline: %s", line, step=step)
        self.ctx.metrics.restore_phases({p.value: t for p, t in timeline.totals().items()})

    def _tell_refused_commits(self) -> None:
        """Say which COMMITs the round passed over because they were not believed (unsigned
        or forged): the job restored an older step, or none, and must know why. Known where
        the job's backups were listed: in rank 0's daemon (the coordinator's); the other
        ranks fetch with the plan's digests and never list."""
        backups = self.ctx.backups
        refused = {} if backups is None else backups.refused.get(self.config.job_name, {})
        for step, why in sorted(refused.items()):
            self.error(f"{why}; never restored", step, kind=ErrorKind.RESTORE)

    def persist(self) -> None:
        saved = SavedIncarnation(self.config_text, self.id, self.phase)
        save_state(self.ctx.store, saved, self.ctx.state_name)

    # --- steady state ----------------------------------------------------------------------

    async def _steady(self, member: ClusterMember) -> None:
        while not self._stopping.is_set() and not self._draining:
            await self.repeats.next_pass(self._wake, self.ctx.rescan_seconds, self._thread)
            await self._ingest_ready(member)
            # An upload that ended no longer protects its step.
            await self._collect_garbage(member)
            await self._after_steps(member, force=False)

    async def _ingest_ready(self, member: ClusterMember) -> None:
        entries = await self._thread(list_top, self.ctx.checkpoint_dir)
        closed, now = set(self.ctx.closed_files), self.ctx.clock()
        saving = save_in_progress(self.config, entries, closed, now, self.ctx.settle_seconds)
        if (saving is not None) != self._saving:
            self._saving = saving is not None
            self.log.debug("save in progress: %s", saving or "none")
        # Replication and backups hold while the job writes (bounded): ``core.pacing``.
        self.ctx.pacer.saving(self._saving, self.config.job_name)
        handoffs = find_handoffs(self.config, entries, closed, now, self.ctx.settle_seconds)
        for pending in await self._thread(self._pending_ingest):
            handoffs.append(Handoff(pending.step, {pending: ""}))
        for handoff in sorted(handoffs, key=lambda h: h.step):
            await self._ingest(member, handoff)

    def _pending_ingest(self) -> list[ItemId]:
        return [i for i in self.ctx.store.pending_ingest() if i.job == self.config.job_name]

    def _attest(self, manifest: Manifest) -> Manifest:
        """This node's signed word that it produced ``manifest``'s item for this job's owner."""
        return self.ctx.manifests.attest(manifest, self.owner, self.ctx.clock())

    async def _ingest(self, member: ClusterMember, handoff: Handoff) -> None:
        for item, name in handoff.names.items():
            watch = Stopwatch()
            if name and await self.repeats.refused(item, name, self._thread):
                continue
            try:
                if name:
                    await self._thread(self.ctx.store.take, self.ctx.checkpoint_dir / name, item)
                    self.ctx.closed_files.discard(name)
                manifest = await self._thread(
                    self.ctx.store.commit_ingested, item, self._stopping.is_set, self._attest
                )
            except FileNotFoundError:
                continue  # the workload or a rescan raced us; the next scan sees the truth
            except ManifestError as exc:
                self.error(
                    f"step {item.step}: cannot keep {name or item}: {exc}",
                    item.step,
                    ErrorKind.INGEST,
                )
                await self._thread(self.ctx.store.discard_ingest, item)
                continue
            except (StoreError, OSError) as exc:
                self.error(
                    f"step {item.step}: ingest failed, will retry: {exc}",
                    item.step,
                    ErrorKind.INGEST,
                )
                continue
            self.repeats.took(item, self.phase is IncarnationPhase.STEADY)
            dt = watch.seconds()
            self.log.info(
                "ingested %s: %d files, %s",
                item,
                len(manifest.files),
                watch.summary(manifest.total_bytes, dt),
                step=item.step,
            )
            self.ctx.metrics.transfer(TransferKind.INGEST, manifest.total_bytes, dt)
            if self.pool_copies is not None:
                self.pool_copies.push_later(manifest)
        await self._collect_garbage(member)
        await self._make_room()  # for the next save, before the job starts writing it
        # Replicate the new step at once, and report it: the promise the garbage collection
        # just made (the steps kept) reaches the coordinator now, so the steps it no longer
        # names can go. A report per step at ingest, another once it is replicated.
        await self._after_steps(member, force=True)

    async def _after_steps(self, member: ClusterMember, *, force: bool) -> None:
        """Replicate and report: the coordinator's answers order backups."""
        if self._draining:
            # The drain pushes and uploads on its own; a report to a coordinator already
            # gone would spend its call timeout of the drain's seconds.
            return
        steps = complete_steps(self.config, self.ctx.store.manifests(self.config.job_name).keys())
        await member.tick(steps[-1] if steps else None, force=force)

    async def _collect_garbage(self, member: ClusterMember) -> None:
        have = self.ctx.store.manifests(self.config.job_name).keys()
        self.ctx.metrics.committed(
            self.config.job_name, max(complete_steps(self.config, have), default=None)
        )
        # The restorable step, the upload, the steps that may become restorable next, and
        # what our progress reports promised the coordinator (see ClusterMember.retained);
        # then the newest --keep-steps, whose copies of other ranks stay with them.
        complete = complete_steps(self.config, have)
        kept = await self._thread(kept_steps, self.ctx.checkpoint_dir)  # replicator.keep
        protected = member.retained(complete) | newest_kept(complete, self.ctx.keep_steps) | kept
        doomed = retention(self.config, have, protected)
        aside = self.ctx.store.aside(self.config.job_name)
        free = released(
            aside, restorable=member.restorable, backed_up=member.backed_up, committed=have
        )
        if free:
            await self._thread(self._release_aside, free)
        if self.phase is IncarnationPhase.STEADY:
            # Not during the restore round: it plans from every copy held, whatever its rank.
            pushing = expected_pushers(self.config)
            doomed += retention_of_copies(self.config, have, protected, pushing)
        if doomed:
            await self._thread(self._delete_items, doomed)

    async def _make_room(self) -> None:
        """Drop backed-up items of jobs that do not run here when this job's next step
        would not fit beside them (``core.foreign``)."""
        foreign = self.ctx.foreign
        if foreign is None or self._draining:
            return
        try:
            await self._thread(foreign.reclaim, self.config.job_name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Housekeeping for other jobs never fails this one.
            self.log.warning("cannot give back the room of other jobs' items: %s", exc)

    async def _bring_back(self) -> None:
        """The items a round set aside (of any job) rejoin the committed ones: this job's
        are in its inventory again, another job's are this node's foreign items."""
        back = await self._thread(self.ctx.store.bring_back)
        if back:
            self.log.info("%d items set aside by an earlier round are held again", len(back))

    def _set_aside(self, items: list[ItemId]) -> None:
        unlink_links_to(self.ctx.checkpoint_dir, self.ctx.store, set(items))
        for item in items:
            self.ctx.store.drop_views(item)
            self.ctx.store.set_aside(item)

    def _release_aside(self, items: list[ItemId]) -> None:
        for item in items:
            self.ctx.store.delete_aside(item)
            self.log.info("deleted %s (set aside; a step as new is safe)", item, step=item.step)

    def _delete_items(self, items: list[ItemId]) -> None:
        unlink_links_to(self.ctx.checkpoint_dir, self.ctx.store, set(items))
        for item in items:
            self.ctx.store.drop_views(item)
            self.ctx.store.delete(item)
            self.log.info("deleted %s (retention)", item, step=item.step)


def restore_saved(ctx: AgentContext) -> Incarnation | None:
    """The incarnation a restarted daemon resumes, if it had one."""
    saved = load_state(ctx.store, ctx.state_name)
    if saved is None:
        return None
    try:
        config = parse_config(saved.config_text, ctx.env)
    except ValueError as exc:
        log.warning("not resuming the saved incarnation: %s", exc)
        return None
    return Incarnation(
        config,
        ctx,
        config_text=saved.config_text,
        incarnation_id=saved.incarnation_id,
        resume_steady=saved.phase is IncarnationPhase.STEADY,
    )
