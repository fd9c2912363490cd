"""When a handshake is judged complete: at once when renamed into place, after a double read
when written in place. In-process (the daemon's own ``Supervisor.check_config`` on real
files), so no timing is involved: the test says which event was seen and counts the reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mtc_replicator.core.contract import CONFIG_FILE, JobConfig
from mtc_replicator.node.daemon import Daemon
from mtc_replicator.node.options import DaemonOptions
from tests.integration.helpers import config_text, write_yaml_atomic

pytestmark = pytest.mark.integration


class _Recorder:
    def __init__(self) -> None:
        self.accepted: list[str] = []

    async def __call__(self, config: JobConfig, text: str, seen_at: float | None = None) -> None:
        self.accepted.append(text)


def _daemon(ckpt: Path) -> tuple[Daemon, _Recorder]:
    daemon = Daemon(DaemonOptions(checkpoint_dir=ckpt, listen="127.0.0.1:0"))
    recorder = _Recorder()
    daemon.supervisor._accept = recorder  # type: ignore[method-assign]
    return daemon, recorder


def test_a_yaml_renamed_into_place_is_accepted_at_the_first_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    daemon, recorder = _daemon(ckpt)
    text = config_text("job-a", rank=0, nodes=2)
    write_yaml_atomic(ckpt, text)
    daemon._on_event(CONFIG_FILE, True, True)  # what the watcher reports for the rename
    try:
        asyncio.run(daemon.supervisor.check_config())
    finally:
        daemon.executor.shutdown()
    assert recorder.accepted == [text], "a complete (renamed) handshake waited for a re-read"


@pytest.mark.parametrize("renamed", [False, True])
def test_a_yaml_written_in_place_still_needs_two_equal_reads(tmp_path: Path, renamed: bool) -> None:
    """Closed after an in-place write (or written to after its rename): the first read may
    be a half that parses, so it is never judged at the first read."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    daemon, recorder = _daemon(ckpt)
    text = config_text("job-a", rank=0, nodes=2)
    if renamed:
        write_yaml_atomic(ckpt, text)
        daemon._on_event(CONFIG_FILE, True, True)
        daemon._on_event(CONFIG_FILE, False, False)  # then written to in place
    else:
        (ckpt / CONFIG_FILE).write_text(text)
        daemon._on_event(CONFIG_FILE, True, False)  # closed after writing
    try:
        asyncio.run(daemon.supervisor.check_config())
        assert recorder.accepted == []
    finally:
        daemon.executor.shutdown()
