"""Pure decisions of the agent: what the workload handed over, what to restore from where,
what to keep, and when to back up. No I/O: every function maps state to a decision, so the
rules are unit-tested without files, sockets or sleeps.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from mtc_replicator.core.contract import (
    ORBAX_TMP_MARK,
    SAVE_TMP_SUFFIX,
    STEP_TMP_PREFIX,
    BackupInterval,
    JobConfig,
    parse_save_name,
    parse_step_dir,
)
from mtc_replicator.core.manifest import ItemId


class Source(StrEnum):
    """Tiers a restored item can come from, fastest first."""

    LOCAL = "local"
    PEER = "peer"
    BACKUP = "backup"


def worker_slots(config: JobConfig) -> range:
    """Workers that own an item of their own.

    A ``.save`` job has one file per worker. A step-directory job hands over one ``<N>/``
    per node, shared by its workers (each writes its own shard files inside), so the node's
    item is worker 0's and every worker's marker points at it.
    """
    return range(config.workers_per_node) if config.framework.item_is_file else range(1)


def rank_items(config: JobConfig, step: int, rank: int | None = None) -> list[ItemId]:
    r = config.node_rank if rank is None else rank
    return [ItemId(config.job_name, step, r, w) for w in worker_slots(config)]


def marker_item(config: JobConfig, step: int, worker: int) -> ItemId:
    """The item whose data worker ``worker``'s restore marker points at."""
    slot = worker if config.framework.item_is_file else 0
    return ItemId(config.job_name, step, config.node_rank, slot)


def complete_steps(
    config: JobConfig, have: Collection[ItemId], rank: int | None = None
) -> list[int]:
    """Steps for which ``have`` holds every item of the rank, ascending."""
    held = set(have)
    r = config.node_rank if rank is None else rank
    steps = {i.step for i in held if i.job == config.job_name and i.rank == r}
    return sorted(s for s in steps if all(i in held for i in rank_items(config, s, r)))


# --- retention -------------------------------------------------------------------------------

DEFAULT_KEEP_STEPS = 1
"""``--keep-steps``: this rank's newest complete steps kept on the RAM disk, at least."""


def newest_kept(complete: Sequence[int], keep_steps: int) -> set[int]:
    """Of this rank's complete steps (ascending), the newest ``keep_steps`` that
    ``--keep-steps`` keeps beside what the safety rules keep (the restorable step, the
    upload, the steps promised to the coordinator): it only ever adds to them, so no
    setting can delete a step they keep."""
    return set(complete[-keep_steps:]) if keep_steps > 0 else set()


def retention(
    config: JobConfig, have: Collection[ItemId], protected: Collection[int]
) -> list[ItemId]:
    """Items of this job and rank that may be deleted.

    Keeps the newest complete step, every newer (still arriving) step and every protected
    step (being uploaded); older steps go, with the workload's links to them. With no
    complete step nothing is deleted: the newest restorable copy must never be dropped.
    """
    complete = complete_steps(config, have)
    if not complete:
        return []
    newest = complete[-1]
    keep = set(protected) | {newest}
    return sorted(
        i
        for i in have
        if i.job == config.job_name
        and i.rank == config.node_rank
        and i.step < newest
        and i.step not in keep
    )


# --- backups ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LastBackup:
    step: int
    at: float
    """Wall-clock seconds when it was committed."""


def backup_due(interval: BackupInterval, step: int, last: LastBackup | None, now: float) -> bool:
    """Whether ``step`` should be uploaded now.

    With no backup yet, the first complete step goes at once: until then a lost cluster
    loses everything.
    """
    if last is None:
        return True
    if step <= last.step:
        return False
    if interval.steps is not None:
        return step - last.step >= interval.steps
    assert interval.minutes is not None
    return now - last.at >= interval.minutes * 60


# --- hand-offs from the workload -------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One top-level name in CHECKPOINT_DIR, as ``lstat`` saw it."""

    name: str
    is_dir: bool
    is_file: bool
    mtime: float


@dataclass(frozen=True)
class Handoff:
    """A finished step the workload handed over: item -> name in CHECKPOINT_DIR."""

    step: int
    names: Mapping[ItemId, str]


def find_handoffs(
    config: JobConfig,
    entries: Collection[Entry],
    closed: Collection[str],
    now: float,
    settle_seconds: float,
) -> list[Handoff]:
    """Finished steps ready to take, oldest first.

    A ``<N>/`` directory (a real one, never the symlink a client made of a marker) is
    complete on arrival because it was published by one rename. ``.save`` files are written
    in place, so one counts as finished once it was closed after writing, or has not changed
    for ``settle_seconds`` (close events can be lost); the step needs all its workers' files.
    """
    found: list[Handoff] = []
    if not config.framework.item_is_file:
        for e in entries:
            step = parse_step_dir(e.name)
            if step is not None and e.is_dir:
                found.append(
                    Handoff(step, {ItemId(config.job_name, step, config.node_rank, 0): e.name})
                )
        return sorted(found, key=lambda h: h.step)
    by_step: dict[int, dict[ItemId, str]] = {}
    for e in entries:
        parts = parse_save_name(e.name)
        if (
            parts is None
            or not e.is_file
            or parts.job != config.job_name
            or parts.rank != config.node_rank
            or parts.worker >= config.workers_per_node
        ):
            continue
        if e.name not in closed and now - e.mtime < settle_seconds:
            continue
        by_step.setdefault(parts.step, {})[
            ItemId(parts.job, parts.step, parts.rank, parts.worker)
        ] = e.name
    for step, names in sorted(by_step.items()):
        if len(names) == config.workers_per_node:
            found.append(Handoff(step, names))
    return found


def save_in_progress(
    config: JobConfig,
    entries: Collection[Entry],
    closed: Collection[str],
    now: float,
    settle_seconds: float,
) -> str | None:
    """A name in CHECKPOINT_DIR that shows the job writing a checkpoint now, or None.

    Step directories are written under a temporary name and renamed when done: Orbax's
    ``<N>.orbax-checkpoint-tmp*``, the PyTorch reference client's ``step=<N>...`` and our
    client's ``step=<N>-unfinished``. ``.save`` files are written in place (or as
    ``<name>.save.tmp`` by our client): one is being written until ``find_handoffs`` would
    call it finished. Leftovers of a crashed save look the same; the hold they cause is
    bounded (``core.pacing``).
    """
    for e in entries:
        if e.is_dir and (ORBAX_TMP_MARK in e.name or e.name.startswith(STEP_TMP_PREFIX)):
            return e.name
        if not e.is_file:
            continue
        name = e.name.removesuffix(SAVE_TMP_SUFFIX)
        parts = parse_save_name(name)
        if parts is not None and name != e.name:
            return e.name
        if (
            parts is not None
            and parts.job == config.job_name
            and parts.rank == config.node_rank
            and e.name not in closed
            and now - e.mtime < settle_seconds
        ):
            return e.name
    return None


def retention_of_copies(
    config: JobConfig,
    have: Collection[ItemId],
    protected: Collection[int],
    pushing: Collection[int],
) -> list[ItemId]:
    """Peer copies (other ranks' items of this job held here) that may be deleted.

    Call it only once this config's restore round was released: a round plans from every
    copy it finds, whatever the layout says. ``pushing`` are the ranks that replicate to
    this node now (``admission.expected_pushers``). Steps are measured against this rank's
    newest complete step, the anchor, never against a copy's step: a pushed far-future step
    must not make real steps look old. Protected steps (the restorable step, which the next
    restore round may need from here) always stay. Of a pushing rank, the newest copy at
    most the anchor stays (it may be that rank's only other copy of the checkpoint both
    hold), as does every newer one (it is still arriving here); older ones go. A rank that
    no longer pushes here (the layout or this node's rank changed) keeps only copies at or
    after the anchor, and a rank the job no longer has (a resize) keeps none: no round of
    this config plans an item of it. Before this rank's first complete step every copy
    of a rank in the job stays.
    """
    complete = complete_steps(config, have)
    anchor = complete[-1] if complete else None
    pushers = set(pushing)
    copies = [i for i in have if i.job == config.job_name and i.rank != config.node_rank]
    newest_kept: dict[int, int] = {}
    for i in copies:
        if i.rank in pushers and anchor is not None and i.step <= anchor:
            newest_kept[i.rank] = max(newest_kept.get(i.rank, i.step), i.step)
    keep = set(protected)

    def doomed(i: ItemId) -> bool:
        if not 0 <= i.rank < config.nodes:
            return True
        if anchor is None or i.step in keep:
            return False
        if i.rank in pushers:
            return i.step < newest_kept.get(i.rank, i.step)
        return i.step < anchor

    return sorted(i for i in copies if doomed(i))
