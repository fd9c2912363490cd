"""``mtc.v1.Coordinator`` over gRPC: the thin servicer in front of ``cluster.coordinators``.
I/O module.

Every request is hostile input: it is checked completely (``cluster.messages``) before the
state machine sees it, and our exceptions become one status code in ``status_for``. The
caller's node (``transport.identity.caller``, from its certificate) goes with every join
and report, for the rank it names (``core.rank_holders``). The only module of ``cluster``
that knows gRPC's servicer side (a contract in pyproject.toml).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, NoReturn

import grpc
import grpc.aio

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc
from mtc_replicator.cluster.coordinators import (
    BackupsUnavailable,
    Coordinators,
    ForeignOwner,
    NotInReleasedRound,
)
from mtc_replicator.cluster.hosting import NotHosted
from mtc_replicator.cluster.messages import (
    MAX_DETAIL_CHARS,
    BadMessage,
    check_job,
    identity_message,
    join_call,
    progress_call,
    progress_message,
    restore_report_call,
    status_call,
    status_message,
)
from mtc_replicator.core.coordination import JoinRejected, ReportRefused
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.transport.identity import caller

log = logging.getLogger(__name__)


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


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """``mtc.v1.Coordinator`` over ``Coordinators``; handlers run in the daemon's loop.

    Each handler checks its request whole (``cluster.messages``), calls ``Coordinators``
    and answers; any exception becomes its status code in ``status_for``.
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
            limit = functools.partial(self.coordinators.join_limit, job, request.rank)
            call = join_call(request, job, limit)
            identity, round_ = await self.coordinators.join(
                job, call.incarnation, call.cluster_view, call.inventory, call.owner, node=caller()
            )
            response = pb.JoinResponse(coordinator=identity_message(identity), round=round_)
            if request.wait_seconds:
                identity, status, addresses = await self.coordinators.after_join(
                    job,
                    request.rank,
                    call.incarnation,
                    request.wait_seconds,
                    address_ranks=call.address_ranks,
                )
                response.status.CopyFrom(
                    status_message(identity_message(identity), status, addresses)
                )
        except Exception as exc:
            await _abort(context, "Join", request, exc)
        return response

    async def RoundStatus(
        self, request: pb.RoundStatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RoundStatusResponse:
        try:
            job = self._served(check_job(request.job))
            call = status_call(request)
            identity, status, addresses = await self.coordinators.round_status(
                job,
                request.rank,
                call.incarnation,
                call.seen,
                request.wait_seconds,
                address_ranks=call.address_ranks,
            )
            return status_message(identity_message(identity), status, addresses)
        except Exception as exc:
            await _abort(context, "RoundStatus", request, exc)

    async def ReportRestore(
        self, request: pb.ReportRestoreRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportRestoreResponse:
        try:
            job = self._served(check_job(request.job))
            rank = request.rank
            call = restore_report_call(
                request, job, lambda: self.coordinators.hosted(job, rank).coordinator.config
            )
            identity = self.coordinators.report_restore(
                job,
                rank,
                call.incarnation,
                request.round,
                request.plan_version,
                ready=request.ready,
                failed=call.failed,
                node=caller(),
            )
            jlog = JobLog(log, job, rank)
            for failure, key in zip(request.failures, call.failed, strict=True):
                holder = "the backup" if key.holder is None else f"rank {key.holder}"
                jlog.warning(
                    "restore: %s from %s failed (%s): %s",
                    key.item,
                    holder,
                    "corrupt" if failure.corrupt else "unavailable",
                    failure.detail[:MAX_DETAIL_CHARS],
                    step=key.item.step,
                )
            response = pb.ReportRestoreResponse(coordinator=identity_message(identity))
            if request.wait_seconds:
                identity, status, addresses = await self.coordinators.after_report(
                    job,
                    rank,
                    call.incarnation,
                    (request.round, request.plan_version),
                    request.wait_seconds,
                    address_ranks=call.address_ranks,
                )
                response.status.CopyFrom(
                    status_message(identity_message(identity), status, addresses)
                )
        except Exception as exc:
            await _abort(context, "ReportRestore", request, exc)
        return response

    async def ReportProgress(
        self, request: pb.ReportProgressRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReportProgressResponse:
        try:
            job = self._served(check_job(request.job))
            incarnation, progress = progress_call(request)
            identity, answer = await self.coordinators.report_progress(
                job, request.rank, incarnation, progress, caller()
            )
        except Exception as exc:
            await _abort(context, "ReportProgress", request, exc)
        return progress_message(identity, answer)


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
