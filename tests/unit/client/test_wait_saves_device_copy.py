"""An asynchronous ``save_file`` must be visible to the preStop wait
(``wait_saves``) from the moment the call returns, also while the background thread still
waits for the snapshot's device copies (CUDA tensors: ``Snapshot.ready``), which takes
about a second per 10-20 GiB. Before, its ``.save.tmp`` was created only after that wait,
so the hook saw no save in flight and let the pod be killed mid-save."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from mtc_replicator.client import AsyncSaver
from mtc_replicator.client.staging import Snapshot
from mtc_replicator.client.wait_saves import wait_for_saves
from tests.unit.client.test_async_save import state


def test_a_save_waiting_for_its_device_copies_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ready = Snapshot.ready

    def slow_device_copies(self: Snapshot) -> None:
        time.sleep(1.0)  # what a few GiB of device-to-host copies take
        ready(self)

    monkeypatch.setattr(Snapshot, "ready", slow_device_copies)
    with AsyncSaver(tmp_path) as saver:
        saver.save_file(5, state(), job="j", rank=0, worker=0)
        time.sleep(0.05)  # the writer thread has started
        left = wait_for_saves(tmp_path, timeout=10)
        assert left == []
        assert (tmp_path / "j-s5-n0-w0.save").is_file(), (
            "the preStop wait returned while the save was still waiting for its copies"
        )
