"""How an agent reaches its job's coordinator: over gRPC, or in process. I/O module.

Every job restores through the same round (``cluster.rounds``) and reports progress the
same way (``cluster.membership``); only the link to the coordinator differs:

- a cluster job (``nodes > 1``) finds rank 0's coordinator in the registry and calls it
  over gRPC (``RegistryFinder`` → ``cluster.coordinator_client.CoordinatorClient``);
- a one-node job calls the coordinator its own daemon hosts, in process, with no registry
  and no port (``LocalFinder`` → ``LocalCoordinator``).

Both links answer in our own types and raise the same exceptions (see
``cluster.coordinator_client``), and both check who answers, so a replaced coordinator is noticed
the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from mtc_replicator.cluster.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    IdentityChecked,
    NoCoordinator,
    NotAMember,
    find_coordinator,
)
from mtc_replicator.cluster.coordinators import (
    BackupsUnavailable,
    Coordinators,
    ForeignOwner,
    NotInReleasedRound,
)
from mtc_replicator.cluster.hosting import NotHosted
from mtc_replicator.cluster.messages import (
    BadMessage,
    FailedFetch,
    Identity,
    Joined,
    Progress,
    RoundState,
    long_poll_wait,
)
from mtc_replicator.cluster.registry import Registry
from mtc_replicator.core.coordination import (
    JoinRejected,
    Phase,
    ProgressAnswer,
    RankStatus,
    ReportRefused,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.restore_plan import NodeInventory
from mtc_replicator.transport.tls import TlsMaterial

LOCAL_ADDRESS = "in-process"
"""What a one-node job's link calls its coordinator's address (in logs)."""


class CoordinatorLink(Protocol):
    """What an agent calls its coordinator through: ``CoordinatorClient`` over gRPC or
    ``LocalCoordinator`` in process, with the same calls, answers and exceptions
    (``cluster.coordinator_client``'s docstring says what an agent does about each). Both check who
    answers (``IdentityChecked``): a replaced coordinator raises ``CoordinatorChanged``.
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
        round_: int,
        plan_version: int,
        *,
        ready: bool,
        failures: Sequence[FailedFetch] = (),
        addresses: Mapping[int, str] | None = None,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState | None:
        """Report the outcome of plan ``plan_version`` of ``round_``: ``ready`` when every
        assigned item is present and verified; ``failures`` are the sources that failed
        (``addresses``, the status's, names PEER holders in the coordinator's log).

        With ``wait_seconds`` (at most 30) the answer waits until the round moved past
        this report (released, re-planned, a new round) or the wait is over, and returns
        the round as this rank sees it then; None without a wait, or from a coordinator
        that predates the long poll (the caller polls ``round_status`` then)."""
        ...

    async def report_progress(
        self,
        rank: int,
        incarnation_id: str,
        *,
        replicated_step: int | None,
        uploaded_step: int | None = None,
        address: str = "",
        held: Collection[int] | None = None,
        replicating_step: int | None = None,
        address_ranks: Collection[int] | None = None,
    ) -> ProgressAnswer:
        """Steady state: fold in this rank's progress; the answer may order a backup.

        ``held`` promises the steps this rank keeps until the answer (None: all of them);
        the answer carries the addresses of ``address_ranks`` (None: of every rank).
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


class RegistryFinder:
    """A cluster job's coordinator: rank 0's daemon, found in the registry, over gRPC
    (mutual TLS with ``tls``: an entry whose address fails the handshake is never joined)."""

    def __init__(
        self, registry: Registry, tls: TlsMaterial | None = None, *, owner: str = UNOWNED
    ) -> None:
        self.registry = registry
        self.tls = tls
        self.owner = owner
        """This node's owner, which every join carries."""

    async def find(self, job: str, *, timeout: float) -> CoordinatorLink:
        entry = await find_coordinator(self.registry, job, timeout=timeout)
        return CoordinatorClient.for_entry(entry, tls=self.tls, owner=self.owner)

    def open(self, job: str, address: str) -> CoordinatorLink:
        return CoordinatorClient(job, address, tls=self.tls, owner=self.owner)


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
        round_: int,
        plan_version: int,
        *,
        ready: bool,
        failures: Sequence[FailedFetch] = (),
        addresses: Mapping[int, str] | None = None,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState | None:
        try:
            identity = self.coordinators.report_restore(
                self.job,
                rank,
                incarnation_id,
                round_,
                plan_version,
                ready=ready,
                failed=[f.fetch.key for f in failures],
            )
            self._check(identity, "ReportRestore")
            wait = long_poll_wait(wait_seconds)
            if not wait:
                return None
            identity, status, found = await self.coordinators.after_report(
                self.job, rank, incarnation_id, (round_, plan_version), wait,
                address_ranks=address_ranks,
            )  # fmt: skip
        except (NotHosted, BadMessage, ReportRefused) as exc:
            raise self._error(exc, "ReportRestore") from None
        self._check(identity, "ReportRestore")
        return round_state_of(status, found)

    async def report_progress(
        self,
        rank: int,
        incarnation_id: str,
        *,
        replicated_step: int | None,
        uploaded_step: int | None = None,
        address: str = "",
        held: Collection[int] | None = None,
        replicating_step: int | None = None,
        address_ranks: Collection[int] | None = None,
    ) -> ProgressAnswer:
        progress = Progress(
            replicated_step,
            uploaded_step,
            address,
            None if held is None else frozenset(held),
            replicating_step,
            None if address_ranks is None else frozenset(address_ranks),
        )
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
