"""The job coordinator's server side: hosting coordinators and serving them. I/O module.

``CoordinatorHost`` keeps the ``JobCoordinator`` state machines this daemon hosts (one per
job whose rank 0 runs here, one-node jobs included), each with a random id and a change
signal for long polls. ``Coordinators`` is the service in our own types: backup listings,
restore pins, long polls around the pure state machine. Two transports reach it:
``CoordinatorServicer`` serves ``mtc.v1.Coordinator`` over gRPC (every request is checked
completely first; our exceptions become one status code in ``status_for``), and
``cluster.link.LocalCoordinator`` calls it in process for a one-node job. Agents call it
through ``cluster.link`` (docs/architecture.md, "Restore rounds").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import grpc
import grpc.aio

from replicator._pb.mtc.v1 import coordinator_pb2 as pb
from replicator._pb.mtc.v1 import coordinator_pb2_grpc
from replicator.cluster.messages import (
    MAX_CLUSTER_VIEW_CHARS,
    MAX_DETAIL_CHARS,
    MAX_WAIT_SECONDS,
    SERVICE,
    BadMessage,
    State,
    StatusKey,
    check_address,
    check_address_ranks,
    check_held_steps,
    check_incarnation,
    check_job,
    inventory_items,
    join_item_limit,
    seen_key,
    source_keys,
    status_key,
    status_message,
)
from replicator.cluster.registry import new_coordinator_id
from replicator.core.backup_layout import CommitRecord
from replicator.core.contract import JobConfig
from replicator.core.coordination import (
    COMMIT_RETRY_SECONDS,
    JobCoordinator,
    Join,
    JoinRejected,
    Phase,
    ProgressAnswer,
    RankStatus,
    ReportRefused,
)
from replicator.core.jobname import is_job_name
from replicator.core.layout import backup_items
from replicator.core.ownership import UNOWNED, BadOwner, check_owner, may_join
from replicator.core.restore_plan import NodeInventory, SourceKey
from replicator.obs.logs import JobLog

__all__ = [
    "BACKUPS_TTL",
    "SERVICE",
    "BackupsFor",
    "BackupsUnavailable",
    "CoordinatorHost",
    "CoordinatorServicer",
    "Coordinators",
    "ForeignOwner",
    "HostedJob",
    "Identity",
    "NotHosted",
    "NotInReleasedRound",
    "Progress",
    "status_for",
]

log = logging.getLogger(__name__)

UNADOPTED_SAY_SECONDS = 60.0
"""How often a coordinator restarted in steady state names the ranks it has not heard from
(ranks report at least every 30 s, ``core.coordination.report_every``)."""

BACKUPS_TTL = 5.0
"""How long one listing of the committed backups serves joins: a round's joins arrive
together, and listing a bucket per join would cost N listings for N nodes."""


# --- errors ----------------------------------------------------------------------------------


class NotHosted(LookupError):
    """This daemon hosts no coordinator for the job."""


class NotInReleasedRound(Exception):
    """The caller's incarnation is not a member of the released round; it must join again."""


class ForeignOwner(PermissionError):
    """A join from another owner than the job's: refused, with nothing about the job."""


class BackupsUnavailable(Exception):
    """The committed backups could not be listed: planning without them could lose steps."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that turns a servicer-side exception into a gRPC status."""
    if isinstance(exc, BadMessage | ReportRefused | BadOwner):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, NotHosted):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, JoinRejected | NotInReleasedRound):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, ForeignOwner):
        code = grpc.StatusCode.PERMISSION_DENIED
    elif isinstance(exc, BackupsUnavailable):
        code = grpc.StatusCode.UNAVAILABLE
    else:
        code = grpc.StatusCode.INTERNAL
    return code, str(exc) or type(exc).__name__


# --- hosting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who answers a coordinator call: every answer names it, so callers notice a stale
    registry entry (another job) or a restarted coordinator (another id)."""

    job: str
    coordinator_id: str


@dataclass
class HostedJob:
    """One coordinator this daemon hosts: the state machine, its id, its change signal."""

    coordinator: JobCoordinator
    coordinator_id: str
    owner: str = UNOWNED
    """The job's owner (``core.ownership``): the only one whose joins are admitted."""
    _waiting: dict[int, asyncio.Event] = field(default_factory=dict)
    """Per rank, the event its long polls wait on: set (and dropped) when the round changes
    for everyone, or for that rank alone. One event per rank, not one for all: with one,
    each of N joins woke every waiting rank, N^2 wake-ups per round."""
    backups_noted: bool = False
    """Whether a coordinator restarted in steady state has read the newest backup's time."""
    said_unadopted: float | None = None
    """Restarted in steady state: when the ranks yet to report were last logged (or the
    first report came)."""

    @property
    def job(self) -> str:
        return self.coordinator.config.job_name

    @property
    def identity(self) -> Identity:
        return Identity(self.job, self.coordinator_id)

    def addresses(self, ranks: Collection[int] | None = None) -> dict[int, str]:
        """Members' addresses: of ``ranks`` (None: every member's)."""
        members = self.coordinator.members
        wanted = members if ranks is None else (r for r in ranks if r in members)
        return {r: members[r].inventory.address for r in wanted}

    def changed(self, rank: int) -> asyncio.Event:
        """What a long poll of ``rank`` waits on."""
        return self._waiting.setdefault(rank, asyncio.Event())

    def notify(self, rank: int | None = None) -> None:
        """Wake the long polls of ``rank`` (None: of every rank)."""
        if rank is None:
            waiting, self._waiting = self._waiting, {}
            for event in waiting.values():
                event.set()
        elif rank in self._waiting:
            self._waiting.pop(rank).set()


class CoordinatorHost:
    """The coordinators this daemon hosts, by job. Used from the daemon's event loop only."""

    def __init__(self, new_id: Callable[[], str] = new_coordinator_id) -> None:
        self._new_id = new_id
        self._jobs: dict[str, HostedJob] = {}

    def host(
        self,
        config: JobConfig,
        cluster_view: str,
        *,
        resume_steady: bool = False,
        rank0_incarnation: str | None = None,
        owner: str = UNOWNED,
    ) -> JobCoordinator:
        """Host ``config``'s job for ``owner`` (this node accepted its ``replicator.yaml`` as
        rank 0).

        A new incarnation of rank 0 with the same owner and cluster-wide keys keeps the
        coordinator: the state machine opens the new round when rank 0's
        ``rank0_incarnation`` joins (the daemon names it: only it can tell a job restart from
        a stray join). Other keys replace it with a new one (and a new id, so agents notice
        and re-join under rank 0's config).
        """
        job = config.job_name
        current = self._jobs.get(job)
        if (
            current is not None
            and current.coordinator.cluster_view == cluster_view
            and current.owner == owner
        ):
            current.coordinator.rank0_incarnation = rank0_incarnation
            return current.coordinator
        coordinator = JobCoordinator(config, cluster_view, rank0_incarnation)
        hosted = HostedJob(coordinator, self._new_id(), check_owner(owner))
        if resume_steady:
            hosted.coordinator.resume_steady()
        self._jobs[job] = hosted
        if current is not None:
            current.notify()
        log.info(
            "hosting the coordinator job=%s id=%s nodes=%d",
            job,
            hosted.coordinator_id,
            config.nodes,
        )
        return hosted.coordinator

    def drop(self, job: str) -> None:
        """Stop hosting ``job``'s coordinator (this node no longer runs its rank 0)."""
        hosted = self._jobs.pop(job, None)
        if hosted is not None:
            hosted.notify()  # long polls answer NOT_FOUND now, not at their deadline
            log.info("dropped the coordinator job=%s id=%s", job, hosted.coordinator_id)

    def close(self) -> None:
        """Drop every coordinator, before the server stops, so long polls end at once."""
        for job in list(self._jobs):
            self.drop(job)

    def get(self, job: str) -> HostedJob | None:
        return self._jobs.get(job)

    def coordinator_id(self, job: str) -> str | None:
        """What to register for ``job`` (``RegistryEntry.coordinator_id``), if hosted."""
        hosted = self._jobs.get(job)
        return None if hosted is None else hosted.coordinator_id

    def jobs(self) -> list[str]:
        return sorted(self._jobs)


# --- the service -----------------------------------------------------------------------------

BackupsFor = Callable[[str], Mapping[int, CommitRecord]]
CommitBackup = Callable[[str, int, Sequence[str]], CommitRecord | None]
"""Write the COMMIT of ``(job, step)`` naming these item keys (``BackupStore.try_commit``;
blocking I/O, run in a thread): the record, or None while an item's manifest is missing."""


class RestorePins(Protocol):
    """Operators' restore pins (``mtc backups restore``); blocking I/O, run in threads."""

    def pinned_step(self, job: str) -> int | None:
        """The committed step the job's next round must use, if a valid pin names one."""
        ...

    def consumed(self, job: str, step: int) -> None:
        """A round planned under the pin of ``step`` was released: remove that pin."""
        ...


Listing = tuple[Mapping[int, CommitRecord], int | None]
"""A job's committed backups and its pinned step."""


@dataclass(frozen=True)
class Progress:
    """A rank's ReportProgress, in our types."""

    replicated_step: int | None
    uploaded_step: int | None = None
    address: str = ""
    held: frozenset[int] | None = None
    """The rank's promise (None: it keeps every step)."""
    replicating_step: int | None = None
    address_ranks: frozenset[int] | None = None
    """The ranks whose addresses the answer carries (None: every rank's)."""


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
    ) -> None:
        self.host = host
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
    ) -> tuple[Identity, int]:
        """Admit a join of ``owner``'s; returns who answered and the round it counts for."""
        rank = inventory.rank
        self._admit(job, rank, owner)  # before listing any backups
        backups, pinned = await self._committed_backups(job)
        hosted = self._admit(job, rank, owner)  # it may have been replaced meanwhile
        coordinator = hosted.coordinator
        before = _round_key(coordinator)
        t0 = time.perf_counter()
        round_ = coordinator.join(Join(rank, incarnation, cluster_view, inventory), backups, pinned)
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
                "join: incarnation %s at %s is not admitted to round %d (%s): an agent of "
                "the released run, or not the rank 0 this daemon runs",
                incarnation,
                inventory.address,
                round_,
                coordinator.phase.value,
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
    ) -> Identity:
        """A rank's outcome for a plan (stale ones are ignored by the state machine)."""
        hosted = self.hosted(job, rank)
        coordinator = hosted.coordinator
        before = _round_key(coordinator)
        t0 = time.perf_counter()
        try:
            coordinator.report_restore(
                rank, incarnation, round_, plan_version, ready=ready, failed=failed
            )
        except ReportRefused as exc:
            JobLog(log, job, rank).warning("restore report refused: %s", exc)
            raise
        self._consume_pin(job, coordinator)
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
        self, job: str, rank: int, incarnation: str, progress: Progress
    ) -> tuple[Identity, ProgressAnswer]:
        """Fold in a rank's steady-state progress; the answer may order a backup."""
        hosted = self.hosted(job, rank)
        coordinator = hosted.coordinator
        if coordinator.adopting and not hosted.backups_noted:
            # Restarted in steady state: the backup interval counts from the newest
            # committed backup, as after a round's joins, not from nothing.
            hosted.backups_noted = True
            backups, _ = await self._committed_backups(job)
            if backups:
                newest = max(backups)
                coordinator.note_committed_backup(newest, backups[newest].created)
        answer = coordinator.report_progress(
            rank,
            incarnation,
            replicated_step=progress.replicated_step,
            uploaded_step=progress.uploaded_step,
            now=self.clock(),
            address=progress.address,
            held=progress.held,
            replicating=progress.replicating_step,
            address_ranks=progress.address_ranks,
        )
        if answer is None:
            raise NotInReleasedRound(
                f"rank {rank} (incarnation {incarnation}) of job {job} is not a member of the "
                "released round; join again"
            )
        step = coordinator.take_commit()
        if step is not None:
            self._start(self._commit(job, coordinator, step), f"commit-{job}-{step}")
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
        task.add_done_callback(self._tasks.discard)

    async def _commit(self, job: str, coordinator: JobCoordinator, step: int) -> None:
        """Write the COMMIT of an ordered backup every uploader reported done."""
        keys = [i.key for i in backup_items(coordinator.config, step)]
        extra = {"job": job, "step": step}
        record: CommitRecord | None = None
        if self.commit is None:
            why = "this daemon has no backup store"
        else:
            why = "an uploaded item's manifest is missing"
            try:
                record = await asyncio.to_thread(self.commit, job, step, keys)
            except Exception as exc:
                why = str(exc)
        if record is None:
            log.warning(
                "backup of step %d not committed (%s); ordering a backup again in %.0fs",
                step,
                why,
                COMMIT_RETRY_SECONDS,
                extra=extra,
            )
            coordinator.backup_not_committed(step, self.clock())
            return
        coordinator.backup_committed(step, record.created)
        log.info("backup of step %d committed: %d items", step, len(keys), extra=extra)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """``mtc.v1.Coordinator`` over ``Coordinators``; handlers run in the daemon's loop.

    Every request is hostile input: it is checked completely (``cluster.messages``) before
    the state machine sees it, and our exceptions become one status code in ``status_for``.
    """

    def __init__(self, coordinators: Coordinators) -> None:
        self.coordinators = coordinators
        self.host = coordinators.host

    def register(self, server: grpc.aio.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self, server)

    def _served(self, job: str) -> str:
        """``job``, unless its coordinator is a one-node job's: that one answers its own
        daemon in process only, never the network (nobody else may join or report)."""
        hosted = self.host.get(job)
        if hosted is not None and hosted.coordinator.config.nodes == 1:
            raise NotHosted(f"this daemon hosts no coordinator for job {job}")
        return job

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.JoinResponse:
        try:
            job = self._served(check_job(request.job))
            incarnation = check_incarnation(request.incarnation_id)
            address = check_address(request.address)
            if not 0 < len(request.cluster_view) <= MAX_CLUSTER_VIEW_CHARS:
                raise BadMessage(f"cluster_view must have 1 to {MAX_CLUSTER_VIEW_CHARS} characters")
            owner = check_owner(request.owner)
            limit = self.coordinators.join_limit(job, request.rank, owner)
            items = inventory_items(job, request.items, limit)
            address_ranks = check_address_ranks(request.address_ranks, request.address_ranks_given)
            inventory = NodeInventory(request.rank, address, items)
            identity, round_ = await self.coordinators.join(
                job, incarnation, request.cluster_view, inventory, owner
            )
            response = pb.JoinResponse(coordinator=_identity(identity), round=round_)
            if request.wait_seconds:
                identity, status, addresses = await self.coordinators.after_join(
                    job,
                    request.rank,
                    incarnation,
                    request.wait_seconds,
                    address_ranks=address_ranks,
                )
                response.status.CopyFrom(status_message(_identity(identity), status, addresses))
        except Exception as exc:
            await _abort(context, "Join", request, exc)
        return response

    async def RoundStatus(
        self, request: pb.RoundStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RoundStatusResponse:
        try:
            job = self._served(check_job(request.job))
            incarnation = check_incarnation(request.incarnation_id)
            identity, status, addresses = await self.coordinators.round_status(
                job,
                request.rank,
                incarnation,
                seen_key(request),
                request.wait_seconds,
                address_ranks=check_address_ranks(
                    request.address_ranks, request.address_ranks_given
                ),
            )
            return status_message(_identity(identity), status, addresses)
        except Exception as exc:
            await _abort(context, "RoundStatus", request, exc)

    async def ReportRestore(
        self, request: pb.ReportRestoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportRestoreResponse:
        try:
            job = self._served(check_job(request.job))
            incarnation = check_incarnation(request.incarnation_id)
            rank = request.rank
            config = self.coordinators.hosted(job, rank).coordinator.config
            failed = source_keys(request.failures, job, rank, config.nodes, join_item_limit(config))
            address_ranks = check_address_ranks(request.address_ranks, request.address_ranks_given)
            identity = self.coordinators.report_restore(
                job,
                rank,
                incarnation,
                request.round,
                request.plan_version,
                ready=request.ready,
                failed=failed,
            )
            jlog = JobLog(log, job, rank)
            for failure, key in zip(request.failures, failed, strict=True):
                holder = "the backup" if key.holder is None else f"rank {key.holder}"
                jlog.warning(
                    "restore: %s from %s failed (%s): %s",
                    key.item,
                    holder,
                    "corrupt" if failure.corrupt else "unavailable",
                    failure.detail[:MAX_DETAIL_CHARS],
                    step=key.item.step,
                )
            response = pb.ReportRestoreResponse(coordinator=_identity(identity))
            if request.wait_seconds:
                identity, status, addresses = await self.coordinators.after_report(
                    job,
                    rank,
                    incarnation,
                    (request.round, request.plan_version),
                    request.wait_seconds,
                    address_ranks=address_ranks,
                )
                response.status.CopyFrom(status_message(_identity(identity), status, addresses))
        except Exception as exc:
            await _abort(context, "ReportRestore", request, exc)
        return response

    async def ReportProgress(
        self, request: pb.ReportProgressRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportProgressResponse:
        try:
            job = self._served(check_job(request.job))
            incarnation = check_incarnation(request.incarnation_id)
            progress = Progress(
                replicated_step=(
                    request.replicated_step if request.HasField("replicated_step") else None
                ),
                uploaded_step=(
                    request.uploaded_step if request.HasField("uploaded_step") else None
                ),
                address=check_address(request.address) if request.address else "",
                held=check_held_steps(request.held_steps) if request.reports_holdings else None,
                replicating_step=(
                    request.replicating_step if request.HasField("replicating_step") else None
                ),
                address_ranks=check_address_ranks(
                    request.address_ranks, request.address_ranks_given
                ),
            )
            identity, answer = await self.coordinators.report_progress(
                job, request.rank, incarnation, progress
            )
        except Exception as exc:
            await _abort(context, "ReportProgress", request, exc)
        response = pb.ReportProgressResponse(coordinator=_identity(identity))
        if answer.restorable_step is not None:
            response.restorable_step = answer.restorable_step
        if answer.backup_step is not None:
            response.backup_step = answer.backup_step
        response.addresses.update(answer.addresses)
        response.keep_steps.extend(sorted(answer.keep_steps))
        response.report_every_seconds = answer.report_every
        if answer.last_backup is not None:
            response.committed_backup_step = answer.last_backup.step
            response.committed_backup_at = answer.last_backup.at
        return response


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


def _identity(identity: Identity) -> pb.CoordinatorIdentity:
    return pb.CoordinatorIdentity(job=identity.job, coordinator_id=identity.coordinator_id)


async def _abort(
    context: grpc.aio.ServicerContext[Any, Any], method: str, request: Any, exc: Exception
) -> NoReturn:
    code, message = status_for(exc)
    job = getattr(request, "job", "")
    rank = getattr(request, "rank", None)
    # Refused requests are hostile input: a job name that is not one goes to the log quoted.
    extra = {"job": job if is_job_name(job) else repr(job[:80]), "rank": rank}
    if code is grpc.StatusCode.INTERNAL:
        log.error(
            "%s from %s failed: %s", method, context.peer(), message, exc_info=exc, extra=extra
        )
    else:
        log.warning(
            "%s from %s refused: %s: %s", method, context.peer(), code.name, message, extra=extra
        )
    await context.abort(code, message)
