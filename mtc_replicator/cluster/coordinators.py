"""The coordinator calls of every job this daemon hosts, in our own types. I/O module
(backup listings, restore pins and COMMITs run in threads).

``Coordinators`` wraps the pure state machine (``core.coordination``) of each hosted job
(``cluster.hosting``) with what it cannot do itself: listing the committed backups once for
a round's joins, restore pins, long polls, writing an ordered backup's ``COMMIT``. Two
transports reach it: ``cluster.coordinator_servicer`` over gRPC (requests checked in
``cluster.messages`` first) and ``cluster.link.LocalCoordinator`` in process for a one-node
job. Agents call it through ``cluster.link`` (docs/architecture.md, "Restore rounds").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from mtc_replicator.cluster.backup_orders import CommitBackup, commit_ordered
from mtc_replicator.cluster.hosting import CoordinatorHost, HostedJob, NotHosted
from mtc_replicator.cluster.messages import (
    MAX_WAIT_SECONDS,
    BadMessage,
    Identity,
    State,
    StatusKey,
    join_item_limit,
    status_key,
)
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.coordination import (
    JobCoordinator,
    Join,
    JoinRejected,
    Phase,
    ProgressAnswer,
    RankStatus,
    ReportRefused,
)
from mtc_replicator.core.ownership import UNOWNED, may_join
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.rank_holders import SavedHolders
from mtc_replicator.core.restore_plan import NodeInventory, SourceKey
from mtc_replicator.obs.logs import JobLog

log = logging.getLogger(__name__)

UNADOPTED_SAY_SECONDS = 60.0
"""How often a coordinator restarted in steady state names the ranks it has not heard from
(ranks report at least every 30 s, ``core.coordination.report_every``)."""

BACKUPS_TTL = 5.0
"""How long one listing of the committed backups serves joins: a round's joins arrive
together, and listing a bucket per join would cost N listings for N nodes."""


# --- errors ----------------------------------------------------------------------------------


class NotInReleasedRound(Exception):
    """The caller's incarnation is not a member of the released round; it must join again."""


class ForeignOwner(PermissionError):
    """A join from another owner than the job's: refused, with nothing about the job."""


class BackupsUnavailable(Exception):
    """The committed backups could not be listed: planning without them could lose steps."""


# --- the service -----------------------------------------------------------------------------

BackupsFor = Callable[[str], Mapping[int, CommitRecord]]


class RestorePins(Protocol):
    """Operators' restore pins (``mtc backups pin``); blocking I/O, run in threads."""

    def pinned_step(self, job: str) -> int | None:
        """The committed step the job's next round must use, if a valid pin names one."""
        ...

    def consumed(self, job: str, step: int) -> None:
        """A round planned under the pin of ``step`` was released: remove that pin."""
        ...


class HolderRecords(Protocol):
    """The released round's rank holders per job and each rank's history of nodes, kept
    across daemon restarts (``local.holders_file.HoldersFile``)."""

    def save(self, job: str, saved: SavedHolders) -> None: ...

    def load(self, job: str, ranks: int) -> SavedHolders | None: ...


Listing = tuple[Mapping[int, CommitRecord], int | None]
"""A job's committed backups and its pinned step."""


Granted = Callable[[str, int], "Mapping[int, str] | None"]
"""``grants(job, nodes)``: the ranks' nodes by the controller's grant in force, or None."""


class Coordinators:
    """The coordinator calls of every job this daemon hosts, in our own types.

    One implementation serves both transports: ``CoordinatorServicer`` (gRPC, for the ranks
    of a cluster job on other nodes) and ``cluster.link.LocalCoordinator`` (in process, for a
    one-node job), so every restore goes through the same rounds. Callers pass checked
    values; errors are ours (``NotHosted``, ``JoinRejected``, ``NotInReleasedRound``,
    ``BackupsUnavailable``, ``BadMessage``). ``backups_for(job)`` lists the job's committed
    backups (blocking I/O: it runs in a thread); ``clock`` is wall-clock seconds for backup
    intervals. Used from the daemon's event loop only.
    """

    def __init__(
        self,
        host: CoordinatorHost,
        backups_for: BackupsFor,
        *,
        clock: Callable[[], float] = time.time,
        backups_ttl: float = BACKUPS_TTL,
        pins: RestorePins | None = None,
        commit: CommitBackup | None = None,
        holders: HolderRecords | None = None,
        on_rank_refused: Callable[[], None] = lambda: None,
        grants: Granted | None = None,
    ) -> None:
        self.host = host
        self.holders = holders
        self.grants = grants
        """The controller's bindings of a job's ranks to nodes, when a grant is in force for
        the run this node coordinates (``core.grant``): they decide who may be each rank."""
        self._refusals_logged: set[tuple[str, int, str]] = set()
        self.on_rank_refused = on_rank_refused
        """Counts a call refused for another node's rank (``Metrics.identity_refused``)."""
        self.backups_for = backups_for
        self.commit = commit
        self.pins = pins
        self.clock = clock
        self.backups_ttl = backups_ttl
        self._backups: dict[str, tuple[float, Listing]] = {}
        self._listing: dict[str, asyncio.Future[Listing]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def hosted(self, job: str, rank: int) -> HostedJob:
        hosted = self.host.get(job)
        if hosted is None:
            raise NotHosted(f"this daemon hosts no coordinator for job {job}")
        nodes = hosted.coordinator.config.nodes
        if not 0 <= rank < nodes:
            raise BadMessage(f"rank {rank} is out of range for job {job}")
        return hosted

    def join_limit(self, job: str, rank: int, owner: str) -> int:
        """The most items a join of ``owner``'s to ``job`` may list (``join_item_limit``);
        refused as ``join`` would be when ``owner`` may not join it."""
        return join_item_limit(self._admit(job, rank, owner).coordinator.config)

    def _admit(self, job: str, rank: int, owner: str) -> HostedJob:
        """The job, if ``owner`` may join it: checked before anything else about the job
        (its ranks, round or members) is looked at, so a refusal tells nothing of it."""
        hosted = self.host.get(job)
        if hosted is not None and not may_join(hosted.owner, owner):
            raise ForeignOwner(f"join refused: job {job} belongs to another owner")
        return self.hosted(job, rank)

    def _list(self, job: str) -> Listing:
        return self.backups_for(job), (self.pins.pinned_step(job) if self.pins else None)

    async def _committed_backups(self, job: str) -> Listing:
        """The job's committed backups and pin, listed at most once per ``backups_ttl`` (one
        listing in flight, shared by the joins that wait for it)."""
        loop = asyncio.get_running_loop()
        cached = self._backups.get(job)
        if cached is not None and loop.time() - cached[0] < self.backups_ttl:
            return cached[1]
        listing = self._listing.get(job)
        if listing is None:
            listing = asyncio.ensure_future(asyncio.to_thread(self._list, job))
            self._listing[job] = listing
            listing.add_done_callback(functools.partial(self._listed, job))
        try:
            backups = await asyncio.shield(listing)
        except Exception as exc:
            raise BackupsUnavailable(f"cannot list the backups of job {job}: {exc}") from exc
        self._backups[job] = (loop.time(), backups)
        return backups

    def _listed(self, job: str, listing: asyncio.Future[Listing]) -> None:
        self._listing.pop(job, None)
        if not listing.cancelled():
            listing.exception()  # retrieved here too: its joins may all have gone

    async def join(
        self,
        job: str,
        incarnation: str,
        cluster_view: str,
        inventory: NodeInventory,
        owner: str = UNOWNED,
        *,
        node: str | None = None,
    ) -> tuple[Identity, int]:
        """Admit a join of ``owner``'s from ``node`` (the caller's certificate; None: not
        known); returns who answered and the round it counts for."""
        rank = inventory.rank
        self._granted_only(self._admit(job, rank, owner), rank, node)  # before any listing
        backups, pinned = await self._committed_backups(job)
        hosted = self._admit(job, rank, owner)  # it may have been replaced meanwhile
        coordinator = hosted.coordinator
        self._load_holders(hosted)
        before = _round_key(coordinator)
        t0 = time.perf_counter()
        refused = coordinator.holders.refused
        round_ = coordinator.join(
            Join(rank, incarnation, cluster_view, inventory, node), backups, pinned
        )
        if coordinator.holders.refused != refused:
            self.on_rank_refused()
        jlog = JobLog(log, job, rank)
        if coordinator.phase is Phase.FETCH:
            # Planned: the listing served this round's joins. The next round (a job restart
            # seconds later) must list again, or it plans without a backup committed since.
            self._backups.pop(job, None)
        if backups:
            newest = max(backups)
            coordinator.note_committed_backup(newest, backups[newest].created)
        _changed(hosted, rank, before, t0, jlog)
        if coordinator.admitted(rank, incarnation):
            jlog.info(
                "join: incarnation %s at %s with %d items counts for round %d (%s%s)",
                incarnation,
                inventory.address,
                len(inventory.items),
                round_,
                coordinator.phase.value,
                "; waits for rank 0 to open the next" if rank in coordinator.pending else "",
            )
        else:
            jlog.warning(
                "join: incarnation %s at %s is not admitted to round %d (%s): %s",
                incarnation,
                inventory.address,
                round_,
                coordinator.phase.value,
                coordinator.refused_why
                or "an agent of the released run, or not the rank 0 this daemon runs",
            )
        return hosted.identity, round_

    async def round_status(
        self,
        job: str,
        rank: int,
        incarnation: str,
        seen: StatusKey | None,
        wait: float,
        *,
        address_ranks: Collection[int] | None = None,
    ) -> tuple[Identity, RankStatus, dict[int, str]]:
        """The round as ``rank`` sees it, once it differs from ``seen`` or ``wait`` passed;
        with the addresses of the members in ``address_ranks`` (None: of every member)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, MAX_WAIT_SECONDS)
        looked_at: tuple[Join | None, tuple[object, ...]] | None = None
        while True:
            hosted = self.hosted(job, rank)
            changed = hosted.changed(rank)
            c = hosted.coordinator
            # The rank's answer depends on these only: a wake-up for another rank's join
            # that changed none of them costs this waiter no status computation.
            member = c.members.get(rank)
            state = (hosted.coordinator_id, c.round, c.phase, c.plan_version)
            remaining = deadline - loop.time()
            fresh = looked_at is None or looked_at[0] is not member or looked_at[1] != state
            if fresh or remaining <= 0:
                looked_at = (member, state)
                status = c.status(rank, incarnation)
                if status_key(status) != seen or remaining <= 0:
                    return (
                        hosted.identity,
                        status,
                        hosted.addresses(_with_holders(status, address_ranks)),
                    )
            try:
                async with asyncio.timeout(remaining):
                    await changed.wait()
            except TimeoutError:
                pass  # answer with what there is now

    async def after_join(
        self,
        job: str,
        rank: int,
        incarnation: str,
        wait: float,
        *,
        address_ranks: Collection[int] | None = None,
    ) -> tuple[Identity, RankStatus, dict[int, str]]:
        """Right after ``rank``'s join: the round once it is no longer waiting for ranks to
        join (planned, released, or this incarnation superseded), or when ``wait`` passed.

        What a joining agent's first polls would wait for, in the join's own call. A rank
        that joined before rank 0 reopened the job waits through the new round's opening
        too (still WAITING, one round on): at a job restart most ranks may come first.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait, MAX_WAIT_SECONDS)
        now = self.hosted(job, rank).coordinator.status(rank, incarnation)
        while True:
            seen = status_key(now) if now.phase is Phase.WAITING else None
            remaining = max(0.0, deadline - loop.time())
            identity, now, addresses = await self.round_status(
                job, rank, incarnation, seen, remaining, address_ranks=address_ranks
            )
            if now.phase is not Phase.WAITING or loop.time() >= deadline:
                return identity, now, addresses

    async def after_report(
        self,
        job: str,
        rank: int,
        incarnation: str,
        reported: tuple[int, int],
        wait: float,
        *,
        address_ranks: Collection[int] | None = None,
    ) -> tuple[Identity, RankStatus, dict[int, str]]:
        """Right after ``rank`` reported on plan ``reported`` (round, plan version): the
        round once it moved past that plan (released, re-planned, a new round), or when
        ``wait`` passed. What the reporting agent's next poll would wait for, in the
        report's own call."""
        round_, plan_version = reported
        seen = (round_, State.FETCH, plan_version)
        return await self.round_status(
            job, rank, incarnation, seen, wait, address_ranks=address_ranks
        )

    def report_restore(
        self,
        job: str,
        rank: int,
        incarnation: str,
        round_: int,
        plan_version: int,
        *,
        ready: bool,
        failed: Sequence[SourceKey] = (),
        node: str | None = None,
    ) -> Identity:
        """A rank's outcome for a plan (stale ones are ignored by the state machine), from
        ``node`` (the caller's certificate; None: not known)."""
        hosted = self.hosted(job, rank)
        coordinator = hosted.coordinator
        before = _round_key(coordinator)
        t0 = time.perf_counter()
        try:
            coordinator.report_restore(
                rank, incarnation, round_, plan_version, ready=ready, failed=failed, node=node
            )
        except ReportRefused as exc:
            JobLog(log, job, rank).warning("restore report refused: %s", exc)
            if "is held by node" in str(exc):
                self.on_rank_refused()
            raise
        if before[1] is not Phase.RELEASED and coordinator.phase is Phase.RELEASED:
            self._save_holders(job, coordinator)
        self._consume_pin(job, coordinator)
        passed = coordinator.passed_over
        if not ready and passed is not None:
            # A member's word counts for its own restore only, but a rank with no source
            # left takes the whole job to an older step: the operator must see who did.
            chosen = coordinator.plan
            JobLog(log, job, rank).warning(
                "plan %d restores %s: step %d was passed over only because ranks %s reported "
                "its copies failed for their own restore; every rank keeps its copies of it "
                "aside",
                coordinator.plan_version,
                "nothing (a fresh start)" if chosen is None else f"step {chosen.step}",
                passed.step,
                list(passed.reporters),
            )
        _changed(hosted, rank, before, t0, JobLog(log, job, rank))
        JobLog(log, job, rank).log(
            logging.DEBUG if ready else logging.INFO,
            "restore report: ready=%s for round %d plan %d; now round %d plan %d (%s)",
            ready,
            round_,
            plan_version,
            coordinator.round,
            coordinator.plan_version,
            coordinator.phase.value,
        )
        return hosted.identity

    def _granted_only(self, hosted: HostedJob, rank: int, node: str | None) -> None:
        """With a grant in force, a join of a rank from another node is refused here, before
        any listing or round state is touched: a flood of them costs a lookup each, and
        cannot take a rank from the node the controller gave it (logged once per node)."""
        coordinator = hosted.coordinator
        config = coordinator.config
        coordinator.holders.granted = (
            None if self.grants is None else self.grants(hosted.job, config.nodes)
        )
        if coordinator.holders.granted is None:
            return  # no grant: the round binds ranks as they join (``core.rank_holders``)
        why = coordinator.holders.check(rank, node)
        if not why:
            return
        self.on_rank_refused()
        key = (hosted.job, rank, str(node))
        if key not in self._refusals_logged and len(self._refusals_logged) < 1024:
            self._refusals_logged.add(key)
            JobLog(log, hosted.job, rank).warning("join refused: %s", why)
        raise JoinRejected(why)

    def _load_holders(self, hosted: HostedJob) -> None:
        """Before a new coordinator's first join or report: take back the history of the
        job's rank holders the last one left on this node, and, restarted in steady state,
        the released round's holders (it adopts only their reports)."""
        if self.grants is not None:
            config = hosted.coordinator.config
            hosted.coordinator.holders.granted = self.grants(hosted.job, config.nodes)
        if hosted.holders_loaded:
            return
        hosted.holders_loaded = True
        coordinator = hosted.coordinator
        saved = (
            None
            if self.holders is None
            else self.holders.load(hosted.job, coordinator.config.nodes)
        )
        if saved is not None:
            if saved.released is not None and not coordinator.adopting:
                coordinator.resume_released(saved.released)
            resumed = coordinator.resumed is not None
            coordinator.holders.restore(saved, bindings=coordinator.adopting or resumed)
            if resumed:
                why = "rank 0's agent restarted before its markers"
                JobLog(log, hosted.job, 0).info(
                    "serving released round %d again (%s)", coordinator.round, why
                )

    def _save_holders(self, job: str, coordinator: JobCoordinator) -> None:
        """Keep the holders, their history and the released round for a restart of this
        daemon; written before any rank can hear of the release."""
        holders = coordinator.holders
        released = coordinator.released_record()
        if self.holders is None or not (holders.nodes or holders.history or released):
            return
        try:
            self.holders.save(job, replace(holders.saved(), released=released))
        except OSError as exc:
            log.warning(
                "cannot record the rank holders of job %s: a restart of this daemon adopts "
                "the first report of each rank: %s",
                job,
                exc,
                extra={"job": job},
            )

    def _consume_pin(self, job: str, coordinator: JobCoordinator) -> None:
        pinned = coordinator.pin_consumed
        if pinned is None or self.pins is None:
            return
        coordinator.pin_consumed = None
        plan = coordinator.plan
        restored = None if plan is None else plan.step
        if restored == pinned:
            log.info("restore pin honored: step %d", pinned, extra={"job": job})
        else:
            log.warning(
                "restore pin of step %d could not be honored (no verified copy left); "
                "restored step %s instead",
                pinned,
                restored,
                extra={"job": job},
            )
        self._start(self._unpin(self.pins, job, pinned), f"unpin-{job}")

    async def _unpin(self, pins: RestorePins, job: str, step: int) -> None:
        try:
            await asyncio.to_thread(pins.consumed, job, step)
        except Exception as exc:
            log.warning("cannot remove a used restore pin: %s", exc)

    async def report_progress(
        self, job: str, rank: int, incarnation: str, progress: Progress, node: str | None = None
    ) -> tuple[Identity, ProgressAnswer]:
        """Fold in a rank's steady-state progress from ``node`` (the caller's certificate;
        None: not known); the answer may order a backup."""
        hosted = self.hosted(job, rank)
        coordinator = hosted.coordinator
        self._load_holders(hosted)
        changes = coordinator.holders.changes
        held = coordinator.holders.nodes.get(rank)
        if coordinator.holders.check(rank, node):
            self.on_rank_refused()
            JobLog(log, job, rank).warning(
                "progress report refused: rank %d is held by node %r, not %r (%d calls "
                "refused for coming from another node)",
                rank,
                held,
                node,
                coordinator.holders.refused,
            )
            raise NotInReleasedRound(
                f"rank {rank} of job {job} is held by another node; join again"
            )
        if coordinator.adopting and not hosted.backups_noted:
            # Restarted in steady state: the backup interval counts from the newest
            # committed backup, as after a round's joins, not from nothing.
            hosted.backups_noted = True
            backups, _ = await self._committed_backups(job)
            if backups:
                newest = max(backups)
                coordinator.note_committed_backup(newest, backups[newest].created)
        answer = coordinator.report_progress(
            rank, incarnation, progress, now=self.clock(), node=node
        )
        if answer is None:
            raise NotInReleasedRound(
                f"rank {rank} (incarnation {incarnation}) of job {job} is not a member of the "
                "released round; join again"
            )
        if coordinator.holders.changes != changes:
            self._save_holders(job, coordinator)  # adopted a rank: a node the history lacked
        step = coordinator.take_commit()
        if step is not None:
            self._start(
                commit_ordered(self.commit, coordinator, step, self.clock), f"commit-{job}-{step}"
            )
        if coordinator.adopting:
            self._say_unadopted(hosted)
        return hosted.identity, answer

    def _say_unadopted(self, hosted: HostedJob) -> None:
        """Restarted in steady state: once a minute, name the ranks that have not reported
        since. The restorable step, and so every backup, waits for all of them; a rank
        whose agent is gone would otherwise stop backups without a word."""
        now = self.clock()
        if hosted.said_unadopted is None:
            hosted.said_unadopted = now
        if now - hosted.said_unadopted < UNADOPTED_SAY_SECONDS:
            return
        hosted.said_unadopted = now
        missing, first = hosted.coordinator.unadopted(8)
        if missing:
            log.warning(
                "restarted coordinator: %d of %d ranks have not reported since (ranks %s%s); "
                "no step is restorable and no backup is ordered until every rank has",
                missing,
                hosted.coordinator.config.nodes,
                ", ".join(map(str, first)),
                ", ..." if missing > len(first) else "",
                extra={"job": hosted.job},
            )

    def _start(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(_ended)
        task.add_done_callback(self._tasks.discard)


def _ended(task: asyncio.Task[None]) -> None:
    """A task ``Coordinators`` started ended: one that raised is a bug, logged as one."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed (a bug): %s", task.get_name(), exc, exc_info=exc)


def _with_holders(status: RankStatus, ranks: Collection[int] | None) -> Collection[int] | None:
    """``ranks`` and the holders of the rank's PEER sources (None: every member)."""
    if ranks is None:
        return None
    holders = {f.holder for fetches in status.assignments.values() for f in fetches}
    return {*ranks, *(h for h in holders if h is not None)}


def _round_key(coordinator: JobCoordinator) -> tuple[int, Phase, int]:
    """What every rank's answer depends on: a change wakes every long poll."""
    return coordinator.round, coordinator.phase, coordinator.plan_version


def _changed(
    hosted: HostedJob, rank: int, before: tuple[int, Phase, int], t0: float, jlog: JobLog
) -> None:
    """After a call of ``rank`` changed the state machine: wake only that rank's long polls
    unless the round, phase or plan moved (then every rank's), and log a new plan with the
    time the call took to make it."""
    coordinator = hosted.coordinator
    if _round_key(coordinator) == before:
        hosted.notify(rank)  # only this rank's answer can have changed
        return
    if coordinator.phase is Phase.FETCH and coordinator.plan_version != before[2]:
        _log_plan(jlog, coordinator, time.perf_counter() - t0)
    hosted.notify()


def _log_plan(jlog: JobLog, coordinator: JobCoordinator, seconds: float) -> None:
    plan = coordinator.plan
    load = {} if plan is None else plan.load()
    busiest = max(load.values(), default=0)
    jlog.info(
        "round %d plan %d: %s for %d ranks in %.3fs (%d items; the busiest peer serves %d)",
        coordinator.round,
        coordinator.plan_version,
        "fresh start" if plan is None else f"step {plan.step}",
        coordinator.config.nodes,
        seconds,
        0 if plan is None else len(plan.sources),
        busiest,
        step=None if plan is None else plan.step,
    )
