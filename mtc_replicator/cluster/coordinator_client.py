"""The job coordinator's client side: calling it over gRPC and finding it. I/O module (gRPC,
registry).

``CoordinatorClient`` is a ``cluster.link.CoordinatorLink`` over gRPC: an agent joins, polls
the round, reports its restore and its progress through it, in our own types. It checks the
coordinator's identity in every answer, so a stale registry entry or a restarted
coordinator is noticed at the next call, and it turns gRPC statuses into the link's
exceptions (``cluster.link``, which says what an agent does about each) in one place
(``_call_error``).

``find_coordinator`` reads the registry with jittered backoff (docs/architecture.md,
"Rounds and incarnations"); ``RegistryFinder`` is a cluster job's ``CoordinatorFinder``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import grpc
import grpc.aio

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc
from mtc_replicator.cluster.link import (
    CoordinatorError,
    CoordinatorLink,
    IdentityChecked,
    NoCoordinator,
    NotAMember,
    UntrustedCoordinator,
)
from mtc_replicator.cluster.messages import (
    MAX_HELD_STEPS,
    BadMessage,
    Joined,
    RestoreReport,
    RoundState,
    address_map,
    failure_message,
    held_items,
    long_poll_wait,
    node_map,
    round_state,
)
from mtc_replicator.cluster.registry import RefusedEntry, Registry, RegistryEntry
from mtc_replicator.core.coordination import (
    MAX_REPORT_EVERY,
    MIN_REPORT_EVERY,
    JoinRejected,
    ProgressAnswer,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.policy import LastBackup
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.retry import Backoff
from mtc_replicator.storage.objectstore import ObjectStoreError
from mtc_replicator.transport.tls import TlsMaterial, open_channel, refused_certificate

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 << 20
"""A join of ``MAX_ITEMS`` items is about 7 MB; the default receive limit is 4 MiB."""
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A coordinator node lost without a FIN is noticed during a long poll in ~40 s.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
CALL_TIMEOUT = 10.0
"""Deadline of every call, on top of a long poll's wait."""


# --- the client ------------------------------------------------------------------------------


class CoordinatorClient(IdentityChecked):
    """The agent's calls to job ``job``'s coordinator at ``address``, in our own types: a
    ``cluster.link.CoordinatorLink`` over gRPC (each call's contract is there).

    Every answer must name ``job``; the first one fixes the coordinator's id, and a later
    answer with another id raises ``CoordinatorChanged`` (its state is gone: join again).
    gRPC errors become ``NoCoordinator``, ``JoinRejected``, ``NotAMember`` or
    ``CoordinatorError`` (see the module docstring). Create it in the event loop that uses it.
    """

    def __init__(
        self,
        job: str,
        address: str,
        *,
        timeout: float = CALL_TIMEOUT,
        tls: TlsMaterial | None = None,
        owner: str = UNOWNED,
    ) -> None:
        self.job = job
        self.address = address
        self.timeout = timeout
        self.owner = owner
        """This node's owner, sent with every join (``core.ownership``)."""
        self.coordinator_id: str | None = None
        """The id that answered first; None before any answer."""
        self._channel = open_channel(address, CHANNEL_OPTIONS, tls)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    @classmethod
    def for_entry(
        cls,
        entry: RegistryEntry,
        *,
        timeout: float = CALL_TIMEOUT,
        tls: TlsMaterial | None = None,
        owner: str = UNOWNED,
    ) -> CoordinatorClient:
        return cls(entry.job, entry.address, timeout=timeout, tls=tls, owner=owner)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _call_error(self, exc: grpc.aio.AioRpcError, method: str) -> Exception:
        """The one place that turns the coordinator's gRPC status into our exceptions."""
        code = exc.code()
        details = exc.details() or ""
        message = f"{method} of job {self.job} at {self.address}: {code.name}: {details}"
        if code is grpc.StatusCode.UNAVAILABLE and refused_certificate(details):
            return UntrustedCoordinator(
                f"refused the coordinator of job {self.job} at {self.address}: the TLS "
                f"handshake failed ({details[:300]})"
            )
        if code in _RELOOK:
            return NoCoordinator(message)
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            return JoinRejected(details) if method == "Join" else NotAMember(message)
        if code is grpc.StatusCode.PERMISSION_DENIED and method == "Join":
            return JoinRejected(details)  # another owner's job: never ours to join
        return CoordinatorError(message)

    def _check(self, identity: pb.CoordinatorIdentity, method: str) -> None:
        self._check_answer(identity.job, identity.coordinator_id, method)

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
        """``CoordinatorLink.join`` over gRPC."""
        wait = long_poll_wait(wait_seconds)
        request = pb.JoinRequest(
            job=self.job,
            rank=rank,
            incarnation_id=incarnation_id,
            cluster_view=cluster_view,
            address=address,
            items=held_items(items),
            owner=self.owner,
            wait_seconds=wait,
            address_ranks=sorted(address_ranks or ()),
            address_ranks_given=address_ranks is not None,
        )
        try:
            response = await self._stub.Join(request, timeout=wait + self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._call_error(exc, "Join") from None
        self._check(response.coordinator, "Join")
        state = self._status(response, "Join", rank) if wait else None
        return Joined(response.round, state)

    def _status(self, response: Any, method: str, rank: int) -> RoundState | None:
        """The round state a long-polled ``method`` answers with, checked like a RoundStatus
        answer (None: the coordinator did not send one)."""
        if not response.HasField("status"):
            return None
        message: pb.RoundStatusResponse = response.status
        self._check(message.coordinator, method)
        try:
            return round_state(message, self.job, rank)
        except BadMessage as exc:
            raise CoordinatorError(f"{method} at {self.address}: {exc}") from None

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
        """``CoordinatorLink.round_status`` over gRPC: the answer is checked like any
        coordinator message (``messages.round_state``)."""
        wait = long_poll_wait(wait_seconds)
        request = pb.RoundStatusRequest(
            job=self.job,
            rank=rank,
            incarnation_id=incarnation_id,
            round=round_,
            wait_seconds=wait,
            address_ranks=sorted(address_ranks or ()),
            address_ranks_given=address_ranks is not None,
        )
        if seen is not None and seen.round == round_:
            _, request.seen_state, request.seen_plan_version = seen.key
        try:
            response = await self._stub.RoundStatus(request, timeout=wait + self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._call_error(exc, "RoundStatus") from None
        self._check(response.coordinator, "RoundStatus")
        try:
            return round_state(response, self.job, rank)
        except BadMessage as exc:
            raise CoordinatorError(f"RoundStatus at {self.address}: {exc}") from None

    async def report_restore(
        self,
        rank: int,
        incarnation_id: str,
        report: RestoreReport,
        *,
        wait_seconds: float = 0.0,
        address_ranks: Collection[int] | None = None,
    ) -> RoundState | None:
        """``CoordinatorLink.report_restore`` over gRPC: each failure carries its PEER
        holder's address from ``report.addresses``."""
        known = report.addresses
        wait = long_poll_wait(wait_seconds)
        request = pb.ReportRestoreRequest(
            job=self.job,
            rank=rank,
            incarnation_id=incarnation_id,
            round=report.round,
            plan_version=report.plan_version,
            ready=report.ready,
            failures=[
                failure_message(f, "" if f.fetch.holder is None else known.get(f.fetch.holder, ""))
                for f in report.failures
            ],
            wait_seconds=wait,
            address_ranks=sorted(address_ranks or ()),
            address_ranks_given=address_ranks is not None,
        )
        try:
            response = await self._stub.ReportRestore(request, timeout=wait + self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._call_error(exc, "ReportRestore") from None
        self._check(response.coordinator, "ReportRestore")
        return self._status(response, "ReportRestore", rank) if wait else None

    async def report_progress(
        self, rank: int, incarnation_id: str, progress: Progress
    ) -> ProgressAnswer:
        """``CoordinatorLink.report_progress`` over gRPC: the answer's report interval is
        bounded, so a coordinator cannot silence a rank's reports for long."""
        held, asked = progress.held, progress.address_ranks
        request = pb.ReportProgressRequest(
            job=self.job,
            rank=rank,
            incarnation_id=incarnation_id,
            replicated_step=progress.replicated_step,
            uploaded_step=progress.uploaded_step,
            address=progress.address,
            held_steps=sorted(held or ()),
            reports_holdings=held is not None,
            replicating_step=progress.replicating_step,
            address_ranks=sorted(asked or ()),
            address_ranks_given=asked is not None,
        )
        try:
            response = await self._stub.ReportProgress(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise self._call_error(exc, "ReportProgress") from None
        self._check(response.coordinator, "ReportProgress")
        try:
            addresses = address_map(response.addresses)
        except BadMessage as exc:
            raise CoordinatorError(f"ReportProgress at {self.address}: {exc}") from None
        return ProgressAnswer(
            restorable_step=(
                response.restorable_step if response.HasField("restorable_step") else None
            ),
            backup_step=response.backup_step if response.HasField("backup_step") else None,
            addresses=addresses,
            nodes=node_map(response.nodes),
            keep_steps=frozenset(response.keep_steps[:MAX_HELD_STEPS]),
            # Bounded: a coordinator cannot silence a rank's reports for long.
            report_every=max(
                MIN_REPORT_EVERY, min(MAX_REPORT_EVERY, response.report_every_seconds)
            ),
            last_backup=(
                LastBackup(response.committed_backup_step, response.committed_backup_at)
                if response.HasField("committed_backup_step")
                and math.isfinite(response.committed_backup_at)
                else None
            ),
        )


_RELOOK = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        # A server that stops cancels the calls in flight.
        grpc.StatusCode.CANCELLED,
    }
)


# --- finding the coordinator -----------------------------------------------------------------


async def find_coordinator(
    registry: Registry,
    job: str,
    *,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    backoff: Backoff | None = None,
) -> RegistryEntry:
    """``job``'s registry entry, looked up until one appears or ``timeout`` seconds pass.

    The entry only says where to look: the caller's first call checks who answers there.
    Raises ``NoCoordinator`` at the deadline ("no coordinator for job J yet", or that the
    registry is unreachable when reading it failed), and ``UntrustedCoordinator`` at once
    for an entry no node signed (the caller says so and looks again later).
    """
    delays = backoff or Backoff()
    deadline = clock() + timeout
    failure: ObjectStoreError | None = None
    while True:
        try:
            entry = await asyncio.to_thread(registry.lookup, job)
        except RefusedEntry as exc:
            raise UntrustedCoordinator(str(exc)) from None
        except ObjectStoreError as exc:
            failure, entry = exc, None
            log.warning(
                "registry %s unreadable for job=%s: %s", registry.url, job, exc, extra={"job": job}
            )
        else:
            failure = None
        if entry is not None:
            return entry
        remaining = deadline - clock()
        if remaining <= 0:
            if failure is not None:
                raise NoCoordinator(f"the registry {registry.url} is unreachable: {failure}")
            raise NoCoordinator(f"no coordinator for job {job} yet")
        await sleep(min(remaining, delays.next()))


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
