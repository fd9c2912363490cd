"""An incarnation's membership in its job: every job, one node or many. I/O: the coordinator
link and the store.

A one-node job is a cluster of one whose coordinator its own daemon hosts (``cluster.link``),
so there is one restore path and one backup path. Restore goes through the coordinator's
round (``cluster.rounds``). In steady state each committed
step is pushed to this rank's replication targets (``replication``), and progress reports
to the coordinator return the cluster's restorable step (which retention must keep) and
backup orders (one step at a time, uploaded by one replica per data-parallel class:
``backup_orders``). A report goes after each new step and as soon as there is news (a step
replicated, an upload done: ``MemberContext.news`` wakes the loop), else at the interval
the coordinator asks for (longer in larger jobs); a failed one is retried with jittered
backoff, so a restarted coordinator hears from every rank soon. A drain (``drain``) takes
the newest step to the peers and the backup. ``ClusterMember`` is the façade: the node asks
it, never its parts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from mtc_replicator.cluster.backup_orders import BackupOrders
from mtc_replicator.cluster.link import CoordinatorError, CoordinatorLink, NoCoordinator
from mtc_replicator.cluster.replication import Replication
from mtc_replicator.cluster.rounds import JobRank, RoundContext, RoundOutcome, RoundParticipant
from mtc_replicator.cluster.sources import ItemSources, RunThread
from mtc_replicator.core.admission import expected_pushers
from mtc_replicator.core.coordination import MAX_REPORT_EVERY
from mtc_replicator.core.drain import Drained, plan_drain
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import CancelCheck
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.retry import Backoff
from mtc_replicator.core.timeline import RestoreTimeline
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, ErrorKind, Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.transport.peer_client import PeerClient

MAX_PUSHERS_ASKED = 64
"""Most pushing ranks whose nodes a report asks for (a handful in any layout but explicit
``peer-ranks``, where every rank may push here: their pushes are then admitted by the
layout alone, and their items still checked at restore)."""

log = logging.getLogger(__name__)

UNCONFIRMED_KEPT = 2
"""Own complete steps newer than the restorable one kept regardless (the newest ones):
what the ranks are about to report as replicated. Anything else above the restorable step
is kept only while the coordinator asks for it or a promise covers it, so a stalled peer
costs a bounded number of steps in RAM, not every save."""


class ReportError(Protocol):
    """The incarnation's ``error``: log a problem, count it by kind, tell the workload."""

    def __call__(self, message: str, step: int | None, kind: ErrorKind = ..., /) -> None: ...


@dataclass
class MemberContext:
    rank: JobRank
    """This rank, as its restore round sees it too."""
    sources: ItemSources
    """Where the restore round fetches each item from."""
    backups: BackupStore | None
    peers: PeerClient | None
    """The peer plane; None only where there are no peers (a one-node job)."""
    run_thread: RunThread
    error: ReportError
    metrics: Metrics = NO_METRICS
    news: Callable[[], None] = lambda: None
    """Wakes the incarnation's loop: a push or an upload ended, so its report goes now
    rather than at the next rescan (the next step's backup is ordered, or this one's
    ``COMMIT`` written, that much sooner)."""


class ClusterMember:
    """Everything this rank does with the other ranks of its job."""

    def __init__(self, ctx: MemberContext) -> None:
        self.ctx = ctx
        self.config = ctx.rank.config
        self._replication = Replication(
            self.config,
            ctx.rank.store,
            ctx.peers,
            lambda m, s: ctx.error(m, s, ErrorKind.REPLICATION),
            on_news=ctx.news,
        )
        self._orders = BackupOrders(
            self.config,
            ctx.rank.store,
            ctx.backups,
            run_thread=ctx.run_thread,
            error=lambda m, s: ctx.error(m, s, ErrorKind.BACKUP),
            metrics=ctx.metrics,
            clock=time.monotonic,
            on_news=ctx.news,
        )
        """This rank's uploads: the coordinator's orders and the drain's."""
        self.restorable: int | None = None
        """The cluster's restorable step, as the coordinator last said: never deleted."""
        self.backed_up: int | None = None
        """The job's newest committed backup step, as the coordinator last said."""
        self.keep_steps: frozenset[int] = frozenset()
        """Steps the coordinator last asked every rank to keep (they may become restorable)."""
        self._promised: frozenset[int] | None = None
        """The steps the coordinator believes this rank keeps (the last answered report's);
        None: no holdings reported yet, so the coordinator may name any step."""
        self._offer: frozenset[int] | None = None
        """What the next report promises (set by ``retained``)."""
        self._offering: frozenset[int] | None = None
        """The promise of the report in flight: kept until it is answered."""
        self.running = False
        """The round released this rank (``adopt``), or the daemon resumed it running. Not
        before: a report would tell a restarted coordinator that a restoring incarnation
        runs, and it would take it for the job's running rank (``JobCoordinator.adopted``)."""
        self._client: CoordinatorLink | None = None
        self._next_report = 0.0
        """When the next report is due without news (``time.monotonic``)."""
        self._failing = False
        self._retry = Backoff(first=1.0, cap=float(MAX_REPORT_EVERY))
        """After a failed report: retry soon (the coordinator may have restarted and needs
        every rank's report to order backups again), jittered so a job's ranks spread out."""
        self._reported: tuple[int | None, int | None] = (None, None)
        """The replicated and uploaded steps of the last answered report."""
        self._targets = replication_targets(self.config)
        pushers = expected_pushers(self.config)
        self._asked = frozenset(
            {*self._targets, *(pushers if len(pushers) <= MAX_PUSHERS_ASKED else ())}
        )
        """The ranks whose addresses and nodes each report asks for: the targets this
        rank pushes to, and (unless there are very many: explicit ``peer-ranks``) the
        ranks that push here, whose holders the peer service admits pushes from."""
        self.rank_nodes: dict[int, str] = {}
        """The node each of those ranks is bound to, as the coordinator last said."""
        self.answered = False
        """A progress report was answered: ``rank_nodes`` is the coordinator's word."""
        self._log = JobLog(log, self.config.job_name, self.config.node_rank)

    async def restore(self, timeline: RestoreTimeline | None = None) -> RoundOutcome:
        """Take this rank through the restore round; ``timeline`` records its phases."""
        participant = RoundParticipant(
            RoundContext(
                self.ctx.rank,
                self.ctx.sources,
                error=lambda m, s: self.ctx.error(m, s, ErrorKind.RESTORE),
                timeline=timeline,
            )
        )
        outcome = await participant.run()
        self.adopt(outcome)
        return outcome

    def adopt(self, outcome: RoundOutcome) -> None:
        self.running = True
        self._replication.set_addresses(outcome.addresses)
        self._client = self.ctx.rank.finder.open(self.config.job_name, outcome.coordinator)
        if outcome.step is not None:
            self.restorable = outcome.step
            self._replication.newest_replicated = outcome.step

    @property
    def coordinator(self) -> str | None:
        """The address of the coordinator this rank follows now (None: none found yet)."""
        return self._client.address if self._client is not None else None

    @property
    def uploading(self) -> int | None:
        """The ordered step being uploaded now."""
        return self._orders.uploading

    @property
    def uploaded(self) -> int | None:
        """The newest ordered step this rank's upload is done with."""
        return self._orders.uploaded

    @property
    def addresses(self) -> Mapping[int, str]:
        """Where the ranks this rank pushes to are, as the coordinator last said."""
        return self._replication.addresses

    @property
    def last_replicated(self) -> int | None:
        """The newest own step every replication target holds; None where this rank has no
        targets (one node, ``peers-per-node: 0``): never shown replicated."""
        return self._replication.newest_replicated if self._replication.replicates else None

    @property
    def protected(self) -> set[int]:
        """Steps retention must keep: the restorable one and the one being uploaded."""
        return {s for s in (self.restorable, self.uploading) if s is not None}

    def retained(self, complete: Sequence[int]) -> set[int]:
        """Of this rank's complete steps (ascending), those retention must keep now.

        The restorable step, the upload, what the coordinator asked for and the newest
        ``UNCONFIRMED_KEPT`` are wanted; the next report promises exactly those. A step
        outside them still stays while a promise made earlier (answered, or in flight)
        covers it: the coordinator may be naming it restorable from that promise.
        """
        # With one node nothing waits for a peer's confirmation: the newest step is it.
        unconfirmed = 1 if self.config.nodes == 1 else UNCONFIRMED_KEPT
        wanted = self.protected | self.keep_steps | set(complete[-unconfirmed:])
        self._offer = frozenset(s for s in complete if s in wanted)
        keep = set(wanted)
        if self._promised is None or self.restorable is None:
            # No promise yet, or no step known complete everywhere (a rank that stalled
            # before its first report may hold any): the coordinator may name any step.
            floor = self.restorable
            keep |= {s for s in complete if floor is None or s > floor}
        else:
            keep |= self._promised
        if self._offering is not None:
            keep |= self._offering
        return keep

    async def stop(self) -> None:
        await self._replication.stop()
        await self._orders.stop()
        if self._client is not None:
            await self._client.close()

    async def drain(self, newest: int | None, cancelled: CancelCheck) -> Drained:
        """SIGTERM or the job's end here: the newest complete step held here (``newest``)
        to the targets that lack it, and into the backup when the bucket is older
        (``core.drain``); ``cancelled`` ends the upload (past the daemon's deadline)."""
        committed = await self._orders.is_committed(newest)
        plan = plan_drain(
            self.config,
            newest=newest,
            replicated=self._replication.newest_replicated,
            committed=committed,
            has_backup=self.ctx.backups is not None,
        )
        self._log.info("drain: step %s: %s", plan.step, plan.why, step=plan.step)
        if plan.step is None:
            return Drained(plan, committed=False)
        step = plan.step
        if plan.push:
            t0 = time.monotonic()
            held = await self._replication.settle(step)
            self._log.info(
                "drain: step %d %s the peers in %.2fs",
                step,
                "reached" if held else "did NOT reach every one of",
                time.monotonic() - t0,
                step=step,
            )
        if plan.upload:
            outcome = await self._orders.drain(step, cancelled)
            return Drained(plan, committed=outcome is True, upload_failed=outcome is None)
        return Drained(plan, committed)

    async def tick(self, newest_step: int | None, *, force: bool = False) -> None:
        """After a rescan or a new step: replicate it, and report progress when forced (a
        new step), when there is news (a step replicated or uploaded) or when the
        coordinator's interval passed; after a failure, not before the backoff."""
        if newest_step is not None:
            self._replication.committed(newest_step)
        if self._replication.replicates:
            self.ctx.metrics.replicated(self.config.job_name, self._replication.newest_replicated)
        if not self.running:
            return  # restoring: the round speaks for this rank until it is released
        now = time.monotonic()
        news = (self._replication.newest_replicated, self.uploaded) != self._reported
        if now < self._next_report and (self._failing or not (news or force)):
            return
        if await self._report():
            self._failing = False
            self._retry.reset()
        else:
            self._failing = True
            self._next_report = time.monotonic() + self._retry.next()

    async def _report(self) -> bool:
        """Report progress and act on the answer; False when no coordinator answered."""
        if self._client is None:
            try:
                self._client = await self.ctx.rank.finder.find(self.config.job_name, timeout=0)
            except NoCoordinator:
                return False
        offer = self._offering = self._offer
        progress = (self._replication.newest_replicated, self.uploaded)
        try:
            answer = await self._client.report_progress(
                self.config.node_rank,
                self.ctx.rank.incarnation_id,
                Progress(
                    replicated_step=self._replication.newest_replicated,
                    uploaded_step=self.uploaded,
                    address=self.ctx.rank.advertise,
                    held=offer,
                    replicating_step=self._replication.pushing,
                    address_ranks=self._asked,
                ),
            )
        except CoordinatorError as exc:
            # The coordinator moved or restarted: look it up again on the next report. It
            # may have taken the new promise or not: keep both.
            self._log.warning("progress report failed: %s", exc)
            if self._promised is not None:
                self._promised = None if offer is None else self._promised | offer
            self._offering = None
            await self._client.close()
            self._client = None
            return False
        # The answer was computed with this promise: it replaces the older one, and the
        # restorable step it names is kept from here on (``protected``).
        self._promised, self._offering = offer, None
        self._reported = progress
        self._next_report = time.monotonic() + answer.report_every
        self.keep_steps = answer.keep_steps
        if answer.restorable_step is not None and answer.restorable_step != self.restorable:
            self.restorable = answer.restorable_step
            self._log.info("restorable step of the cluster: %d", self.restorable)
        self.ctx.metrics.cluster_restorable(self.config.job_name, self.restorable)
        if answer.last_backup is not None:
            last = answer.last_backup
            self.backed_up = last.step
            self.ctx.metrics.backed_up(self.config.job_name, last.step, last.at)
        # The pushers' addresses came only for their nodes: peers are the targets.
        self._replication.update_addresses(
            {r: a for r, a in answer.addresses.items() if r in self._targets}
        )
        self.rank_nodes.update(answer.nodes)
        self.answered = True
        self._orders.take(answer.backup_step, reported=progress[1])
        return True
