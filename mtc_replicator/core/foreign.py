"""Items of jobs that do not run on this node: which give way, and when. Pure: no I/O.

After a node switches jobs the previous job's items stay in the RAM disk. They serve a
fast restore if that job comes back here, but they are the node's RAM: once the newest
step held of such a job is committed in the backup, nothing is lost by dropping them, so
they give way when the running job needs the space, and after ``DEFAULT_TTL`` in any
case. A job whose newest step held here is not in the backup is never dropped by the
daemon on its own (the items may be its only copy); it is reported instead, and an
operator's ``mtc upload`` can upload that step (``plan_kept_upload``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.layout import backup_items, backup_uploaders, format_ranks
from mtc_replicator.core.manifest import ItemId

DEFAULT_TTL = 3600.0
"""``--foreign-job-ttl``: seconds a backed-up job that stopped running here keeps its items.
A job that comes back within it (a pod rescheduled onto the same node, a requeued job)
restores from RAM; after an hour it is more likely gone, and restores from the bucket."""


@dataclass(frozen=True)
class HeldJob:
    """What this node holds of one job that does not run here."""

    job: str
    newest_step: int
    """The newest step of any rank held here."""
    items: int
    bytes: int
    newest_step_bytes: int
    """Bytes of every item of ``newest_step`` held here: the best guess of one step's size."""
    idle_since: float
    """When the job last ran or committed an item here (wall clock)."""
    committed: int | None
    """The newest step committed in the backup, as read (None: none, or not known)."""

    @property
    def backed_up(self) -> bool:
        """Whether the bucket holds the newest step held here, or a newer one."""
        return self.committed is not None and self.committed >= self.newest_step


@dataclass(frozen=True)
class Eviction:
    """What to drop now, and why."""

    jobs: tuple[str, ...]
    reasons: dict[str, str]


def newest_committed(steps: Iterable[int]) -> int | None:
    return max(steps, default=None)


def next_save_bytes(running_step_bytes: int | None, held: Sequence[HeldJob]) -> int:
    """The room the running job's next step needs here: its newest step's size on this
    node; before its first step, the largest step of a job held (the same node shape)."""
    if running_step_bytes:
        return running_step_bytes
    return max((h.newest_step_bytes for h in held), default=0)


def plan_eviction(
    held: Sequence[HeldJob],
    *,
    now: float,
    ttl: float,
    free: int | None = None,
    need: int = 0,
) -> Eviction:
    """The backed-up jobs to drop: those idle for ``ttl``, then, while ``free`` is below
    ``need`` (None: no job runs, nothing needs room), the longest idle first."""
    evict: dict[str, str] = {}
    for h in held:
        if h.backed_up and now - h.idle_since >= ttl:
            evict[h.job] = f"not run here for {now - h.idle_since:.0f}s (ttl {ttl:g}s)"
    if free is not None:
        free += sum(h.bytes for h in held if h.job in evict)
        for h in sorted(held, key=lambda h: (h.idle_since, h.job)):
            if free >= need:
                break
            if h.backed_up and h.job not in evict:
                evict[h.job] = f"the running job needs {need} bytes, {free} are free"
                free += h.bytes
    return Eviction(tuple(evict), evict)


def unprotected(held: Collection[HeldJob]) -> list[HeldJob]:
    """Jobs held here whose newest step is not in the backup: never dropped on their own."""
    return sorted((h for h in held if not h.backed_up), key=lambda h: h.job)


class DropRefused(ValueError):
    """An operator's drop that would lose data or hit the running job; the text says why."""


def check_drop(
    job: str, running: Collection[str], held: HeldJob | None, *, only_copy: bool
) -> HeldJob:
    """What ``mtc drop --job`` may drop: never a running job's items, and items not in
    the backup only when the operator says they may be the only copy."""
    if job in running:
        raise DropRefused(f"job {job} runs on this node now: its items are never dropped")
    if held is None:
        raise DropRefused(f"this node holds no items of job {job}")
    if not held.backed_up and not only_copy:
        newest = "none" if held.committed is None else str(held.committed)
        raise DropRefused(
            f"the newest step of job {job} held here, {held.newest_step}, is not committed in "
            f"the backup (newest committed: {newest}): these items may be its only copy; "
            f"`mtc upload --job {job}` uploads that step to the backup first, or pass "
            "--even-if-only-copy to drop them anyway"
        )
    return held


# --- an operator's upload (``mtc upload``) ---------------------------------------------------


class UploadRefused(ValueError):
    """An operator's upload this node cannot do; the text says why and what to do instead."""


@dataclass(frozen=True)
class KeptUploadPlan:
    """What ``mtc upload --job`` uploads of a job that no longer runs here."""

    job: str
    step: int
    items: tuple[ItemId, ...]
    """The items of ``step`` its COMMIT lists that this node holds: what it uploads."""
    listed: tuple[ItemId, ...]
    """Every item the COMMIT of ``step`` lists (``core.layout.backup_items``)."""


def plan_kept_upload(
    config: JobConfig, held: Collection[ItemId], step: int | None = None
) -> KeptUploadPlan:
    """The step to upload (``step``, else the newest of which this node holds an item its
    COMMIT lists) and those items; raises ``UploadRefused`` when it holds none.

    Every listed item held is uploaded, this rank's and the peer copies alike: a job's
    COMMIT needs every uploader's items, and a node that kept its peers' copies can give
    the backup theirs too.
    """
    job = config.job_name
    mine = {i for i in held if i.job == job}
    steps = {i.step for i in mine}
    candidates = sorted(s for s in steps if any(i in mine for i in backup_items(config, s)))
    if step is None:
        if not candidates:
            raise UploadRefused(
                f"this node holds no item of job {job} that a backup COMMIT lists (uploaders: "
                f"ranks {format_ranks(backup_uploaders(config))}; with "
                "assume-data-parallelism one replica's ranks upload for all): run it on the "
                "node of an uploading rank"
            )
        step = candidates[-1]
    elif step not in candidates:
        raise UploadRefused(
            f"this node holds no item of job {job}'s step {step} that its COMMIT lists "
            f"(steps held here: {', '.join(map(str, sorted(steps))) or 'none'})"
        )
    listed = tuple(backup_items(config, step))
    return KeptUploadPlan(job, step, tuple(i for i in listed if i in mine), listed)
