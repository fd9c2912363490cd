"""The chaos harness's verdicts on made-up observations: each invariant can fail."""

from __future__ import annotations

import pytest

from tests.chaos.invariants import Violation, check_floor, floor, restored_step, spinning


def test_floor_is_the_newest_step_every_rank_still_has_somewhere() -> None:
    held = {
        0: {(10, "0-0"), (20, "0-0"), (20, "1-0")},
        1: {(10, "1-0")},  # its own 20 lost with its RAM disk; node 0 holds a copy
        2: {(10, "2-0"), (20, "2-0"), (30, "2-0")},
    }
    assert floor(held, [], 3) == (20, "step 20: every rank's item committed in some store")
    del held[0]  # rank 0's every copy of 20 gone too: 10 is the newest left
    assert floor(held, [], 3)[0] == 0  # rank 0 holds nothing now, not even 10
    assert floor(held, [10], 3) == (10, "step 10: backup COMMIT")


def test_a_backup_commit_raises_the_floor() -> None:
    held = {0: {(10, "0-0")}, 1: {(10, "1-0")}}
    assert floor(held, [10, 30], 2)[0] == 30
    assert floor({}, [], 2)[0] == 0


def test_a_restore_below_the_floor_is_a_loss() -> None:
    check_floor(30, 30, "why", 40)
    check_floor(40, 30, "why", 40)
    with pytest.raises(Violation, match="restored step 20, below the floor why"):
        check_floor(20, 30, "why", 40)


def test_every_rank_one_marker_of_one_step() -> None:
    good = {0: ["j-s30-n0-w0.restore"], 1: ["j-s30-n1-w0.restore"]}
    assert restored_step(good) == 30
    with pytest.raises(Violation, match="different steps"):
        restored_step({0: ["j-s30-n0-w0.restore"], 1: ["j-s20-n1-w0.restore"]})
    with pytest.raises(Violation, match="2 markers"):
        restored_step({0: ["j-s30-n0-w0.restore", "j-s20-n0-w0.restore"]})
    with pytest.raises(Violation, match="0 markers"):
        restored_step({0: []})
    with pytest.raises(Violation, match="not its own"):
        restored_step({1: ["j-s30-n0-w0.restore"]})


def test_spinning_daemons_are_named() -> None:
    readings = {0: (0.81, 10_000), 1: (0.01, 200), 2: (float("nan"), 0), 3: (0.02, 1 << 20)}
    assert spinning(readings, 0.6, 256 << 10) == [0, 3]
