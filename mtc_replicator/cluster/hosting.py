"""The coordinators this daemon hosts: one ``JobCoordinator`` state machine per job whose
rank 0 runs here (one-node jobs included), each with a random id and a change signal that
long polls wait on. No I/O (asyncio events only); used from the daemon's event loop.

What the coordinators answer is ``cluster.coordinators``; the gRPC servicer is
``cluster.coordinator_servicer``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from mtc_replicator.cluster.messages import Identity
from mtc_replicator.cluster.registry import new_coordinator_id
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.coordination import JobCoordinator
from mtc_replicator.core.ownership import UNOWNED, check_owner

log = logging.getLogger(__name__)


class NotHosted(LookupError):
    """This daemon hosts no coordinator for the job."""


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
    holders_loaded: bool = False
    """The record of the job's rank holders was read back (``Coordinators._load_holders``)."""
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
            extra={"job": job},
        )
        return hosted.coordinator

    def drop(self, job: str) -> None:
        """Stop hosting ``job``'s coordinator (this node no longer runs its rank 0)."""
        hosted = self._jobs.pop(job, None)
        if hosted is not None:
            hosted.notify()  # long polls answer NOT_FOUND now, not at their deadline
            log.info(
                "dropped the coordinator job=%s id=%s",
                job,
                hosted.coordinator_id,
                extra={"job": job},
            )

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
