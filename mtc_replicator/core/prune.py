"""Which backup steps of a job to keep and which to delete, with the reasons. Pure.

The retention policy of ``mtc backups prune``, as restic and borg count periods (keep the
last N, the newest of each of the newest hours, days, ISO weeks; UTC), and the safety rules
no policy overrides (``plan_prune``). It decides on ``PruneFacts`` (commit times, newest
object times, the pin, what verified); ``storage.backup_prune`` gathers those facts from a
listing and performs the deletions. ``StepState`` is here as the one vocabulary for a step's
state that listing (``storage.backup_audit``) and this policy share.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from mtc_replicator.core.humanize import human_age

DEFAULT_MIN_AGE_SECONDS = 3600.0
"""A step without COMMIT whose newest object is younger than this is taken as uploading."""


class StepState(StrEnum):
    COMMITTED = "committed"
    UPLOADING = "uploading"
    """No COMMIT yet and objects younger than the minimum age: probably still being written."""
    PARTIAL = "partial"
    """No COMMIT and nothing written for a while: an abandoned or half-deleted upload."""
    INVALID = "invalid"
    """A COMMIT that does not parse: not restorable, and left for a person to look at."""


class Action(StrEnum):
    KEEP = "keep"
    DELETE = "delete"


@dataclass(frozen=True)
class RetentionPolicy:
    """How many committed steps to keep: the newest ``keep_last``, and the newest one of
    each of the newest ``keep_hourly`` hours (days, ISO weeks; UTC) that have one, as
    restic and borg count periods. ``min_age_seconds`` protects uploads in progress."""

    keep_last: int = 0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    min_age_seconds: float = DEFAULT_MIN_AGE_SECONDS

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_hourly", "keep_daily", "keep_weekly"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if not math.isfinite(self.min_age_seconds) or self.min_age_seconds < 0:
            raise ValueError(f"min_age_seconds must be at least 0, got {self.min_age_seconds}")


@dataclass(frozen=True)
class PruneFacts:
    """What prune decides on for one job."""

    committed: Mapping[int, float]
    """Committed step -> its commit time."""
    partial: Mapping[int, float] = field(default_factory=dict)
    """Step without COMMIT -> the time of its newest object."""
    invalid: Collection[int] = ()
    """Steps whose COMMIT exists but does not parse: never deleted by a policy."""
    pinned: int | None = None
    """The step a restore pin names."""
    verify_requested: bool = False
    newest_verified: int | None = None
    """With ``verify_requested``: the newest committed step that verified, None if none."""


@dataclass(frozen=True)
class StepDecision:
    step: int
    state: StepState
    action: Action
    reasons: tuple[str, ...]


def _period(name: str, t: float) -> str | None:
    """The UTC hour, day or ISO week ``t`` falls in, as a label that is also its bucket."""
    try:
        d = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return None  # a COMMIT time no calendar holds: only keep-last can keep that step
    day = f"{d.year:04d}-{d.month:02d}-{d.day:02d}"
    if name == "hourly":
        return f"{day}T{d.hour:02d}"
    if name == "daily":
        return day
    iso = d.isocalendar()
    return f"{iso.year:04d}-W{iso.week:02d}"


def plan_prune(policy: RetentionPolicy, facts: PruneFacts, now: float) -> list[StepDecision]:
    """Keep or delete each step of one job, with the reasons, newest step first.

    Never deleted: the newest committed step (what a restore would pick), the newest
    verified one when verification was asked for (every committed step when none
    verified), the pinned step, steps with an unreadable COMMIT, and steps without COMMIT
    whose newest object is younger than ``min_age_seconds``. "Newest" is the highest step.
    """
    partial = {s: t for s, t in dict(facts.partial).items() if s not in facts.committed}
    invalid = set(facts.invalid) - set(facts.committed) - set(partial)
    committed = sorted(facts.committed, reverse=True)
    reasons: dict[int, list[str]] = {s: [] for s in (*committed, *partial, *invalid)}
    if committed:
        reasons[committed[0]].append("newest committed")
    for s in committed[: policy.keep_last]:
        reasons[s].append(f"last {policy.keep_last}")
    periods = (
        ("hourly", policy.keep_hourly),
        ("daily", policy.keep_daily),
        ("weekly", policy.keep_weekly),
    )
    for name, count in periods:
        seen: set[str] = set()
        for s in committed:
            if len(seen) >= count:
                break
            bucket = _period(name, facts.committed[s])
            if bucket is not None and bucket not in seen:
                seen.add(bucket)
                reasons[s].append(f"{name} {bucket}")
    if facts.verify_requested:
        if facts.newest_verified is not None and facts.newest_verified in facts.committed:
            reasons[facts.newest_verified].append("newest verified")
        else:
            for s in committed:
                reasons[s].append("no committed step verified")
    if facts.pinned is not None and facts.pinned in reasons:
        reasons[facts.pinned].append("restore pin")
    decisions: list[StepDecision] = []
    for s in sorted(reasons, reverse=True):
        why = reasons[s]
        if s in facts.committed:
            state = StepState.COMMITTED
        elif s in invalid:
            state = StepState.INVALID
            why.append("COMMIT unreadable: left for inspection")
        else:
            age = now - partial[s]
            if not math.isfinite(age) or age < policy.min_age_seconds:
                state = StepState.UPLOADING
                why.append(f"may still be uploading (newest object {human_age(age)} old)")
            else:
                state = StepState.PARTIAL
        if why:
            decisions.append(StepDecision(s, state, Action.KEEP, tuple(why)))
        elif state is StepState.PARTIAL:
            reason = f"no COMMIT, newest object {human_age(now - partial[s])} old"
            decisions.append(StepDecision(s, state, Action.DELETE, (reason,)))
        else:
            decisions.append(StepDecision(s, state, Action.DELETE, ("no keep rule selects it",)))
    return decisions
