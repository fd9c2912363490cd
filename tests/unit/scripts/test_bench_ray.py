"""The figures ``scripts/bench_ray.py`` reports, computed from the workers' events: the stall
per checkpoint from the all-reduce stamps, and a recovery in its parts."""

from __future__ import annotations

import math
from typing import Any

import pytest

from scripts.bench_ray import _figures

EVERY = 4


def _events(stall: float, kill_at: float) -> list[dict[str, Any]]:
    """Two workers, steps of 1 s, a checkpoint every 4 steps that costs ``stall`` more, rank 1
    killed at step 14; the restart restores step 12 (rank 0 a little later than rank 1)."""
    out: list[dict[str, Any]] = []
    for rank in (0, 1):
        t = 0.0
        for step in range(1, 15):
            out.append({"event": "sync", "rank": rank, "step": step, "attempt": 1, "t": t})
            t += 1.0
            if step % EVERY == 0:
                t += stall
                out.append(
                    {"event": "saved", "rank": rank, "step": step, "s": stall + 0.01 * rank}
                    | {"report": 0.1, "t": t}
                )
    out.append({"event": "killed", "rank": 1, "step": 14, "attempt": 1, "t": kill_at})
    for rank, late in ((0, 0.2), (1, 0.0)):
        for event, at in (("entry", 10.0), ("built", 12.0), ("restored", 12.5)):
            e = {"event": event, "rank": rank, "attempt": 2, "t": kill_at + at + late}
            out.append(e | ({"step": 12, "source": "local", "ok": True} if at == 12.5 else {}))
        out.append({"event": "sync", "rank": rank, "step": 13, "attempt": 2, "t": kill_at + 13})
    return sorted(out, key=lambda e: e["t"])


def test_stall_is_a_checkpoint_steps_period_less_a_plain_one() -> None:
    figures = _figures("mtc", _events(stall=0.5, kill_at=100.0), failures=1)
    assert figures.stall == pytest.approx(0.5)
    assert figures.plain == pytest.approx(1.0)
    assert figures.blocked == pytest.approx(0.51)  # the slower worker
    assert figures.report == pytest.approx(0.1)


def test_recovery_runs_from_the_kill_to_the_last_workers_first_all_reduce() -> None:
    figures = _figures("mtc", _events(stall=0.5, kill_at=100.0), failures=1)
    assert figures.recovery == pytest.approx(13.0)
    assert figures.restart == pytest.approx(10.0)  # the first worker's entry
    assert figures.setup == pytest.approx(2.2)  # to the last worker's state built
    assert figures.restore == pytest.approx(0.5)
    assert figures.first_step == pytest.approx(0.3)
    parts = figures.restart + figures.setup + figures.restore + figures.first_step
    assert parts == pytest.approx(figures.recovery)
    assert (figures.restored, figures.failed, figures.source) == (12, 14, "local")
    assert figures.checked


def test_a_restart_that_did_not_restore_everywhere_is_an_error() -> None:
    events = [
        e for e in _events(stall=0.5, kill_at=100.0) if (e["event"], e["rank"]) != ("restored", 0)
    ]
    with pytest.raises(RuntimeError, match="did not restore"):
        _figures("mtc", events, failures=1)


def test_saves_every_step_after_plain_ones_stall_on_average_with_the_reports_share() -> None:
    """``mtc-report10``: plain steps 2-3, then a save every step, every 10th followed by a
    report that costs 0.5 s more; no failures."""
    events: list[dict[str, Any]] = []
    for rank in (0, 1):
        t = 0.0
        for step in range(1, 26):
            events.append({"event": "sync", "rank": rank, "step": step, "attempt": 1, "t": t})
            t += 1.0
            if step >= EVERY:
                extra = 0.1 + (0.5 if (step - EVERY + 1) % 10 == 0 else 0.0)
                t += extra
                events.append({"event": "saved", "rank": rank, "step": step, "s": extra} | {
                    "report": extra - 0.1, "t": t
                })  # fmt: skip
    figures = _figures("mtc-report10", sorted(events, key=lambda e: e["t"]), failures=0)
    assert figures.plain == pytest.approx(1.0)
    assert figures.stall == pytest.approx(0.1)  # the median save has no report
    saves = 25 - EVERY  # the last step's period is not known
    assert figures.stall_mean == pytest.approx(0.1 + 2 * 0.5 / saves)
    assert figures.blocked == pytest.approx(0.1)
    assert figures.blocked_mean == pytest.approx(0.1 + 2 * 0.5 / saves)
    assert math.isnan(figures.recovery)
    assert (figures.restored, figures.failed, figures.checked) == (0, 0, True)
