"""The agent's side of a restore round, for every job. I/O: the coordinator link and the store.

Find the job's coordinator (in the registry for a cluster job, in this daemon for a
one-node job: ``cluster.link``), join with this node's inventory, wait until
every rank joined, obtain and verify the planned items in the order given (local, peer,
equivalent, backup; each fetched by ``cluster.sources``, whose own failure types alone
count as a source lost), report, and return once the coordinator released the round: only
then may markers appear, and every rank's markers name the same step. While waiting, the
agent says in ``replicator.errors`` what it waits for, well before the clients' 300 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mtc_replicator.cluster.link import (
    CoordinatorError,
    CoordinatorFinder,
    CoordinatorLink,
    MustRejoin,
    NoCoordinator,
    UntrustedCoordinator,
)
from mtc_replicator.cluster.messages import (
    FailedFetch,
    RestoreReport,
    RoundState,
    cluster_view_json,
)
from mtc_replicator.cluster.sources import ItemSources, LocalCopyGone, SourceUnavailable
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.coordination import JoinRejected, Phase
from mtc_replicator.core.layout import replication_targets
from mtc_replicator.core.manifest import Cancelled, CorruptItem, ItemId
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.core.retry import Backoff
from mtc_replicator.core.timeline import RestorePhase, RestoreTimeline
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.transport.obtaining import Obtain, Obtaining

log = logging.getLogger(__name__)

POLL_SECONDS = 10.0
REFUSAL_SAID_EVERY = 60.0
"""Seconds between log lines about joins the coordinator does not admit."""


class RoundFailed(Exception):
    """The round can never complete for this rank (its config is rejected): fatal."""


@dataclass(frozen=True)
class RoundOutcome:
    """A released round: the step (None: fresh start) and what each target is stored as."""

    step: int | None
    source: str | None
    stored_as: Mapping[ItemId, ItemId]
    """Target item -> the item holding its data here (itself, or a data-parallel equivalent)."""
    addresses: Mapping[int, str]
    coordinator: str
    unavailable: tuple[str, ...] = ()
    """Sources this rank could not use for a reason other than corrupt bytes (a full disk,
    an unreachable store or peer): with a fresh start, the job must not start from scratch."""


@dataclass(frozen=True)
class JobRank:
    """This rank of its job as its restore round and its membership both see it."""

    config: JobConfig
    incarnation_id: str
    store: LocalStore
    finder: CoordinatorFinder
    advertise: str
    report_after: float = 60.0
    """Seconds of waiting before ``replicator.errors`` says what for (clients give up at 300)."""
    obtaining: Obtaining | None = None
    """Where this node's peer service learns which items the round still obtains (for
    pending pulls of other ranks); None: nobody pulls from this node during a round."""


@dataclass
class RoundContext:
    """What a participant needs from its incarnation."""

    rank: JobRank
    sources: ItemSources
    """Where each planned item is fetched from (``cluster.sources``)."""
    error: Callable[[str, int | None], None]
    timeline: RestoreTimeline | None = None
    """Where the round marks its phases (join, plan, each fetch, release); None: nowhere."""


class RoundParticipant:
    """Takes this rank through one restore round."""

    def __init__(self, ctx: RoundContext) -> None:
        self.ctx = ctx
        self.config = ctx.rank.config
        self._started = time.monotonic()
        self._last_said = ""
        self._unavailable: list[str] = []
        self._last_untrusted = ""
        self._obtained: dict[ItemId, Fetch] = {}
        """The source each target came from (a one-node job's local and backup copies are
        the same item, so the store alone cannot tell which was used)."""
        self._announced: set[ItemId] = set()
        """Items this round told the peer service about (``ctx.obtaining``)."""
        self._admitted = False
        """The last join was a member of a round (or waited for one) before it ended."""
        self._refusal = ""
        self._refusals = 0
        self._refusal_said = 0.0

    def _mark(self, phase: RestorePhase, detail: str = "") -> None:
        """The round is in ``phase`` from now (a phase already in continues)."""
        timeline = self.ctx.timeline
        if timeline is not None and (detail or timeline.phase is not phase):
            timeline.enter(phase, detail)

    def _say_waiting(self, message: str) -> None:
        """Tell the workload what we wait for, once the wait got long, once per change."""
        if (
            time.monotonic() - self._started < self.ctx.rank.report_after
            or message == self._last_said
        ):
            return
        self._last_said = message
        self.ctx.error(message, None)

    def _say_untrusted(self, exc: UntrustedCoordinator) -> None:
        # Said at once, not after report_after: someone may be impersonating rank 0.
        if str(exc) != self._last_untrusted:
            self._last_untrusted = str(exc)
            self.ctx.error(str(exc), None)

    def _inventory(self) -> dict[ItemId, str]:
        return {i: m.digest for i, m in self.ctx.rank.store.manifests(self.config.job_name).items()}

    async def run(self) -> RoundOutcome:
        try:
            return await self._run()
        finally:
            # Released, failed or cancelled: pulls of what was still coming go elsewhere.
            if self.ctx.rank.obtaining is not None:
                self.ctx.rank.obtaining.done(self._announced)

    async def _run(self) -> RoundOutcome:
        backoff = Backoff()
        job = self.config.job_name
        while True:
            self._mark(RestorePhase.JOIN)
            try:
                client = await self.ctx.rank.finder.find(job, timeout=POLL_SECONDS)
            except UntrustedCoordinator as exc:
                self._say_untrusted(exc)
                await asyncio.sleep(backoff.next())
                continue
            except NoCoordinator as exc:
                self._say_waiting(f"no coordinator for job {job} yet ({exc}); rank 0 hosts it")
                await asyncio.sleep(backoff.next())
                continue
            try:
                outcome = await self._member(client)
                if outcome is not None:
                    return outcome
                if self._admitted:
                    backoff.reset()  # a member until the round moved on: join the next one
                else:
                    await self._refused(backoff.next())
            except JoinRejected as exc:
                raise RoundFailed(str(exc)) from None
            except MustRejoin as exc:
                log.info("rejoining the round of job %s: %s", job, exc, extra={"job": job})
                if not self._admitted:
                    await asyncio.sleep(backoff.next())  # told so again before a round
            except UntrustedCoordinator as exc:
                self._say_untrusted(exc)
                await asyncio.sleep(backoff.next())
            except CoordinatorError as exc:
                self._say_waiting(f"cannot reach the coordinator of job {job}: {exc}")
                await asyncio.sleep(backoff.next())
            finally:
                await client.close()

    async def _member(self, client: CoordinatorLink) -> RoundOutcome | None:
        """One membership: join, follow the round; None means join again."""
        rank, inc = self.config.node_rank, self.ctx.rank.incarnation_id
        # Only the addresses this rank pushes to: PEER sources carry their own, and every
        # member's would make a round cost the coordinator N answers of N addresses.
        targets = replication_targets(self.config)
        # The join and the report long-poll (a coordinator that predates that answers at
        # once, without the round's state, and the loop polls instead): two calls a round
        # per rank instead of five, which is most of a round's cost at thousands of ranks.
        # The call's own work is milliseconds; its time is the wait for the plan.
        self._mark(RestorePhase.PLAN)
        joined = await client.join(
            rank,
            inc,
            cluster_view_json(self.config),
            self.ctx.rank.advertise,
            self._inventory(),
            wait_seconds=self._wait(),
            address_ranks=targets,
        )
        round_, news = joined.round, joined.state
        state: RoundState | None = None
        done_version = -1
        self._admitted = False
        while True:
            state = news or await client.round_status(
                rank, inc, round_, seen=state, wait_seconds=self._wait(), address_ranks=targets
            )
            news = None
            round_ = state.round
            if state.phase is None:
                self._refusal = state.message
                return None
            self._admitted = True
            if state.phase is Phase.WAITING:
                self._mark(RestorePhase.PLAN)
                self._say_waiting(state.message)
            elif state.phase is Phase.FETCH and state.plan_version != done_version:
                ready, failures = await self._obtain(state)
                self._mark(RestorePhase.RELEASE)
                report = RestoreReport(
                    state.round, state.plan_version, ready, tuple(failures), state.addresses
                )
                news = await client.report_restore(
                    rank, inc, report, wait_seconds=self._wait(), address_ranks=targets
                )
                done_version = state.plan_version
            elif state.phase is Phase.RELEASED:
                return self._outcome(state, client.address)

    async def _refused(self, wait: float) -> None:
        """The join was not admitted: wait ``wait`` before the next, and say why, once a
        minute with a count (a refusal that lasts is a bug or a stale agent: never a spin)."""
        self._refusals += 1
        now = time.monotonic()
        if now - self._refusal_said >= REFUSAL_SAID_EVERY:
            log.warning(
                "join of job %s not admitted %d times (%s); next try in %.1fs",
                self.config.job_name,
                self._refusals,
                self._refusal or "no reason given",
                wait,
                extra={"job": self.config.job_name},
            )
            self._refusal_said = now
        self._say_waiting(
            f"the coordinator of job {self.config.job_name} does not admit this "
            f"rank's join ({self._refusal or 'no reason given'}); retrying"
        )
        await asyncio.sleep(wait)

    def _wait(self) -> float:
        """A long poll's wait: short enough to say what we wait for once ``report_after``
        has passed."""
        report_in = self._started + self.ctx.rank.report_after - time.monotonic()
        return POLL_SECONDS if report_in <= 0 else min(POLL_SECONDS, report_in + 0.05)

    async def _obtain(self, state: RoundState) -> tuple[bool, list[FailedFetch]]:
        """Make every assigned item present and verified; False when one has no source left."""
        failures: list[FailedFetch] = []
        ready = True
        self._announce(state.assignments)
        for target, fetches in state.assignments.items():
            if not await self._obtain_one(target, fetches, state.addresses, failures):
                ready = False
        return ready, failures

    async def _obtain_one(
        self,
        target: ItemId,
        fetches: list[Fetch],
        addresses: Mapping[int, str],
        failures: list[FailedFetch],
    ) -> bool:
        items = {f.item for f in fetches}
        for index, f in enumerate(fetches):
            # Others may wait for this item while this rank tries its first choice or a
            # source of its own; not while it waits on someone else's (a relay's
            # fallback), so waits never go round in a circle (core.restore_plan._fan_out).
            self._tell(items, Obtain.IN_PROGRESS if index == 0 or not f.pending else Obtain.GAVE_UP)
            try:
                self._mark_fetch(f)
                await self.ctx.sources.fetch(f, addresses, last=index == len(fetches) - 1)
            except CorruptItem as exc:
                self.ctx.error(
                    f"step {f.item.step}: {f.source.value} copy of {f.item} is corrupt "
                    f"({exc}); not used",
                    f.item.step,
                )
                failures.append(FailedFetch(f, True, str(exc)))
                continue
            except LocalCopyGone as exc:
                # Neither corrupt nor coming back: another source or an older step, and a
                # fresh start is not held up for it (``RoundOutcome.unavailable``).
                self.ctx.error(f"step {f.item.step}: {exc}; not used", f.item.step)
                failures.append(FailedFetch(f, False, str(exc)))
                continue
            except SourceUnavailable as exc:
                message = (
                    f"step {f.item.step}: cannot use the {f.source.value} copy of {f.item}: {exc}"
                )
                self.ctx.error(message, f.item.step)
                failures.append(FailedFetch(f, False, str(exc)))
                self._unavailable.append(message)
                continue
            except Cancelled:
                raise
            log.info(
                "round: %s ready from %s%s (%s)",
                target,
                f.source.value,
                f" {f.holder}" if f.holder is not None and f.source is Source.PEER else "",
                f.item,
            )
            self._obtained[target] = f
            self._forget(items)
            return True
        self._tell(items, Obtain.GAVE_UP)
        return False

    def _mark_fetch(self, f: Fetch) -> None:
        """The phase fetching ``f`` is in: the local verify of a copy held here, else its
        source's (a LOCAL fetch of a copy gone fails at once, in no phase)."""
        if self.ctx.sources.holds(f):
            self._mark(RestorePhase.LOCAL, str(f.item))
        elif f.source is Source.PEER:
            self._mark(RestorePhase.PEER, f"{f.item} from rank {f.holder}")
        elif f.source is Source.BACKUP:
            self._mark(RestorePhase.BACKUP, str(f.item))

    def _announce(self, assignments: Mapping[ItemId, list[Fetch]]) -> None:
        """Say, before fetching anything, every item this plan may bring here: a pending
        pull of one that arrives first then waits rather than failing."""
        if self.ctx.rank.obtaining is None:
            return
        self.ctx.rank.obtaining.done(self._announced)  # an older plan's
        self._announced = {
            f.item
            for fetches in assignments.values()
            for f in fetches
            if f.source is not Source.LOCAL and self.ctx.rank.store.get(f.item) is None
        }
        self.ctx.rank.obtaining.mark(self._announced, Obtain.IN_PROGRESS)

    def _tell(self, items: set[ItemId], state: Obtain) -> None:
        if self.ctx.rank.obtaining is not None:
            self.ctx.rank.obtaining.mark(items & self._announced, state)

    def _forget(self, items: set[ItemId]) -> None:
        if self.ctx.rank.obtaining is not None:
            self.ctx.rank.obtaining.done(items & self._announced)

    def _outcome(self, state: RoundState, coordinator: str) -> RoundOutcome:
        stored_as: dict[ItemId, ItemId] = {}
        sources: set[Source] = set()
        for target, fetches in state.assignments.items():
            used = self._obtained.get(target)
            tried_first = [used] if used is not None and used in fetches else []
            for f in [*tried_first, *fetches]:
                held = self.ctx.rank.store.get(f.item)
                if held is not None and held.digest == f.digest:
                    stored_as[target] = f.item
                    sources.add(f.origin)  # a relayed download restored from the backup
                    break
            else:
                raise StoreError(f"{target}: released, but no verified copy is here any more")
        order = list(Source)
        source = max(sources, key=order.index).value if sources else None
        return RoundOutcome(
            state.step,
            source,
            stored_as,
            dict(state.addresses),
            coordinator,
            tuple(self._unavailable),
        )
