"""When a handshake is judged complete: at once when renamed into place, after a double read
when written in place. In-process (the daemon's own ``Supervisor.check_config`` on real
files, wired as the daemon wires it), so no timing is involved: the test says which event
was seen and counts the reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mtc_replicator.core.contract import CONFIG_FILE, JobConfig
from mtc_replicator.node.daemon import Daemon
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.transport.grpc_server import RpcServer
from tests.integration.helpers import config_text, write_yaml_atomic

pytestmark = pytest.mark.integration

Event = tuple[bool, bool]
"""``(finished, renamed)``: what the watcher reports of ``replicator.yaml``."""


class _Recorder:
    def __init__(self) -> None:
        self.accepted: list[str] = []

    async def __call__(self, config: JobConfig, text: str, seen_at: float | None = None) -> None:
        self.accepted.append(text)


def _accepted(ckpt: Path, events: list[Event]) -> list[str]:
    """The root's parts wired as the daemon wires them (on a server never started), the
    ``events`` seen, then one check of the handshake: what it accepted."""

    async def body() -> list[str]:
        daemon = Daemon(DaemonOptions(checkpoint_dir=ckpt, listen="127.0.0.1:0"))
        wired = daemon.wire(RpcServer(), None, "127.0.0.1:7070")
        recorder = _Recorder()
        wired.supervisor._accept = recorder  # type: ignore[method-assign]
        for finished, renamed in events:
            wired.events.event(wired.supervisor, CONFIG_FILE, finished, renamed)
        try:
            await wired.supervisor.check_config()
        finally:
            daemon.parts.executor.shutdown()
        return recorder.accepted

    return asyncio.run(body())


def test_a_yaml_renamed_into_place_is_accepted_at_the_first_read(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    text = config_text("job-a", rank=0, nodes=2)
    write_yaml_atomic(ckpt, text)
    accepted = _accepted(ckpt, [(True, True)])  # what the watcher reports for the rename
    assert accepted == [text], "a complete (renamed) handshake waited for a re-read"


@pytest.mark.parametrize("renamed", [False, True])
def test_a_yaml_written_in_place_still_needs_two_equal_reads(tmp_path: Path, renamed: bool) -> None:
    """Closed after an in-place write (or written to after its rename): the first read may
    be a half that parses, so it is never judged at the first read."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    text = config_text("job-a", rank=0, nodes=2)
    if renamed:
        write_yaml_atomic(ckpt, text)
        events = [(True, True), (False, False)]  # then written to in place
    else:
        (ckpt / CONFIG_FILE).write_text(text)
        events = [(True, False)]  # closed after writing
    assert _accepted(ckpt, events) == []
