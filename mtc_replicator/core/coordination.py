"""The coordinator's decisions for one job: rounds, joins, the plan, readiness, backup orders.

Pure: a state machine fed with joins and reports (and the time, for backup intervals); the
gRPC servicer around it only translates messages. It holds nothing that joins cannot
rebuild, so a restarted coordinator recovers by letting agents re-join (docs/architecture.md,
"Rounds and incarnations").

The rules that keep every rank in ONE round of the new incarnation:
- a round is released (markers may appear) only when every rank joined it and reported
  ready for the current plan;
- after a release, only rank 0's new incarnation opens a new round: the coordinator lives
  in rank 0's daemon, which names that incarnation when it accepts the ``replicator.yaml``
  (``rank0_incarnation``), so a stray or forged join cannot stop a running job. Another
  rank's new incarnation waits (pending) and becomes a member when the round opens; the
  new round admits each rank only with an incarnation id other than the one it had in the
  released round (a stale agent of the old run can never complete the new round);
- a member may report failed only the sources the current plan gave it, and its report
  excludes them from its own restore only;
- a new incarnation of a rank during a round in progress restarts that round's planning
  (the rank's inventory may have changed), keeping the other ranks' joins;
- the same rank and incarnation joining again is idempotent (a dropped connection).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.layout import backup_uploaders, missing_ranks, waiting_message
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import LastBackup, Source, backup_due, worker_slots
from mtc_replicator.core.progress import Progress, ProgressBook
from mtc_replicator.core.rank_holders import RankHolders, Released
from mtc_replicator.core.restore_plan import (
    Fetch,
    NodeInventory,
    PassedOver,
    RoundPlan,
    SourceKey,
    passed_over_by_reports,
    plan_round,
)

REPORTS_PER_SECOND = 128
"""The steady-state report rate a coordinator asks its job for, all ranks together: each
report costs it a gRPC call (a few hundred microseconds of Python), so at 4,096 ranks one
report per rank per second would be most of a core. Reports after a new step or a finished
replication or upload still go at once: they are what moves the restorable step."""
MIN_REPORT_EVERY = 1
MAX_REPORT_EVERY = 30
MISSING_SHOWN = 64
"""Most missing ranks a waiting rank is told by number (the message counts the rest)."""
COMMIT_RETRY_SECONDS = 30.0
"""After a COMMIT could not be written (an uploaded manifest is missing), the next backup
order waits this long: every uploader may have reported the step done while not holding it."""


def report_every(nodes: int) -> int:
    """Seconds between one rank's routine progress reports in a job of ``nodes`` ranks."""
    return max(MIN_REPORT_EVERY, min(MAX_REPORT_EVERY, -(-nodes // REPORTS_PER_SECOND)))


class JoinRejected(ValueError):
    """A join that can never be admitted: the text says what to fix, and carries nothing of
    the job's (whoever asks may not be one of its ranks)."""


class ReportRefused(ValueError):
    """A restore report names a source the current plan did not give that rank: ignored."""


class Phase(StrEnum):
    WAITING = "waiting"
    """Not every rank joined the current round."""
    FETCH = "fetch"
    """Planned: ranks obtain and verify their items."""
    RELEASED = "released"
    """Every rank is ready: markers may be published."""


@dataclass(frozen=True)
class Join:
    """One rank's join: who it is, what it runs and what it holds."""

    rank: int
    incarnation_id: str
    cluster_view: str
    """The cluster-wide keys of its ``replicator.yaml`` as canonical JSON."""
    inventory: NodeInventory
    node: str | None = None
    """The node its certificate names (``core.rank_holders``); None: not known."""


@dataclass(frozen=True)
class RankStatus:
    """The round as one rank should see it."""

    round: int
    phase: Phase | None
    """None: this incarnation is not a member of the current round; it must join again."""
    plan_version: int = 0
    step: int | None = None
    """The restored step in FETCH and RELEASED; None means a fresh start."""
    assignments: Mapping[ItemId, tuple[Fetch, ...]] = field(default_factory=dict)
    missing: tuple[int, ...] = ()
    message: str = ""


@dataclass(frozen=True)
class ProgressAnswer:
    restorable_step: int | None
    backup_step: int | None
    """Upload this step now, if set (the same order goes to every uploader)."""
    addresses: Mapping[int, str] = field(default_factory=dict)
    """Every rank's newest known peer address (a restarted daemon's port may change)."""
    keep_steps: frozenset[int] = frozenset()
    """Steps newer than the restorable one that may become restorable next: some rank has
    replicated them or is pushing them, so every rank keeps its own items of them."""
    report_every: int = MIN_REPORT_EVERY
    """Seconds until the rank's next routine report (``report_every``)."""
    last_backup: LastBackup | None = None
    nodes: Mapping[int, str] = field(default_factory=dict)
    """The node each rank of ``addresses`` is bound to, where known (``core.rank_holders``):
    the only node a receiver takes that rank's pushes from."""
    """The newest committed backup known to the coordinator."""


class JobCoordinator:
    """Rounds and steady state of one job, as seen by the coordinator on rank 0's node."""

    def __init__(
        self, config: JobConfig, cluster_view: str, rank0_incarnation: str | None = None
    ) -> None:
        self.config = config
        self.cluster_view = cluster_view
        self.rank0_incarnation = rank0_incarnation
        """Rank 0's current incarnation, as the hosting daemon accepted it; None: unknown
        (any rank 0 join is taken for it)."""
        self.round = 1
        self.phase = Phase.WAITING
        self.members: dict[int, Join] = {}
        self.pending: dict[int, Join] = {}
        """Released: new incarnations of other ranks, waiting for rank 0's to open a round."""
        self.released_incarnations: dict[int, str] = {}
        """Each rank's incarnation in the last released round."""
        self.adopted: set[int] = set()
        """Ranks whose entry in ``released_incarnations`` a restarted coordinator took from
        a progress report (``resume_steady``), not from a round it released: weaker word,
        which the rank's join overrides (an agent that joins is restoring, not running)."""
        self.plan: RoundPlan | None = None
        self.plan_version = 0
        self.ready: set[int] = set()
        self.exclude: set[SourceKey] = set()
        self.passed_over: PassedOver | None = None
        """A newer step the current plan passed over only because of members' reports."""
        self.backups: Mapping[int, CommitRecord] = {}
        self.progress = ProgressBook(config.nodes)
        """Each rank's replicated step, promise, push in flight and upload."""
        self.restorable: int | None = None
        """The newest restorable step answered so far: never lowered, since ranks that
        heard it keep it, while a newer promise may leave it out."""
        self.uploaders = backup_uploaders(config)
        self.backup_in_flight: int | None = None
        self._committing = False
        """The host is writing the COMMIT of ``backup_in_flight`` (``take_commit``)."""
        self._order_after = 0.0
        """No backup is ordered before this time (a COMMIT that could not be written)."""
        self.last_backup: LastBackup | None = None
        self.addresses: dict[int, str] = {}
        """Each rank's peer address: from the joins, then from progress reports."""
        self.adopting = False
        """A coordinator restarted in steady state: it admits each rank's first report."""
        self.holders = RankHolders(rank0=rank0_incarnation)
        """Which node holds each rank (``core.rank_holders``)."""
        self.refused_why = ""
        """Why the last join was not admitted, for the host's log."""
        self.pinned: int | None = None
        """An operator's restore pin (``mtc backups pin``): the step the round must use."""
        self._waiting_key: tuple[int, int] | None = None
        self._waiting_view: tuple[tuple[int, ...], str] = ((), "")
        self.pin_consumed: int | None = None
        """The pin a released round was planned under: it has served, whatever was restored
        (kept, it would roll a much later restart back to this step)."""
        self.resumed: Released | None = None
        """A released round served again after this daemon restarted (``resume_released``),
        until rank 0's agent has come back for its part."""

    def released_record(self) -> Released | None:
        """The released round, to keep for a restart of this daemon; None when rank 0's
        incarnation is not known (nothing could tell a later one from it)."""
        if self.phase is not Phase.RELEASED or self.rank0_incarnation is None or self.adopting:
            return None
        step = None if self.plan is None else self.plan.step
        if self.resumed is not None:
            step = self.resumed.step
        return Released(self.round, self.rank0_incarnation, step, self.released_incarnations)

    def resume_released(self, released: Released) -> None:
        """Rank 0's daemon restarted after it released ``released`` but before its own
        agent published the markers (its incarnation resumes restoring): the other ranks
        may have taken theirs and run on, so the same round is served again, not a new
        one they would never join. Rank 0's join of the same incarnation is answered with
        the round's step, from the items its own store holds (``join``); the others'
        progress reports count as after any release."""
        if released.rank0 != self.rank0_incarnation or len(released.incarnations) != (
            self.config.nodes
        ):
            return
        self.resumed = released
        self.round = released.round
        self.phase = Phase.RELEASED
        self.released_incarnations = dict(released.incarnations)
        self.restorable = released.step
        self.progress.reset(released.step)

    def _rejoined(self, join: Join) -> bool:
        """A rank's agent back for the part of a resumed released round it never took (rank
        0's, or another rank's whose answer died with the daemon): a plan of its own items
        of the step (or, with data parallelism, equivalents), held there (all, or no plan)."""
        resumed = self.resumed
        if resumed is None or resumed.incarnations.get(join.rank) != join.incarnation_id:
            return False
        sources: dict[ItemId, tuple[Fetch, ...]] = {}
        if resumed.step is not None:
            for worker in worker_slots(self.config):
                item = ItemId(self.config.job_name, resumed.step, join.rank, worker)
                fetch = self._held_copy(join, item)
                if fetch is None:
                    # Released as ready, so held; gone since: nothing to serve again, and the
                    # join is refused as a released incarnation's (a job restart opens a round).
                    if join.rank == 0:
                        self.resumed = None
                    return False
                sources[item] = (fetch,)
            kept = {} if self.plan is None else self.plan.sources
            self.plan = RoundPlan(resumed.step, {**kept, **sources}, (resumed.step,))
        self.members[join.rank] = join
        return True

    def _held_copy(self, join: Join, target: ItemId) -> Fetch | None:
        """``target`` or a data-parallel equivalent, as the joining rank's store holds it."""
        for rank in (target.rank, *self.config.equivalent_ranks(target.rank)):
            item = replace(target, rank=rank)
            digest = join.inventory.items.get(item)
            if digest is not None:
                return Fetch(Source.LOCAL, item, join.rank, digest, rank != target.rank)
        return None

    def resume_steady(self) -> None:
        """Rank 0's daemon restarted while the job ran: take the running ranks back.

        Nothing of the released round survived, and joins come only with a new incarnation,
        so steady-state ranks are admitted by their progress reports: each rank's first
        report names its incarnation. The restorable step is rebuilt from the reports
        (a minimum over all ranks, so it can only be too old, never too new). A join opens a
        new round as after any release, and the adopted incarnations can never join it.
        """
        self.phase = Phase.RELEASED
        self.adopting = True

    def unadopted(self, limit: int) -> tuple[int, list[int]]:
        """Restarted in steady state: how many ranks have not reported since, and the
        first ``limit`` of them. Until every rank has, no step is restorable and no backup
        is ordered. O(ranks): for a rate-limited log line, not for every report."""
        if not self.adopting:
            return 0, []
        known = self.released_incarnations
        missing = self.config.nodes - len(known)
        first = [r for r in range(self.config.nodes) if r not in known][:limit] if missing else []
        return missing, first

    # --- restore rounds ----------------------------------------------------------------------

    def join(
        self, join: Join, backups: Mapping[int, CommitRecord], pinned: int | None = None
    ) -> int:
        """Admit a join; returns the round it counts for. Raises ``JoinRejected``.

        ``backups`` and ``pinned`` are the backup store as the join found it.
        """
        if not 0 <= join.rank < self.config.nodes:
            raise JoinRejected(f"rank {join.rank} is out of range for this job")
        if join.inventory.rank != join.rank:
            raise JoinRejected(f"inventory of rank {join.inventory.rank} sent as rank {join.rank}")
        if join.cluster_view != self.cluster_view:
            raise JoinRejected(
                f"rank {join.rank}'s replicator.yaml disagrees with rank 0's on the cluster-wide "
                f"keys ({_differing_keys(join.cluster_view, self.cluster_view)}); every rank "
                "of the job must be started with the same settings"
            )
        current = self.members.get(join.rank)
        self.refused_why = self.holders.check(join.rank, join.node)
        if self.refused_why:
            return self.round
        if self.phase is Phase.RELEASED and self._rejoined(join):
            return self.round
        if current is not None and current.incarnation_id == join.incarnation_id:
            if self.phase is Phase.WAITING:
                self.members[join.rank] = join  # a re-join may carry a fresher inventory
            return self.round
        self.refused_why = self.refusal(join.rank, join.incarnation_id)
        if self.refused_why:
            return self.round
        if join.rank == 0:
            self.holders.rank0_joins(join.incarnation_id)
        self.holders.bind(join.rank, join.node)
        if self.released_incarnations.get(join.rank) == join.incarnation_id:
            # Adopted from a report it sent while restoring (an agent that reported a step
            # it ingested before its round): joining proves it is not running. Forget it.
            del self.released_incarnations[join.rank]
            self.adopted.discard(join.rank)
        if self.phase is Phase.RELEASED and join.rank != 0:
            # Only rank 0's daemon can tell a job restart from a stray join: wait for it.
            self.pending[join.rank] = join
            return self.round
        if self.phase is not Phase.WAITING:
            self.adopting = False
            opening = self.phase is Phase.RELEASED
            self._new_round(keep_members=self.phase is Phase.FETCH)
            if opening:
                self.members.update(self.pending)
                for rank, pending in self.pending.items():
                    self.holders.bind(rank, pending.node)
        self.pending = {}
        self.members[join.rank] = join
        self.backups = backups
        self.pinned = pinned
        if len(self.members) == self.config.nodes:
            self._plan()
        return self.round

    def refusal(self, rank: int, incarnation_id: str) -> str:
        """Why a join of this incarnation is never admitted ("": it may be)."""
        if (
            rank == 0
            and self.rank0_incarnation is not None
            and incarnation_id != self.rank0_incarnation
        ):
            return (
                "rank 0's daemon runs another incarnation of this job: this agent is stale "
                "(its replicator.yaml was replaced) or forged"
            )
        if self.released_incarnations.get(rank) == incarnation_id and rank not in self.adopted:
            return (
                f"this incarnation ran in released round {self.round}: it may not join a "
                "newer round (the job restarted without it)"
            )
        return ""

    def _new_round(self, *, keep_members: bool) -> None:
        if not keep_members:
            self.members = {}
        self.round += 1
        self.phase = Phase.WAITING
        self.plan = None
        self.ready = set()
        self.exclude = set()
        self.passed_over = None

    def _plan(self) -> None:
        inventories = {r: m.inventory for r, m in self.members.items()}
        plan = None
        if self.pinned is not None:
            plan = plan_round(
                self.config, inventories, self.backups, exclude=self.exclude, only_step=self.pinned
            )
            # A pinned step nobody can serve any more (its copies failed): the round goes on
            # with the last-known-good step rather than wait for an operator forever.
        if plan is None:
            plan = plan_round(self.config, inventories, self.backups, exclude=self.exclude)
        self.plan = plan
        fresh = not self.backups and not any(i.items for i in inventories.values())
        self.holders.planned(fresh=fresh)
        self.passed_over = (
            passed_over_by_reports(
                self.config,
                inventories,
                self.backups,
                self.exclude,
                None if plan is None else plan.step,
            )
            if self.exclude
            else None
        )
        self.plan_version += 1
        self.phase = Phase.FETCH
        self.ready = set()

    def admitted(self, rank: int, incarnation_id: str) -> bool:
        """Whether this incarnation is a member of the current round, or waits for it."""
        return any(
            j is not None and j.incarnation_id == incarnation_id
            for j in (self.members.get(rank), self.pending.get(rank))
        )

    def status(self, rank: int, incarnation_id: str) -> RankStatus:
        waiting = self.pending.get(rank)
        if waiting is not None and waiting.incarnation_id == incarnation_id:
            return RankStatus(
                self.round,
                Phase.WAITING,
                missing=(0,),
                message="waiting for rank 0 of the job to restart: it opens the next round",
            )
        member = self.members.get(rank)
        if member is None or member.incarnation_id != incarnation_id:
            why = self.refusal(rank, incarnation_id) or "join again"
            return RankStatus(self.round, None, message=f"not a member of the current round: {why}")
        if self.phase is Phase.WAITING:
            missing, message = self._waiting()
            return RankStatus(self.round, Phase.WAITING, missing=missing, message=message)
        plan = self.plan
        return RankStatus(
            self.round,
            self.phase,
            plan_version=self.plan_version,
            step=None if plan is None else plan.step,
            assignments={} if plan is None else self._attributed(plan.for_rank(rank)),
        )

    def _attributed(
        self, assignments: Mapping[ItemId, tuple[Fetch, ...]]
    ) -> dict[ItemId, tuple[Fetch, ...]]:
        """``assignments`` with each source's producers: the nodes that held its item's rank
        when the item's step can have been produced."""
        producers = self.holders.producers
        return {
            target: tuple(
                replace(f, producers=producers(f.item.rank, f.item.step)) for f in fetches
            )
            for target, fetches in assignments.items()
        }

    def _waiting(self) -> tuple[tuple[int, ...], str]:
        """The first ``MISSING_SHOWN`` missing ranks and the waiting message.

        Computing them is O(ranks), and every joined rank polls while the others join: at
        4,096 ranks, once per poll was most of a round. So they are recomputed only when the
        joined count moved by 1/64 of the job, or when few ranks are missing (then exactly).
        """
        joined = len(self.members)
        key = self._waiting_key
        nodes = self.config.nodes
        if (
            key is None
            or key[0] != self.round
            or (
                key[1] != joined
                and (nodes - joined <= MISSING_SHOWN or abs(key[1] - joined) >= nodes / 64)
            )
        ):
            missing = missing_ranks(self.config, self.members)
            self._waiting_key = (self.round, joined)
            self._waiting_view = (
                tuple(missing[:MISSING_SHOWN]),
                waiting_message(self.config, missing),
            )
        return self._waiting_view

    def report_restore(
        self,
        rank: int,
        incarnation_id: str,
        round_: int,
        plan_version: int,
        *,
        ready: bool,
        failed: Collection[SourceKey] = (),
        node: str | None = None,
    ) -> None:
        """A rank's outcome for a plan; stale reports (old round or plan) are ignored.

        Raises ``ReportRefused``, changing nothing, when a report of the current plan names
        a source that plan did not give the rank, or is not ready without naming any, or
        comes from another node than the rank's (``node``, ``core.rank_holders``).
        """
        why = self.holders.check(rank, node)
        if why:
            raise ReportRefused(f"restore report refused: {why}")
        member = self.members.get(rank)
        if (
            member is None
            or member.incarnation_id != incarnation_id
            or round_ != self.round
            or plan_version != self.plan_version
            or self.phase is not Phase.FETCH
        ):
            return
        assigned = {
            f.key
            for fetches in ({} if self.plan is None else self.plan.for_rank(rank)).values()
            for f in fetches
        }
        foreign = [k for k in failed if k not in assigned]
        if foreign:
            holder = "the backup" if foreign[0].holder is None else f"rank {foreign[0].holder}"
            raise ReportRefused(
                f"rank {rank} reports {len(foreign)} failed sources that plan {plan_version} "
                f"did not give it, such as {foreign[0].item} from {holder}; report ignored"
            )
        if not ready and not failed:
            raise ReportRefused(f"rank {rank} is not ready but names no failed source; ignored")
        # Its word counts for its own restore only: the copy may serve the others (a
        # corrupt one fails their verification too, and they report it themselves).
        self.exclude.update(SourceKey(k.holder, k.item, rank) for k in failed)
        if not ready:
            # The rank tried every source of an item: plan without the failed copies (an
            # older step, or a fresh start), and every rank works to the new version.
            self._plan()
            return
        self.ready.add(rank)
        if len(self.ready) == self.config.nodes:
            self.phase = Phase.RELEASED
            self.released_incarnations = {r: m.incarnation_id for r, m in self.members.items()}
            self.adopted = set()
            if not self._committing:
                # Ordered to incarnations that are gone (the job restarted mid-upload): the
                # new ones never heard of it. Order again from the restored step, now.
                self.backup_in_flight = None
            self.addresses = {r: m.inventory.address for r, m in self.members.items()}
            self.pin_consumed = self.pinned
            # The restored step is complete everywhere: it is the restorable step.
            self.restorable = None if self.plan is None else self.plan.step
            self.progress.reset(self.restorable)
            self.holders.released(self.restorable)

    # --- steady state --------------------------------------------------------------------------

    def report_progress(
        self,
        rank: int,
        incarnation_id: str,
        progress: Progress,
        *,
        now: float,
        node: str | None = None,
    ) -> ProgressAnswer | None:
        """Fold in a rank's progress; None when the rank is not of the released round."""
        if self.phase is not Phase.RELEASED or not 0 <= rank < self.config.nodes:
            return None
        if self.holders.check(rank, node):
            return None  # another node's rank, adopted or released: the host logs it
        if self.adopting and rank not in self.released_incarnations:
            if not self._adoptable(rank, incarnation_id):
                return None
            self.released_incarnations[rank] = incarnation_id
            self.adopted.add(rank)
            self.holders.bind(rank, node, running=True)
        if self.released_incarnations.get(rank) != incarnation_id:
            return None
        if node is not None:
            # A rank held under a shared certificate whose running agent now reports with one
            # naming its node (its daemon moved to per-node certificates): that node holds
            # the rank, and its steps are produced under that name from now on.
            self.holders.bind(rank, node, running=True)
        if progress.address:
            self.addresses[rank] = progress.address
        book = self.progress
        book.report(
            rank,
            replicated=progress.replicated_step,
            uploaded=progress.uploaded_step,
            held=progress.held,
            replicating=progress.replicating_step,
        )
        newest = book.restorable()
        if newest is not None and (self.restorable is None or newest > self.restorable):
            self.restorable = newest
        restorable = self.restorable
        if (
            self.backup_in_flight is None
            and restorable is not None
            and now >= self._order_after
            and backup_due(self.config.backup_interval, restorable, self.last_backup, now)
        ):
            self.backup_in_flight = restorable
            book.track_upload(restorable, self.uploaders)
        order = self.backup_in_flight if rank in self.uploaders else None
        if order is not None and book.has_uploaded(rank, order):
            order = None  # this rank is done with it; the others are still uploading
        keep = frozenset(s for s in book.wanted() if restorable is None or s > restorable)
        addresses = pick_addresses(self.addresses, progress.address_ranks)
        bound = self.holders.nodes
        return ProgressAnswer(
            restorable,
            order,
            addresses,
            keep,
            report_every(self.config.nodes),
            self.last_backup,
            {r: bound[r] for r in addresses if r in bound},
        )

    def _adoptable(self, rank: int, incarnation_id: str) -> bool:
        """Whether a restarted coordinator may take this report's incarnation for the one
        running ``rank``: never rank 0's other than the one its daemon names, nor one that
        joined (it is restoring; an older agent reports a step it ingests meanwhile)."""
        if rank == 0 and self.rank0_incarnation not in (None, incarnation_id):
            return False
        return not self.admitted(rank, incarnation_id)

    def take_commit(self) -> int | None:
        """The ordered backup whose COMMIT the host must write now: once every uploader
        reported it uploaded, and only once. The coordinator writes it, not the uploaders:
        each uploader checking every other's manifest cost O(N^2) reads per backup."""
        step = self.backup_in_flight
        if step is None or self._committing or not self.progress.all_uploaded():
            return None
        self._committing = True
        return step

    def backup_committed(self, step: int, at: float) -> None:
        """The COMMIT of ``step`` was written at ``at`` (or found written by someone else)."""
        if step == self.backup_in_flight:
            self.backup_in_flight, self._committing = None, False
        self.note_committed_backup(step, at)

    def backup_not_committed(self, step: int, now: float) -> None:
        """The COMMIT of ``step`` could not be written: order a backup again later."""
        if step == self.backup_in_flight:
            self.backup_in_flight, self._committing = None, False
            self._order_after = now + COMMIT_RETRY_SECONDS

    def note_committed_backup(self, step: int, at: float) -> None:
        """A committed backup found in the store (at start): the interval counts from it."""
        if self.last_backup is None or step > self.last_backup.step:
            self.last_backup = LastBackup(step, at)


def pick_addresses(addresses: Mapping[int, str], ranks: Collection[int] | None) -> dict[int, str]:
    """The addresses of ``ranks`` that are known (None: all of them), as a new dict."""
    if ranks is None:
        return dict(addresses)
    return {r: addresses[r] for r in ranks if r in addresses}


def _differing_keys(theirs: str, ours: str) -> str:
    """The names (never the values) of the cluster-wide keys two views disagree on."""
    try:
        a, b = json.loads(theirs), json.loads(ours)
    except (ValueError, RecursionError):
        return "not a view of this version"
    if not isinstance(a, dict) or not isinstance(b, dict):
        return "not a view of this version"
    keys = sorted(str(k) for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(keys)[:200]
