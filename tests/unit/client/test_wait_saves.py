"""``mtc_replicator.client.wait_saves``, a preStop hook's wait, against a real ``AsyncSaver``
writing real files: it returns once the save in flight is published, names what is still in
flight at its timeout, and ignores what is not our client's."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.client.wait_saves import main, saves_in_flight
from tests.unit.client.test_async_save import SAVES, Gate, state

pytest.importorskip("torch")

from mtc_replicator.client import AsyncSaver


@pytest.mark.parametrize("how", SAVES)
def test_the_wait_ends_once_the_save_in_flight_is_published(tmp_path: Path, how: str) -> None:
    gate = Gate("rename")  # the step's temporary is written; its rename is held
    with AsyncSaver(tmp_path, phase_hook=gate) as saver, ThreadPoolExecutor(1) as pool:
        SAVES[how](saver, 10, state())
        assert gate.reached.wait(30)
        assert saves_in_flight(tmp_path), "the save's temporary is there"
        waiting = pool.submit(main, ["--dir", str(tmp_path), "--timeout", "20"])
        time.sleep(0.5)
        assert not waiting.done(), "the wait returned with a save in flight"
        gate.release.set()
        assert waiting.result(timeout=10) == 0
        assert saves_in_flight(tmp_path) == []
        published = [p.name for p in tmp_path.iterdir()]
        assert published == (["10"] if how == "step-dir" else ["j-s10-n0-w0.save"])


def test_at_its_timeout_the_wait_names_the_saves_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "step=30-unfinished").mkdir()  # a trainer's save that never ends
    (tmp_path / "job-s30-n1-w0.save.tmp").write_bytes(b"partial")
    started = time.monotonic()
    assert main(["--dir", str(tmp_path), "--timeout", "0.4"]) == 1
    assert 0.4 <= time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert "job-s30-n1-w0.save.tmp, step=30-unfinished" in err


def test_what_is_not_our_client_s_is_not_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Orbax's temporary, the PyTorch reference client's step, a published step.
    for name in ("40.orbax-checkpoint-tmp-1234", "step=40", "30"):
        (tmp_path / name).mkdir()
    monkeypatch.setenv("MTC_CHECKPOINT_DIR", str(tmp_path))
    started = time.monotonic()
    assert main([]) == 0
    assert time.monotonic() - started < 2


def test_a_save_that_starts_during_the_wait_is_waited_for(tmp_path: Path) -> None:
    (tmp_path / "step=40-unfinished").mkdir()

    def next_save() -> None:  # step 50's save starts before step 40's is published
        (tmp_path / "step=50-unfinished").mkdir()
        (tmp_path / "step=40-unfinished").rename(tmp_path / "40")
        time.sleep(0.6)
        (tmp_path / "step=50-unfinished").rename(tmp_path / "50")

    threading.Timer(0.3, next_save).start()
    assert main(["--dir", str(tmp_path), "--timeout", "10"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["40", "50"]


def test_without_a_directory_it_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTC_CHECKPOINT_DIR", raising=False)
    monkeypatch.delenv("CHECKPOINT_DIR", raising=False)
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
