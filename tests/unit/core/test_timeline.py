"""Tests for ``mtc_replicator.core.timeline``: the restore's phases against a fake clock."""

from __future__ import annotations

import pytest

from mtc_replicator.core.timeline import RestorePhase, RestoreTimeline, Span


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_phases_follow_each_other_and_add_up_to_the_wall_time() -> None:
    clock = Clock()
    t = RestoreTimeline(clock, origin=99.5, opening=RestorePhase.SETTLE)
    t.enter(RestorePhase.JOIN)
    clock.advance(0.25)
    t.enter(RestorePhase.PLAN)
    clock.advance(0.125)
    t.enter(RestorePhase.PEER, "job/s1/n1-w0 from rank 1")
    clock.advance(1.0)
    t.enter(RestorePhase.RELEASE)
    clock.advance(0.0625)
    t.enter(RestorePhase.MARKERS)
    clock.advance(0.03125)
    t.finish()
    assert t.spans() == [
        Span(RestorePhase.SETTLE, 0.0, 0.5),
        Span(RestorePhase.JOIN, 0.5, 0.75),
        Span(RestorePhase.PLAN, 0.75, 0.875),
        Span(RestorePhase.PEER, 0.875, 1.875, "job/s1/n1-w0 from rank 1"),
        Span(RestorePhase.RELEASE, 1.875, 1.9375),
        Span(RestorePhase.MARKERS, 1.9375, 1.96875),
    ]
    assert t.elapsed == pytest.approx(1.96875)
    assert sum(t.totals().values()) == pytest.approx(t.elapsed)
    assert t.phase is None


def test_a_recurring_phase_adds_its_spans_and_totals_keep_phase_order() -> None:
    clock = Clock()
    t = RestoreTimeline(clock)
    t.enter(RestorePhase.LOCAL, "a")
    clock.advance(0.5)
    t.enter(RestorePhase.JOIN)
    clock.advance(0.25)
    t.enter(RestorePhase.LOCAL, "b")
    clock.advance(0.5)
    t.finish()
    assert list(t.totals().items()) == [(RestorePhase.JOIN, 0.25), (RestorePhase.LOCAL, 1.0)]


def test_summary_names_every_phase_and_lines_every_span() -> None:
    clock = Clock()
    t = RestoreTimeline(clock, opening=RestorePhase.SETTLE)
    clock.advance(0.1)
    t.enter(RestorePhase.BACKUP, "job/s3/n0-w0")
    clock.advance(2.0)
    t.finish()
    summary = t.summary()
    assert summary.startswith("total=2.100 settle=0.100 ingest=0.000 join=0.000")
    assert "backup=2.000" in summary
    assert [f"{p.value}=" in summary for p in RestorePhase] == [True] * len(RestorePhase)
    assert t.lines() == ["+0.000s 0.100s settle", "+0.100s 2.000s backup job/s3/n0-w0"]


def test_nothing_is_recorded_after_finish() -> None:
    clock = Clock()
    t = RestoreTimeline(clock)
    t.enter(RestorePhase.JOIN)
    clock.advance(1.0)
    t.finish()
    clock.advance(5.0)
    t.enter(RestorePhase.PLAN)
    t.finish()
    assert [s.phase for s in t.spans()] == [RestorePhase.JOIN]
    assert t.elapsed == 1.0


def test_a_clock_that_steps_back_never_makes_a_negative_span() -> None:
    clock = Clock()
    t = RestoreTimeline(clock)
    t.enter(RestorePhase.JOIN)
    clock.advance(-1.0)
    t.finish()
    assert t.spans()[0].seconds == 0.0
