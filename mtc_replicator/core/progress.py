"""Steady-state progress of every rank of a job, folded in one report (``Progress``) at a
time. Pure.

The coordinator answers every progress report with the cluster's restorable step, the steps
every rank must keep and whether a backup is done. Recomputed from all ranks, each answer
costs O(ranks), and every rank reports: O(ranks^2) per reporting period, the coordinator's
whole budget at thousands of ranks. Here each report costs O(its own steps) and each answer
O(distinct steps in flight), which is a handful whatever the job's size: ranks save the
same steps, so their reports name the same few numbers.

The answers are exactly ``core.layout.restorable_step`` and the rules of
``core.coordination``; ``tests/unit/core/test_progress.py`` checks them against those
definitions on random histories.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """One rank's progress report, in the one shape it has from the agent, over either link
    (``cluster.link``; ``cluster.messages.progress_call`` checks it off the wire), to the
    coordinator's state machine (``core.coordination.JobCoordinator.report_progress``)."""

    replicated_step: int | None
    """The rank's newest step committed locally and on its targets."""
    uploaded_step: int | None = None
    address: str = ""
    """The rank's peer address now (empty: unchanged)."""
    held: frozenset[int] | None = None
    """The rank's promise: the steps it keeps until the answer (None: every step)."""
    replicating_step: int | None = None
    """The step the rank is pushing to its targets now."""
    address_ranks: frozenset[int] | None = None
    """The ranks whose addresses the answer carries (None: every rank's)."""


class ProgressBook:
    """Each rank's replicated step, promise, push in flight and upload, with their tallies."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.replicated: dict[int, int] = {}
        """Each rank's newest step committed locally and on its targets (only grows)."""
        self.held: dict[int, frozenset[int]] = {}
        """Each rank's promise: the steps it keeps until its next report is answered."""
        self.replicating: dict[int, int] = {}
        self.uploaded: dict[int, int] = {}
        self._replicated_count: Counter[int] = Counter()
        self._promise_count: Counter[int] = Counter()
        self._replicating_count: Counter[int] = Counter()
        self._tracked_upload: int | None = None
        self._tracked_ranks: frozenset[int] = frozenset()
        self._done: set[int] = set()

    def reset(self, replicated: int | None) -> None:
        """A released round: every rank holds ``replicated`` (None: nothing yet)."""
        self.replicated, self._replicated_count = {}, Counter()
        if replicated is not None:
            self.replicated = dict.fromkeys(range(self.nodes), replicated)
            self._replicated_count[replicated] = self.nodes
        self.held, self._promise_count = {}, Counter()
        self.replicating, self._replicating_count = {}, Counter()
        # Uploads reported by the previous run's incarnations speak for them only: kept, a
        # rank whose dead incarnation uploaded a newer step would never be ordered to upload
        # the restored (older) one, and its COMMIT would fail until training passed it.
        self.uploaded = {}
        self._tracked_upload, self._tracked_ranks, self._done = None, frozenset(), set()

    # --- one report -------------------------------------------------------------------------

    def report(
        self,
        rank: int,
        *,
        replicated: int | None,
        uploaded: int | None,
        held: frozenset[int] | None,
        replicating: int | None,
    ) -> None:
        """Fold in one rank's report (``held`` None: it keeps every step)."""
        if replicated is not None:
            old = self.replicated.get(rank)
            if old is None or replicated > old:
                self.replicated[rank] = replicated
                _move(self._replicated_count, old, replicated)
        if uploaded is not None:
            old_up = self.uploaded.get(rank)
            if old_up is None or uploaded > old_up:
                self.uploaded[rank] = uploaded
                if (
                    self._tracked_upload is not None
                    and rank in self._tracked_ranks
                    and uploaded >= self._tracked_upload
                ):
                    self._done.add(rank)
        old_promise = self.held.pop(rank, None)
        if old_promise is not None:
            _remove(self._promise_count, old_promise)
        if held is not None:
            self.held[rank] = held
            self._promise_count.update(held)
        old_push = self.replicating.pop(rank, None)
        if replicating is not None:
            self.replicating[rank] = replicating
        _move(self._replicating_count, old_push, replicating)

    # --- answers ------------------------------------------------------------------------------

    def restorable(self) -> int | None:
        """``core.layout.restorable_step`` of the reports so far: the newest step at most
        every rank's replicated step that every promising rank promised."""
        if len(self.replicated) < self.nodes:
            return None
        bound = min(self._replicated_count)
        promisers = len(self.held)
        if not promisers:
            return bound
        common = [s for s, n in self._promise_count.items() if n == promisers and s <= bound]
        return max(common, default=None)

    def wanted(self) -> set[int]:
        """Every step some rank has replicated or is pushing."""
        return set(self._replicated_count) | set(self._replicating_count)

    def track_upload(self, step: int, ranks: Iterable[int]) -> None:
        """From now on, count which of ``ranks`` have uploaded ``step`` (or a newer one)."""
        self._tracked_upload = step
        self._tracked_ranks = frozenset(ranks)
        self._done = {r for r in self._tracked_ranks if self.uploaded.get(r, -1) >= step}

    def all_uploaded(self) -> bool:
        """Whether every tracked rank has uploaded the tracked step."""
        return self._tracked_upload is not None and len(self._done) == len(self._tracked_ranks)

    def has_uploaded(self, rank: int, step: int) -> bool:
        done = self.uploaded.get(rank)
        return done is not None and done >= step  # step 0 is a step like any other


def _move(count: Counter[int], old: int | None, new: int | None) -> None:
    if old is not None:
        _remove(count, (old,))
    if new is not None:
        count[new] += 1


def _remove(count: Counter[int], steps: Iterable[int]) -> None:
    for s in steps:
        count[s] -= 1
        if count[s] <= 0:
            del count[s]
