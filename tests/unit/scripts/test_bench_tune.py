"""The figures ``scripts/bench_tune.py`` reports, computed from the trial's events: the
stall, the restore after the node was lost, Ray's restart apart, and the bucket's bytes."""

from __future__ import annotations

import pytest

from scripts.bench_tune import _figures


def test_the_figures_come_from_the_trials_events() -> None:
    events = [
        {"event": "entry", "t": 0.0},
        *({"event": "checkpoint", "step": 3 * i, "seconds": s, "t": float(i)}
          for i, s in enumerate((0.1, 0.3, 0.2), start=1)),
        {"event": "holding", "step": 9, "t": 3.5},
        {"event": "entry", "t": 10.0},
        {"event": "restored", "step": 9, "seconds": 0.25, "floor": 0.1, "t": 10.25},
        {"event": "checkpoint", "step": 12, "seconds": 0.4, "t": 12.0},
    ]  # fmt: skip
    figures = _figures("mtc", events, lost_at=6.0, bucket=400)
    assert figures.stall_median_s == pytest.approx(0.25)
    assert figures.restore_s == pytest.approx(0.25)
    assert figures.load_floor_s == pytest.approx(0.1)
    assert figures.restart_s == pytest.approx(4.0)  # from the loss to the new entry
    assert figures.restored_step == 9
    assert figures.trial_seconds == pytest.approx(12.0)
    assert figures.bucket_bytes_per_trial_hour == pytest.approx(400 / 12 * 3600)
    assert figures.bucket_bytes_per_checkpoint == pytest.approx(100)


def test_a_trial_never_restored_is_an_error_not_a_figure() -> None:
    events = [{"event": "entry", "t": 0.0}, {"event": "checkpoint", "seconds": 0.1, "t": 1.0}]
    with pytest.raises(RuntimeError, match="not restored"):
        _figures("tune-local", events, lost_at=2.0, bucket=0)
