"""Liveness and readiness as lists of problems (obs.health), against a fake clock."""

from __future__ import annotations

from pathlib import Path

from mtc_replicator.obs.health import Health, Heartbeat, Readiness, directory_check


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_heartbeat_goes_stale_after_its_limit() -> None:
    clock = Clock()
    heart = Heartbeat(limit=30, clock=clock)
    assert heart.check() is None  # counts from its creation
    clock.now += 30
    assert heart.check() is None
    clock.now += 1
    problem = heart.check()
    assert problem is not None
    assert "not answered for 31s" in problem
    heart.beat()
    assert heart.check() is None


def test_readiness_says_what_startup_is_doing() -> None:
    ready = Readiness(stage="opening the store")
    assert ready.check() == "not started yet: opening the store"
    ready.stage = None
    assert ready.check() is None
    ready.stopping = True
    assert ready.check() == "stopping"


def test_directory_check(tmp_path: Path) -> None:
    check = directory_check(tmp_path / "ckpt", "CHECKPOINT_DIR")
    assert check() == f"CHECKPOINT_DIR {tmp_path / 'ckpt'} is missing or not a directory"
    (tmp_path / "ckpt").write_text("a file")
    assert check() is not None
    (tmp_path / "ckpt").unlink()
    (tmp_path / "ckpt").mkdir()
    assert check() is None


def test_readiness_includes_liveness_and_a_broken_check_is_a_problem() -> None:
    def broken() -> str | None:
        raise OSError("stale file handle")

    health = Health(live=[lambda: "stalled"], ready=[lambda: None, broken])
    assert health.liveness() == ["stalled"]
    assert health.readiness() == ["stalled", "check failed: OSError('stale file handle')"]
    assert Health().readiness() == []
