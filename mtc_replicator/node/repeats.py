"""What one incarnation handed its workload, kept to answer a repeat without a restart: the
restore it published, served again to one more process of the same start
(``core.repeats``), and the steps it took since, so that a second save under one step name
is refused instead of replacing the first. Does file I/O in CHECKPOINT_DIR; the incarnation
calls ``serve_once`` and ``refuse`` in its worker threads, the rest on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from mtc_replicator.cluster.rounds import RoundOutcome
from mtc_replicator.core.contract import CONFIG_FILE, JobConfig
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.checkpoint_dir import markers_out, publish_markers
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import ErrorKind

log = logging.getLogger(__name__)

Report = Callable[[str, int | None, ErrorKind], None]
RunThread = Callable[[Callable[[], bool]], Awaitable[bool]]
RunRefuse = Callable[[Callable[[ItemId, str], bool], ItemId, str], Awaitable[bool]]


class Where(Protocol):
    """The parts of the agent's context this needs."""

    @property
    def checkpoint_dir(self) -> Path: ...

    @property
    def store(self) -> LocalStore: ...

    @property
    def closed_files(self) -> set[str]: ...


class Repeats:
    """One incarnation's answers to a handshake or a save it has seen already."""

    def __init__(
        self, where: Where, config: JobConfig, incarnation_id: str, report: Report
    ) -> None:
        self.checkpoint_dir = where.checkpoint_dir
        self.store = where.store
        self.closed = where.closed_files
        self.config = config
        self.incarnation_id = incarnation_id
        self.report = report
        self.log = JobLog(log, config.job_name, config.node_rank)
        self.since = time.monotonic()
        """When the handshake was accepted (or the incarnation resumed)."""
        self.outcome: RoundOutcome | None = None
        """The restore this daemon published; None before the markers, or after a resume."""
        self.pending = 0
        """Processes that handed the same handshake again and still wait for a marker."""
        self.repeats = 0
        self.taken: set[ItemId] = set()
        """Items taken from the job since the markers."""
        self.task: asyncio.Task[None] | None = None
        """The incarnation's work, once started."""

    @property
    def alive(self) -> bool:
        """The incarnation was started and its work neither failed nor stopped."""
        return self.task is not None and not self.task.done()

    def publish(self, outcome: RoundOutcome) -> None:
        """Handshake steps 6-7 (``checkpoint_dir.publish_markers``), kept to serve again.
        Blocking. Known as published before the markers can be seen: a workload that takes
        them and restarts at once (the same ``replicator.yaml``) is a restart, never a
        repeat of the start whose markers it took."""
        self.outcome = outcome
        try:
            publish_markers(
                self.checkpoint_dir, self.store, self.config, self.incarnation_id, outcome
            )
        except BaseException:
            self.outcome = None
            raise

    def serve_again(self) -> None:
        """One more process of the same start waits: a marker once the current one is taken."""
        self.repeats += 1
        self.pending += 1
        say = self.log.info if self.repeats == 1 else self.log.debug
        say(
            "the same %s again (%d times; another process of the node wrote it): consumed, "
            "not restarting incarnation %s; its restore is served once more",
            CONFIG_FILE,
            self.repeats,
            self.incarnation_id,
        )

    async def next_pass(self, wake: asyncio.Event, rescan: float, run_thread: RunThread) -> None:
        """Wait for the steady loop's next pass, a file event or ``rescan`` seconds (0.05 while
        a process waits to be served again: a taken marker makes no event); then serve it."""
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives as the
        # wake-up fires (gh-86296), and a stopped incarnation would go on taking steps.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05 if self.pending else rescan):
                await wake.wait()
        wake.clear()
        if self.pending and await run_thread(self.serve_once):
            self.pending -= 1

    def serve_once(self) -> bool:
        """Publish the same prerestore and markers again when the last ones were taken;
        whether it did. Blocking."""
        outcome = self.outcome
        if self.pending == 0 or outcome is None or markers_out(self.checkpoint_dir, self.config):
            return False
        publish_markers(
            self.checkpoint_dir,
            self.store,
            self.config,
            self.incarnation_id,
            outcome,
            again=True,
        )
        self.log.info("served the restore again: step %s", outcome.step, step=outcome.step)
        return True

    def took(self, item: ItemId, steady: bool) -> None:
        """A step taken from the job (``steady``: after the markers, not a leftover of an
        earlier incarnation taken before them); processes still waiting for a marker belong
        to an earlier start."""
        if steady:
            self.taken.add(item)
            self.pending = 0

    async def refused(self, item: ItemId, name: str, run_thread: RunRefuse) -> bool:
        """``refuse``, on the incarnation's threads when it is a repeat."""
        return item in self.taken and await run_thread(self.refuse, item, name)

    def refuse(self, item: ItemId, name: str) -> bool:
        """A second save of ``item`` since the markers: removed, told, True; else False.
        Blocking."""
        if item not in self.taken:
            return False
        fsutil.discard_tree(self.checkpoint_dir / name, self.store.trash)
        self.closed.discard(name)  # a later incarnation's file of that name is a new one
        worker = f" worker {item.worker}" if self.config.framework.item_is_file else ""
        self.report(
            f"step {item.step} of job {item.job} rank {item.rank}{worker} was saved again "
            f"({name}) after this incarnation had taken it: the second save was refused and "
            "removed, the first stays committed. Only one process per node may save a step "
            "(with several processes per node: local rank 0, or save_distributed over the "
            "node's process group)",
            item.step,
            ErrorKind.INGEST,
        )
        return True
