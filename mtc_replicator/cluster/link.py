"""How an agent reaches its job's coordinator: the calls, their types and their exceptions,
over gRPC or in process. I/O module (the in-process link calls ``cluster.coordinators``).

Every job restores through the same round (``cluster.rounds``) and reports progress the
same way (``cluster.membership``); only the link to the coordinator differs:

- a cluster job (``nodes > 1``) finds rank 0's coordinator in the registry and calls it
  over gRPC (``cluster.coordinator_client``: ``RegistryFinder`` → ``CoordinatorClient``);
- a one-node job calls the coordinator its own daemon hosts, in process, with no registry
  and no port (``LocalFinder`` → ``LocalCoordinator``).

Both take and answer in the types of ``cluster.messages`` and ``core``, raise the
exceptions below and check who answers (``IdentityChecked``), so a replaced coordinator is
noticed the same way. What an agent does about each exception:

- ``NoCoordinator`` (and ``WrongCoordinator``): look the registry up again, with backoff;
  ``UntrustedCoordinator`` (the address failed mutual TLS) also goes to
  ``replicator.errors`` at once: the registry is not an identity;
- ``MustRejoin`` (``CoordinatorChanged``, ``NotAMember``): join again, then poll;
- ``JoinRejected``: this rank's ``replicator.yaml`` can never join; say so, do not retry;
- ``CoordinatorError``: anything else; retry with backoff.

The round, the membership and this module never import the gRPC client (a contract in
pyproject.toml): they name its exceptions here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Protocol

from mtc_replicator.cluster.coordinators import (
    BackupsUnavailable,
    Coordinators,
    ForeignOwner,
    NotInReleasedRound,
)
from mtc_replicator.cluster.hosting import NotHosted
from mtc_replicator.cluster.messages import (
    BadMessage,
    Identity,
    Joined,
    RestoreReport,
    RoundState,
    long_poll_wait,
)
from mtc_replicator.cluster.registry import COORDINATOR_ID_RE
from mtc_replicator.core.coordination import (
    JoinRejected,
    Phase,
    ProgressAnswer,
    RankStatus,
    ReportRefused,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import NodeInventory

LOCAL_ADDRESS = "in-process"
"""What a one-node job's link calls its coordinator's address (in logs)."""


# --- errors ----------------------------------------------------------------------------------


class CoordinatorError(Exception):
    """A call to the coordinator failed (the agent's side)."""


class NoCoordinator(CoordinatorError):
    """No coordinator of the job answers there: look the registry up again (with backoff)."""


class WrongCoordinator(NoCoordinator):
    """The address answers for another job: the registry entry is stale."""


class UntrustedCoordinator(NoCoordinator):
    """The address failed the TLS handshake (its certificate does not chain to our CA, or
    it does not speak TLS): the registry is not an identity, so it is never joined."""


class MustRejoin(CoordinatorError):
    """This incarnation is not (or no longer) a member of the coordinator's round: join again."""


class NotAMember(MustRejoin):
    """Progress from an incarnation that is not of the released round."""


class CoordinatorChanged(MustRejoin):
    """The coordinator restarted (another id answers) and lost the joins: join again.

    Raised once per change; the link expects the new id afterwards.
    """

    def __init__(self, message: str, old_id: str, new_id: str) -> None:
        super().__init__(message)
        self.old_id = old_id
        self.new_id = new_id


class IdentityChecked:
    """What every link to a coordinator shares: the checks on who answered.

    An answer must name ``job``; the first one fixes the coordinator's id, and a later
    answer with another id raises ``CoordinatorChanged`` once (its state is gone: join
    again), the new id expected from then on.
    """

    job: str
    address: str
    """Where the coordinator answers (for messages)."""
    coordinator_id: str | None
    """The id that answered first; None before any answer."""

    def _check_answer(self, answered_job: str, answered_id: str, method: str) -> None:
        if answered_job != self.job:
            raise WrongCoordinator(
                f"{method} at {self.address}: a coordinator of job {answered_job!r:.80} "
                f"answered, not one of job {self.job}"
            )
        if not COORDINATOR_ID_RE.fullmatch(answered_id):
            raise CoordinatorError(
                f"{method} at {self.address}: bad coordinator id {answered_id!r:.80}"
            )
        old, self.coordinator_id = self.coordinator_id, answered_id
        if old is not None and old != answered_id:
            raise CoordinatorChanged(
                f"the coordinator of job {self.job} at {self.address} restarted "
                f"(id {old} -> {answered_id}); join again",
                old,
                answered_id,
            )


# --- the link --------------------------------------------------------------------------------


class CoordinatorLink(Protocol):
    """What an agent calls its coordinator through: ``CoordinatorClient`` over gRPC or
    ``LocalCoordinator`` in process, with the same calls, answers and exceptions (the
    module docstring says what an agent does about each). Both check who answers
    (``IdentityChecked``): a replaced coordinator raises ``CoordinatorChanged``.
    """

    address: str
    """Where the coordinator answers (for messages)."""

    async def join(
        self,
        rank: int,
        incarnation_id: str,
        cluster_view: str,
        address: str,
        items: Mapping[ItemId, str],
        *,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> Joined:
        """Join (or re-join) the current round: the round the join counts for and, with
        ``wait_seconds`` (at most 30), the round as this rank sees it once it is no longer
        waiting for joins or the wait is over (with the addresses of ``address_ranks``, as
        in ``round_status``). A coordinator that predates the long poll answers at once
        without the state: the caller polls ``round_status`` then."""
        ...

    async def round_status(
        self,
        rank: int,
        incarnation_id: str,
        round_: int,
        *,
        seen: RoundState | None = None,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState:
        """The round as ``rank`` should see it.

        With ``wait_seconds`` (at most 30) this is a long poll: it answers once the round,
        state or plan version differs from ``seen`` (the last answer for ``round_``; None
        when there was none, which answers at once), or when the wait is over. The answer
        carries the addresses of ``address_ranks`` (None: of every member).
        """
        ...

    async def report_restore(
        self,
        rank: int,
        incarnation_id: str,
        report: RestoreReport,
        *,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState | None:
        """Report the outcome of plan ``report.plan_version`` of ``report.round``.

        With ``wait_seconds`` (at most 30) the answer waits until the round moved past
        this report (released, re-planned, a new round) or the wait is over, and returns
        the round as this rank sees it then; None without a wait, or from a coordinator
        that predates the long poll (the caller polls ``round_status`` then)."""
        ...

    async def report_progress(
        self, rank: int, incarnation_id: str, progress: Progress
    ) -> ProgressAnswer:
        """Steady state: fold in this rank's progress; the answer may order a backup.

        Raises ``NotAMember`` when this incarnation is not of the released round.
        """
        ...

    async def close(self) -> None:
        """Release what the link holds (a channel)."""
        ...


class CoordinatorFinder(Protocol):
    """Where a job's coordinator is, as a link to call it."""

    async def find(self, job: str, *, timeout: float) -> CoordinatorLink:
        """A link to ``job``'s coordinator; ``NoCoordinator`` when none is there in time."""
        ...

    def open(self, job: str, address: str) -> CoordinatorLink:
        """A link to the coordinator that released this agent's round, at ``address``."""
        ...


class LocalFinder:
    """A one-node job's coordinator: hosted by this daemon, called in process."""

    def __init__(self, coordinators: Coordinators, *, owner: str = UNOWNED) -> None:
        self.coordinators = coordinators
        self.owner = owner

    async def find(self, job: str, *, timeout: float) -> CoordinatorLink:
        if self.coordinators.host.get(job) is None:
            raise NoCoordinator(f"this daemon hosts no coordinator for job {job}")
        return LocalCoordinator(self.coordinators, job, owner=self.owner)

    def open(self, job: str, address: str) -> CoordinatorLink:
        return LocalCoordinator(self.coordinators, job, owner=self.owner)


class LocalCoordinator(IdentityChecked):
    """``CoordinatorLink`` to a coordinator in this process: same calls, no wire (each
    call's contract is on ``CoordinatorLink``).

    The inputs are this daemon's own, so the wire's hostile-input checks have nothing to
    check; the answers go through the same identity check as a gRPC client's.
    """

    def __init__(self, coordinators: Coordinators, job: str, *, owner: str = UNOWNED) -> None:
        self.coordinators = coordinators
        self.job = job
        self.owner = owner
        self.address = LOCAL_ADDRESS
        self.coordinator_id: str | None = None

    def _check(self, identity: Identity, method: str) -> None:
        self._check_answer(identity.job, identity.coordinator_id, method)

    def _error(self, exc: Exception, method: str) -> Exception:
        """The same exceptions a gRPC client raises for the same statuses."""
        message = f"{method} of job {self.job} ({LOCAL_ADDRESS}): {exc}"
        if isinstance(exc, NotHosted):
            return NoCoordinator(message)
        if isinstance(exc, NotInReleasedRound):
            return NotAMember(message)
        return CoordinatorError(message)

    async def join(
        self,
        rank: int,
        incarnation_id: str,
        cluster_view: str,
        address: str,
        items: Mapping[ItemId, str],
        *,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> Joined:
        inventory = NodeInventory(rank, address, dict(items))
        try:
            identity, round_ = await self.coordinators.join(
                self.job, incarnation_id, cluster_view, inventory, self.owner
            )
            self._check(identity, "Join")
            wait = long_poll_wait(wait_seconds)
            if not wait:
                return Joined(round_)
            identity, status, addresses = await self.coordinators.after_join(
                self.job, rank, incarnation_id, wait, address_ranks=address_ranks
            )
        except ForeignOwner as exc:
            raise JoinRejected(str(exc)) from None
        except (NotHosted, BackupsUnavailable, BadMessage) as exc:
            raise self._error(exc, "Join") from None
        self._check(identity, "Join")
        return Joined(round_, round_state_of(status, addresses))

    async def round_status(
        self,
        rank: int,
        incarnation_id: str,
        round_: int,
        *,
        seen: RoundState | None = None,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState:
        wait = long_poll_wait(wait_seconds)
        key = seen.key if seen is not None and seen.round == round_ else None
        try:
            identity, status, addresses = await self.coordinators.round_status(
                self.job, rank, incarnation_id, key, wait, address_ranks=address_ranks
            )
        except (NotHosted, BadMessage) as exc:
            raise self._error(exc, "RoundStatus") from None
        self._check(identity, "RoundStatus")
        return round_state_of(status, addresses)

    async def report_restore(
        self,
        rank: int,
        incarnation_id: str,
        report: RestoreReport,
        *,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState | None:
        reported = (report.round, report.plan_version)
        try:
            identity = self.coordinators.report_restore(
                self.job,
                rank,
                incarnation_id,
                report.round,
                report.plan_version,
                ready=report.ready,
                failed=[f.fetch.key for f in report.failures],
            )
            self._check(identity, "ReportRestore")
            wait = long_poll_wait(wait_seconds)
            if not wait:
                return None
            identity, status, found = await self.coordinators.after_report(
                self.job, rank, incarnation_id, reported, wait, address_ranks=address_ranks
            )
        except (NotHosted, BadMessage, ReportRefused) as exc:
            raise self._error(exc, "ReportRestore") from None
        self._check(identity, "ReportRestore")
        return round_state_of(status, found)

    async def report_progress(
        self, rank: int, incarnation_id: str, progress: Progress
    ) -> ProgressAnswer:
        try:
            identity, answer = await self.coordinators.report_progress(
                self.job, rank, incarnation_id, progress
            )
        except (NotHosted, NotInReleasedRound, BackupsUnavailable, BadMessage) as exc:
            raise self._error(exc, "ReportProgress") from None
        self._check(identity, "ReportProgress")
        return answer

    async def close(self) -> None:
        """Nothing to release: no channel."""


def round_state_of(status: RankStatus, addresses: Mapping[int, str]) -> RoundState:
    """``status`` as a gRPC client would have decoded it (addresses only once planned)."""
    planned = status.phase in (Phase.FETCH, Phase.RELEASED)
    return RoundState(
        round=status.round,
        phase=status.phase,
        plan_version=status.plan_version,
        step=status.step if planned else None,
        assignments={t: list(f) for t, f in status.assignments.items()} if planned else {},
        missing=status.missing,
        message=status.message,
        addresses=dict(addresses) if planned else {},
    )
