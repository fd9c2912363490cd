"""The coordinator this node hosts as rank 0 of its job: which one (the running job's, no
other), and its entry in the registry for the other ranks to find, registered through what
may heal (a full or unreachable store) with backoff. Does I/O (the registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection

from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.cluster.registry import OwnedByAnother, Registry, RegistryEntry
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.retry import Backoff
from mtc_replicator.storage.objectstore import ObjectStoreError

log = logging.getLogger(__name__)


class Stopping(Exception):
    """The daemon was asked to stop while it waited for something that may still heal."""


class Rank0Coordinator:
    """Which coordinator this node hosts, and its registration."""

    def __init__(
        self,
        coordinators: CoordinatorHost,
        registry: Registry | None,
        *,
        advertise: Callable[[], str | None],
        stop: asyncio.Event,
        on_refused: Callable[[str, OwnedByAnother], Awaitable[None]],
        forget_holders: Callable[[Collection[str]], None] = lambda keep: None,
        others: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.coordinators = coordinators
        self._forget_holders = forget_holders
        """Remove the rank holders recorded here of every job but those given
        (``local.holders_file.HoldersFile.keep_only``)."""
        self._others = others
        """The jobs this node's other job directories run: their coordinators stay."""
        self.registry = registry
        self._advertise = advertise
        """The address other nodes reach this one at, once the daemon's server is bound."""
        self._stop = stop
        self._on_refused = on_refused
        """What the daemon does when a registration made in the background finds the job
        name owned by another: the running job with that name stops."""
        self._registering: asyncio.Task[None] | None = None
        """A registration a resume could not make at once (``_claim_later``)."""

    def cancel(self) -> None:
        """Give up a registration still going on in the background (the daemon stops)."""
        if self._registering is not None:
            self._registering.cancel()

    async def host(
        self,
        config: JobConfig | None,
        owner: str = UNOWNED,
        *,
        incarnation: str | None = None,
        resume_steady: bool = False,
        register_later: bool = False,
    ) -> None:
        """Host the job's coordinator for ``owner`` when this node is its rank 0; drop any
        other. ``register_later``: a registration that fails for now goes on in the
        background (a restarted daemon resumes its job meanwhile); otherwise it is waited
        for.

        A cluster job's coordinator is registered for the other ranks to find; a one-node
        job's is called in process by its agent only, so it needs no registry. Raises
        ``OwnedByAnother`` (hosting nothing) when the job is registered to another owner.
        Entries of dropped coordinators stay: they keep their job names their owners'.

        A new incarnation of rank 0 keeps the job's coordinator (and its memory of the
        released round, which keeps stale agents out of the new one); ``incarnation``, the one
        that runs rank 0 here, is the only one that may open a new round. A daemon restarted
        while its job runs (``resume_steady``) hosts one that takes the running ranks back.
        """
        if self._registering is not None:
            self._registering.cancel()  # superseded by what is decided now
            self._registering = None
        keep = config.job_name if config is not None and config.node_rank == 0 else None
        others = frozenset(self._others())
        for job in self.coordinators.jobs():
            hosted = self.coordinators.get(job)
            if job != keep and job not in others and hosted is not None:
                self.coordinators.drop(job)
        if config is not None:
            # A handshake says which rank this node runs now: any other job's coordinator
            # (but those of jobs beside it), or this job's when the rank is not 0, runs
            # elsewhere from now on.
            self._forget_holders(others if keep is None else others | {keep})
        if config is None or keep is None:
            return
        view = cluster_view_json(config)
        if config.nodes == 1:
            # A one-node job's agent calls it in process: nothing to register.
            self.coordinators.host(
                config,
                view,
                resume_steady=resume_steady,
                owner=owner,
                rank0_incarnation=incarnation,
            )
            return
        if self.registry is None:
            return
        self.coordinators.host(
            config, view, resume_steady=resume_steady, owner=owner, rank0_incarnation=incarnation
        )
        coordinator_id = self.coordinators.coordinator_id(keep)
        assert coordinator_id is not None
        advertise = self._advertise()
        assert advertise is not None
        entry = RegistryEntry(keep, advertise, coordinator_id, time.time(), owner)
        try:
            await self._claim(entry, once=register_later)
        except (OwnedByAnother, Stopping):
            self.coordinators.drop(keep)
            raise
        except (ObjectStoreError, OSError):
            self._registering = asyncio.create_task(
                self._claim_later(entry), name=f"register-{keep}"
            )
            return
        log.info(
            "hosting the coordinator of job %s at %s (id %s)",
            keep,
            advertise,
            coordinator_id,
            extra={"job": keep},
        )

    async def _claim(self, entry: RegistryEntry, *, once: bool = False) -> None:
        """Register ``entry``, waiting out what may heal (a full or unreachable store: the
        uploads wait for it too) with jittered backoff and saying why, instead of letting
        the error end the daemon. ``OwnedByAnother`` at once; ``Stopping`` when the daemon
        is asked to stop first; with ``once``, the first error that may heal."""
        assert self.registry is not None
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                await asyncio.to_thread(self.registry.claim, entry)
            except (ObjectStoreError, OSError) as exc:
                if once:
                    log.warning(
                        "cannot register the coordinator of job %s in %s yet (resuming "
                        "meanwhile): %s",
                        entry.job,
                        self.registry.url,
                        exc,
                        extra={"job": entry.job},
                    )
                    raise
                wait = backoff.next()
                log.warning(
                    "cannot register the coordinator of job %s in %s, again in %.1fs: %s",
                    entry.job,
                    self.registry.url,
                    wait,
                    exc,
                    extra={"job": entry.job},
                )
            else:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
            if self._stop.is_set():
                raise Stopping(f"stopped before the coordinator of job {entry.job} registered")

    async def _claim_later(self, entry: RegistryEntry) -> None:
        """The registration a resume could not make at once: retried until it is made. The
        entry's owner refused meanwhile, the job stops here as a refused handshake would."""
        with contextlib.suppress(Stopping):
            try:
                await self._claim(entry)
            except OwnedByAnother as exc:
                self.coordinators.drop(entry.job)
                await self._on_refused(entry.job, exc)
                return
        if not self._stop.is_set():
            log.info(
                "registered the coordinator of job %s at last", entry.job, extra={"job": entry.job}
            )
