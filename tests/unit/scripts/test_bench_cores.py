"""The arithmetic and the choices of ``scripts/bench_cores.py``: which cores each daemon is
pinned to, what a run's figures are, and the ratio each row is set beside."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scripts.bench_cores import (
    Row,
    Run,
    Saved,
    core_sets,
    done_at,
    launch_argv,
    own_cores,
    parse_args,
    parse_cores,
    shared,
    table,
)
from scripts.bench_restore import node_pins


def test_counts_of_cores_include_one_core_the_ratios_are_over() -> None:
    assert parse_cores("2,1,8,2") == [1, 2, 8]
    for bad in ("2,8", "0,1", "1,two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--cores"):
            parse_cores(bad)


def test_bad_arguments_are_refused_with_the_flag_named(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args([])
    assert args.cores == [1, 2]
    assert args.scenarios == ["local", "ingest", "pair"]
    assert (args.step_mib, args.files, args.before) == (512, 8, None)
    for argv, flag in (
        (["--scenarios", "local,push"], "--scenarios"),
        (["--files", "0"], "--files"),
        (["--warmup", "-1"], "--warmup"),
        (["--before", "/nonexistent"], "--before"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err


def test_a_pair_shares_its_cores_unless_the_machine_has_them_for_each_at_every_count() -> None:
    two = [0, 1]
    # This box: both daemons on the same cores at every count, said so.
    assert not own_cores([1, 2], 2, two)
    assert core_sets(1, 2, two, own=False) == ((0,), (0,))
    assert core_sets(2, 2, two, own=False) == ((0, 1), (0, 1))
    assert shared(((0, 1), (0, 1)))
    # A lent machine of 16: each daemon its own N, up to 8 each.
    many = list(range(16))
    assert own_cores([1, 2, 8], 2, many)
    assert core_sets(8, 2, many, own=True) == (tuple(range(8)), tuple(range(8, 16)))
    assert not shared(core_sets(2, 2, many, own=True))
    assert not own_cores([1, 2, 16], 2, many)  # 16 each does not fit: all counts share
    # One daemon: never shared; a count the machine lacks has no cores.
    assert core_sets(2, 1, two, own=True) == ((0, 1),)
    assert not shared(((0, 1),))
    assert core_sets(8, 1, two, own=True) == ()


def test_a_daemon_is_pinned_and_of_the_checkout_asked_for() -> None:
    assert launch_argv((0, 1), None) == ("taskset", "-c", "0,1")
    before = launch_argv((0,), Path("/old"))
    # Run in it: ``python -m`` would import this checkout's package from its directory.
    assert before == ("taskset", "-c", "0", "env", "-C", "/old", "PYTHONPATH=/old")


def test_a_run_s_figures_are_per_node_gib_over_its_saves_wall_seconds() -> None:
    # Two daemons, two saves; thread 7 of daemon 0 is busiest over both saves together.
    saves = [
        Saved(1.0, [1.5, 1.0], [{7: 0.75, 8: 0.5}, {9: 1.0}], 0.5),
        Saved(3.0, [4.5, 3.0], [{7: 2.25, 8: 1.5}, {9: 1.0, 10: 1.5}], 0.0),
    ]
    run = Run(saves, cpu=[7.0, 5.0], gib=2.0)
    assert run.throughput == pytest.approx(0.5)  # 2 GiB in 4 s
    assert run.cpu_per_gib == pytest.approx(3.0)  # the median daemon's 6 CPU s, trailing work in
    assert run.busy == pytest.approx(5.0 / 4)  # while saving: 6 and 4 CPU s over 4 s
    assert run.busiest_share == pytest.approx(((0.75 + 2.25) + 2.0) / 2 / 4)
    assert run.others_busy == pytest.approx(0.5 / 4)  # the rest of the box, while saving


def test_each_row_is_set_beside_one_core_of_its_own_scenario_and_code() -> None:
    def row(scenario: str, cores: int, wall: float, code: str = "") -> Row:
        pins = tuple((tuple(range(cores)),))
        return Row(
            scenario, cores, pins, [Run([Saved(wall, [wall], [{1: wall}], 0.0)], [wall], 1.0)], code
        )

    rows = [
        row("local", 1, 4.0, "before"),
        row("local", 2, 3.0, "before"),
        row("local", 1, 4.0, "after"),
        row("local", 2, 2.0, "after"),
    ]
    text = table(rows)
    assert "| local (before) | 2 | 0.33 (0.33) | 1.33x |" in text
    assert "| local (after) | 2 | 0.50 (0.50) | 2.00x |" in text
    figures = rows[3].json(rows[2])
    assert figures["x_one_core"] == 2.0
    assert figures["code"] == "after"
    assert "x_one_core" not in rows[3].json(None)


def test_a_save_ends_at_its_log_line_s_stamp(tmp_path: Path) -> None:
    log = tmp_path / "node0.log"
    log.write_text(
        "2026-11-29T13:00:00.100Z INFO ingested j/s10/n0-w0: 8 files\n"
        "2026-11-29T13:00:01.250Z INFO backup committed job=j step=10 items=1\n"
    )
    start = done_at(log, r"ingested j/s10/n0-w0: ")
    assert done_at(log, r"backup committed job=j step=10 ") - start == pytest.approx(1.15)
    with pytest.raises(LookupError, match="step=20"):
        done_at(log, r"backup committed job=j step=20 ")


def test_two_nodes_get_cores_of_their_own_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_restore --node-cores N``: the first 2N cores this process may use, N each;
    nothing when there are fewer (the caller refuses the run)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {5, 0, 2, 1})
    assert node_pins(1) == ((0,), (1,))
    assert node_pins(2) == ((0, 1), (2, 5))
    assert node_pins(3) == ()
    assert node_pins(0) == ()
