"""The arithmetic of ``scripts/bench_footprint.py``'s stage table: each stage's floor is the
sum of its primitives' least CPU over the rounds, its ratio the stage's CPU over that; the
node's cycle is set beside the sum of its stages' floors (no upload without a backup)."""

from __future__ import annotations

import pytest

from scripts.bench_footprint import Profile
from scripts.footprint_floors import (
    CYCLE,
    PRIMITIVES,
    STAGE_FLOORS,
    cycle_row,
    floor_of,
    least,
    stage_rows,
    stages_sum,
    table,
)

MEASURED = {
    "read": 0.3,
    "write": 0.35,
    "write_backup": 0.4,
    "crc32c": 0.05,
    "blake3": 0.15,
    "tls_send": 0.65,
    "tls_receive": 0.6,
}


def test_each_primitive_s_floor_is_its_least_over_the_rounds() -> None:
    rounds = [dict(MEASURED), {**MEASURED, "read": 0.2, "tls_send": 0.9}]
    floors = least(rounds)
    assert floors["read"] == 0.2  # from the second round
    assert floors["tls_send"] == 0.65  # from the first
    assert set(floors) == set(PRIMITIVES)
    with pytest.raises(ValueError, match="no rounds"):
        least([])


def test_a_stage_s_floor_is_the_sum_of_what_it_must_do() -> None:
    assert floor_of(STAGE_FLOORS["ingest"], MEASURED) == pytest.approx(0.3 + 0.05 + 0.15)
    assert floor_of(STAGE_FLOORS["push_send"], MEASURED) == pytest.approx(0.3 + 0.65)
    assert floor_of(STAGE_FLOORS["push_receive"], MEASURED) == pytest.approx(0.6 + 0.35 + 0.15)
    assert floor_of(STAGE_FLOORS["upload"], MEASURED) == pytest.approx(0.3 + 0.05 + 0.4)
    with pytest.raises(KeyError, match="tls_send"):
        floor_of(("read", "tls_send"), {"read": 0.3})


def test_each_stage_is_set_beside_its_floor_with_their_ratio() -> None:
    rows = stage_rows({"ingest": 1.0, "push_receive": 2.2}, MEASURED)
    assert [r.stage for r in rows] == list(STAGE_FLOORS)
    ingest = rows[0]
    assert ingest.floor == pytest.approx(0.5)
    assert ingest.ratio == pytest.approx(2.0)
    # A stage the run did not measure has a floor and no ratio.
    send = next(r for r in rows if r.stage == "push_send")
    assert send.cpu is None
    assert send.ratio is None


def test_the_cycle_is_set_beside_the_sum_of_its_stages_floors() -> None:
    with_backup = cycle_row(6.0, MEASURED, backup=True)
    stage_floors = {s: floor_of(STAGE_FLOORS[s], MEASURED) for s in CYCLE}
    assert with_backup.floor == pytest.approx(sum(stage_floors.values()))
    assert with_backup.ratio == pytest.approx(6.0 / sum(stage_floors.values()))
    without = cycle_row(4.0, MEASURED, backup=False)
    assert "upload" not in without.formula
    assert without.floor == pytest.approx(sum(stage_floors.values()) - stage_floors["upload"])


def test_the_stages_measured_apart_add_up_to_the_cycle_s_share() -> None:
    stages = {"ingest": 0.7, "push_send": 1.0, "push_receive": 1.8, "upload": 0.8}
    assert stages_sum(stages, backup=True) == pytest.approx(4.3)
    assert stages_sum(stages, backup=False) == pytest.approx(3.5)
    assert stages_sum({"ingest": 0.7}, backup=True) is None


def test_the_table_says_each_figure_and_what_each_floor_is() -> None:
    rows = stage_rows({"ingest": 1.0}, MEASURED)
    text = table(rows, cycle_row(6.0, MEASURED, backup=True), 4.3)
    ingest = next(line for line in text.splitlines() if line.startswith("| ingest"))
    assert ingest == "| ingest and both digests | 1.00 | 0.50 | 2.00x | read + crc32c + blake3 |"
    send = next(line for line in text.splitlines() if line.startswith("| push send"))
    assert "| - |" in send  # not measured: no figure, no ratio
    assert "the floors of ingest + push_send + push_receive + upload" in text
    assert "| (its stages measured apart, added) | 4.30 |" in text


def test_the_profile_of_a_run_without_a_backup_leaves_the_upload_out_of_the_cycle() -> None:
    stages = {"ingest": 0.7, "push_send": 1.0, "push_receive": 1.8, "upload": 0.8}
    result: dict[str, object] = {"backup": "none", "replicator_cpu_seconds_per_gib": [3.4, 3.6]}
    profile = Profile.of(result, stages, MEASURED)
    assert profile.cycle is not None
    assert profile.cycle.cpu == pytest.approx(3.5)  # the daemons' median
    assert profile.cycle_range == (3.4, 3.6)
    assert profile.stages_apart == pytest.approx(3.5)
    assert "upload" not in profile.cycle.formula
    figures = profile.json()
    assert [s["stage"] for s in figures["stages"]] == list(STAGE_FLOORS)  # type: ignore[index]
    # Without the node's run there is no cycle to set beside the floors.
    alone = Profile.of({"backup": "file://, every step"}, stages, MEASURED)
    assert alone.cycle is None
    assert "cycle" not in alone.json()


def test_what_a_step_costs_whatever_its_bytes_is_reported_beside_the_stage_rows() -> None:
    stages = {"ingest": 0.7, "step_ingesting": 0.031, "step_receiving": 0.052}
    profile = Profile.of({"backup": "none"}, stages, MEASURED)
    assert profile.per_step == {"ingesting": 0.031, "receiving": 0.052}
    assert "ingesting 0.031, receiving 0.052" in profile.text()
    assert profile.json()["step_of_4_kib_cpu_seconds"] == {"ingesting": 0.031, "receiving": 0.052}
    assert [r.stage for r in profile.rows] == list(STAGE_FLOORS)  # no row for them


def test_what_the_cycle_costs_for_its_time_is_the_idle_rate_over_the_saves_seconds() -> None:
    result: dict[str, object] = {
        "backup": "file://, every step",
        "saves": 4,
        "step_mib_per_rank": 256,  # 1 GiB per daemon
        "seconds_for_the_saves": 40.0,
        "replicator_idle_cpu_percent": [1.0, 2.0, 3.0, 2.0],
        "replicator_cpu_seconds_per_gib": [6.0, 6.5, 7.0, 6.0],
    }
    profile = Profile.of(result, {}, MEASURED)
    assert profile.between_steps == pytest.approx(0.02 * 40.0)  # the median daemon's 2%
    assert profile.json()["cycle"]["between_steps_at_idle_rate"] == 0.8  # type: ignore[index]
    assert "of which 0.80 CPU s/GiB at the daemons' idle rate" in profile.text()
    del result["replicator_idle_cpu_percent"]
    assert Profile.of(result, {}, MEASURED).between_steps is None


def test_the_restore_round_s_own_cost_is_reported_apart_from_the_stages() -> None:
    stages = {"restore_receive": 1.5, "restore_round_restoring": 0.4, "restore_round_serving": 0.1}
    profile = Profile.of({"backup": "none"}, stages, MEASURED)
    assert [r.stage for r in profile.rows] == list(STAGE_FLOORS)  # no row of its own
    assert profile.json()["restore_round_cpu_seconds"] == {"restoring": 0.4, "serving": 0.1}
    assert "0.40 CPU s restoring, 0.10 serving" in profile.text()
