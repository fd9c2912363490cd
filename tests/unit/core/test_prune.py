"""Tests for ``mtc_replicator.core.prune``: the retention policy, by example and by hypothesis
properties (what must stay is never deleted; keeping more never deletes more)."""

from __future__ import annotations

import dataclasses
import math
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtc_replicator.core.prune import Action, PruneFacts, RetentionPolicy, plan_prune

HOUR = 3600.0
DAY = 24 * HOUR
BASE = 1_700_006_400.0
"""2023-11-15T00:00:00Z, a Wednesday: calendar buckets in the examples start here."""
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- retention policy: examples ----------------------------------------------------------


def decide(
    policy: RetentionPolicy, facts: PruneFacts, now: float = BASE + 100 * DAY
) -> dict[int, tuple[Action, tuple[str, ...]]]:
    return {d.step: (d.action, d.reasons) for d in plan_prune(policy, facts, now)}


def kept(policy: RetentionPolicy, facts: PruneFacts) -> list[int]:
    return sorted(s for s, (a, _) in decide(policy, facts).items() if a is Action.KEEP)


def test_keep_last() -> None:
    facts = PruneFacts({s: BASE + s for s in range(1, 7)})
    assert kept(RetentionPolicy(keep_last=3), facts) == [4, 5, 6]
    assert kept(RetentionPolicy(keep_last=10), facts) == [1, 2, 3, 4, 5, 6]


def test_the_newest_committed_step_is_kept_by_any_policy() -> None:
    facts = PruneFacts({1: BASE, 2: BASE + DAY}, partial={3: BASE + 50 * DAY})
    decisions = decide(RetentionPolicy(keep_weekly=0), facts)
    assert decisions[2] == (Action.KEEP, ("newest committed",))
    assert decisions[1][0] is decisions[3][0] is Action.DELETE


def test_keep_hourly_keeps_the_newest_of_each_hour_that_has_backups() -> None:
    times = {
        1: BASE + 10 * 60,  # 00h
        2: BASE + 50 * 60,  # 00h, newest of the hour
        3: BASE + HOUR + 20 * 60,  # 01h
        4: BASE + 3 * HOUR + 5 * 60,  # 03h (02h has none: it does not count)
        5: BASE + 3 * HOUR + 55 * 60,  # 03h, newest
    }
    assert kept(RetentionPolicy(keep_hourly=2), PruneFacts(times)) == [3, 5]
    assert kept(RetentionPolicy(keep_hourly=3), PruneFacts(times)) == [2, 3, 5]
    reasons = decide(RetentionPolicy(keep_hourly=3), PruneFacts(times))[3][1]
    assert reasons == ("hourly 2023-11-15T01",)


def test_keep_daily_and_weekly_use_utc_days_and_iso_weeks() -> None:
    # BASE is Wednesday 2023-11-15; the ISO week ends on Sunday the 19th.
    times = {
        1: BASE + 1 * HOUR,  # Wed
        2: BASE + 4 * DAY + 23 * HOUR,  # Sun, last of the week 2023-W46
        3: BASE + 5 * DAY,  # Mon, 2023-W47
        4: BASE + 5 * DAY + HOUR,  # Mon, newest
    }
    assert kept(RetentionPolicy(keep_daily=2), PruneFacts(times)) == [2, 4]
    assert kept(RetentionPolicy(keep_weekly=5), PruneFacts(times)) == [2, 4]
    reasons = decide(RetentionPolicy(keep_weekly=5), PruneFacts(times))
    assert reasons[2][1] == ("weekly 2023-W46",)
    assert reasons[4][1] == ("newest committed", "weekly 2023-W47")


def test_rules_add_up() -> None:
    times = {s: BASE + s * DAY for s in range(10)}
    policy = RetentionPolicy(keep_last=2, keep_daily=3, keep_weekly=2)
    # last 2: 9, 8; daily: 9, 8, 7; weekly: 9 (Fri of 2023-W47) and 4 (Sun of 2023-W46).
    assert kept(policy, PruneFacts(times)) == [4, 7, 8, 9]


def test_partial_steps_are_kept_while_young_and_deleted_when_abandoned() -> None:
    now = BASE + DAY
    facts = PruneFacts({1: BASE}, partial={2: now - 59 * 60, 3: now - 61 * 60, 4: now + 30})
    decisions = decide(RetentionPolicy(keep_last=1), facts, now)
    assert decisions[2][0] is Action.KEEP
    assert "may still be uploading (newest object 59m old)" in decisions[2][1]
    assert decisions[3] == (Action.DELETE, ("no COMMIT, newest object 1h1m old",))
    assert decisions[4][0] is Action.KEEP  # written "in the future": clocks differ


def test_pinned_invalid_and_verified_steps_are_kept() -> None:
    facts = PruneFacts(
        {1: BASE, 2: BASE + 1, 3: BASE + 2, 4: BASE + 3},
        partial={5: BASE},
        invalid=[6],
        pinned=1,
        verify_requested=True,
        newest_verified=2,
    )
    decisions = decide(RetentionPolicy(keep_last=1), facts)
    assert decisions[1] == (Action.KEEP, ("restore pin",))
    assert decisions[2] == (Action.KEEP, ("newest verified",))
    assert decisions[3][0] is Action.DELETE
    assert decisions[4] == (Action.KEEP, ("newest committed", "last 1"))
    assert decisions[5][0] is Action.DELETE
    assert decisions[6] == (Action.KEEP, ("COMMIT unreadable: left for inspection",))


def test_nothing_verified_keeps_every_committed_step() -> None:
    facts = PruneFacts({1: BASE, 2: BASE + 1}, verify_requested=True, newest_verified=None)
    assert kept(RetentionPolicy(keep_last=1), facts) == [1, 2]


def test_commit_times_no_calendar_holds_only_miss_the_calendar_rules() -> None:
    facts = PruneFacts({1: math.nan, 2: 1e300, 3: BASE})
    assert kept(RetentionPolicy(keep_daily=5), facts) == [3]
    assert kept(RetentionPolicy(keep_last=3), facts) == [1, 2, 3]


def test_policy_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        RetentionPolicy(keep_last=-1)
    with pytest.raises(ValueError, match="min_age_seconds"):
        RetentionPolicy(min_age_seconds=math.inf)


# --- retention policy: properties --------------------------------------------------------

STEPS = st.integers(0, 10**6)
TIMES = st.floats(BASE - 60 * DAY, BASE + 60 * DAY)
ODD_TIMES = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300])
POLICIES = st.builds(
    RetentionPolicy,
    keep_last=st.integers(0, 6),
    keep_hourly=st.integers(0, 6),
    keep_daily=st.integers(0, 6),
    keep_weekly=st.integers(0, 6),
    min_age_seconds=st.floats(0, 10 * DAY),
)


@st.composite
def prune_facts(draw: st.DrawFn) -> PruneFacts:
    committed = draw(st.dictionaries(STEPS, TIMES | ODD_TIMES, max_size=25))
    partial = draw(st.dictionaries(STEPS, TIMES, max_size=6))
    invalid = draw(st.lists(STEPS, max_size=3))
    for s in committed:
        partial.pop(s, None)
    invalid = [s for s in invalid if s not in committed and s not in partial]
    every = [*committed, *partial, *invalid]
    pinned = draw(st.none() | st.sampled_from(every)) if every else None
    verify_requested = draw(st.booleans())
    newest_verified = draw(st.none() | st.sampled_from(sorted(committed))) if committed else None
    return PruneFacts(committed, partial, invalid, pinned, verify_requested, newest_verified)


def bucket(name: str, t: float) -> str | None:
    try:
        d = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    if name == "hourly":
        return d.strftime("%Y-%m-%d %H")
    if name == "daily":
        return d.strftime("%Y-%m-%d")
    return str(d.isocalendar()[:2])


@given(POLICIES, prune_facts(), TIMES)
@PROPS
def test_prune_never_deletes_what_must_stay(
    policy: RetentionPolicy, facts: PruneFacts, now: float
) -> None:
    decisions = plan_prune(policy, facts, now)
    steps = [d.step for d in decisions]
    assert steps == sorted({*facts.committed, *facts.partial, *facts.invalid}, reverse=True)
    action = {d.step: d.action for d in decisions}
    keep = {s for s, a in action.items() if a is Action.KEEP}
    assert all(d.reasons for d in decisions)
    if facts.committed:
        assert max(facts.committed) in keep
    assert set(sorted(facts.committed, reverse=True)[: policy.keep_last]) <= keep
    if facts.pinned is not None:
        assert facts.pinned in keep
    assert set(facts.invalid) <= keep
    for s, t in facts.partial.items():
        if now - t < policy.min_age_seconds:
            assert s in keep
    if facts.verify_requested:
        if facts.newest_verified is not None:
            assert facts.newest_verified in keep
        else:
            assert set(facts.committed) <= keep


@given(POLICIES, prune_facts(), TIMES)
@PROPS
def test_period_rules_keep_the_newest_step_of_the_newest_periods(
    policy: RetentionPolicy, facts: PruneFacts, now: float
) -> None:
    reasons = {d.step: d.reasons for d in plan_prune(policy, facts, now)}
    counts = {"hourly": policy.keep_hourly, "daily": policy.keep_daily}
    counts["weekly"] = policy.keep_weekly
    for name, count in counts.items():
        newest_of: dict[str, int] = {}
        for s, t in facts.committed.items():
            b = bucket(name, t)
            if b is not None:
                newest_of[b] = max(newest_of.get(b, s), s)
        expected = sorted(newest_of.values(), reverse=True)[:count]
        chosen = [s for s in reasons if any(r.startswith(f"{name} ") for r in reasons[s])]
        assert sorted(chosen, reverse=True) == expected


@given(
    POLICIES,
    prune_facts(),
    TIMES,
    st.sampled_from(["keep_last", "keep_hourly", "keep_daily", "keep_weekly"]),
)
@PROPS
def test_keeping_more_never_deletes_more(
    policy: RetentionPolicy, facts: PruneFacts, now: float, rule: str
) -> None:
    def kept_by(p: RetentionPolicy) -> set[int]:
        return {d.step for d in plan_prune(p, facts, now) if d.action is Action.KEEP}

    more = dataclasses.replace(policy, **{rule: getattr(policy, rule) + 1})
    assert kept_by(policy) <= kept_by(more)
