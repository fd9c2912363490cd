"""``client.finish_job`` against a small in-test daemon that ends the job as docs/protocol.md
says (an empty ``replicator.yaml``: stop serving the job); the real daemon's drain is in
tests/integration/test_job_end.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from mtc_replicator.client import HandshakeTimeout, finish_job
from mtc_replicator.core import contract
from tests.unit.client.test_handshake import FakeClock


def test_it_returns_once_the_daemon_consumed_the_empty_yaml_with_its_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    yaml = tmp_path / contract.CONFIG_FILE

    def daemon() -> None:  # the drain's outcome, then the yaml goes: the client's cue
        while not yaml.exists():
            threading.Event().wait(0.001)
        seen.append(yaml.read_text())
        (tmp_path / contract.ERRORS_FILE).write_text("job x stopped; step 20 not in the backup\n")
        yaml.unlink()

    thread = threading.Thread(target=daemon, daemon=True)
    thread.start()
    with caplog.at_level(logging.WARNING):
        lines = finish_job(tmp_path, timeout=10, poll_interval=0.001)
    thread.join(timeout=10)
    assert seen == [""]  # empty, and renamed in whole: no temp file left
    assert lines == ["job x stopped; step 20 not in the backup"]
    assert "replicator: job x stopped" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_it_waits_for_a_pending_handshake_first_and_times_out_without_a_daemon(
    tmp_path: Path,
) -> None:
    pending = tmp_path / contract.CONFIG_FILE
    pending.write_text("job-name: other\n")
    clock = FakeClock()
    with pytest.raises(HandshakeTimeout, match="not consumed within 5 s"):
        finish_job(tmp_path, timeout=5, clock=clock, sleep=clock.sleep)
    assert pending.read_text() == "job-name: other\n"  # never overwritten
    pending.unlink()
    with pytest.raises(HandshakeTimeout, match="is the replicator daemon running"):
        finish_job(tmp_path, timeout=5, clock=clock, sleep=clock.sleep)
    assert pending.read_text() == ""
    with pytest.raises(FileNotFoundError, match="is the replicator's volume mounted"):
        finish_job(tmp_path / "nope")
