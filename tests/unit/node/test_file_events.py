"""``node.file_events``: the set of ``.save`` files closed after writing
(``ctx.closed_files``), as the real watch fills it.

A name is in the set from its close (or its rename into place) until anything else
happens to that name: a write, a removal, a rename away, or a new file made under it. So a
``.save`` removed and made again in place is not "closed" before its writer's first byte
(a listing then would take it empty), and a pod that makes and removes ``.save`` files
under ever new names leaves nothing in the daemon's memory.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mtc_replicator.core.contract import parse_config
from mtc_replicator.core.policy import Entry, find_handoffs
from mtc_replicator.local.watcher import DirectoryWatcher
from mtc_replicator.node.file_events import FileEvents


def _supervisor() -> Any:
    handshake = SimpleNamespace(event=lambda finished, renamed: None)
    return SimpleNamespace(
        handshake=handshake, ctx=SimpleNamespace(closed_files=set()), incarnation=None
    )


async def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _run(tmp_path: Path, body: Any) -> None:
    async def main() -> None:
        supervisor = _supervisor()
        watcher = DirectoryWatcher(tmp_path, FileEvents(asyncio.Event()).of(supervisor))
        watcher.start(asyncio.get_running_loop())
        try:
            await body(supervisor.ctx.closed_files)
        finally:
            watcher.stop()

    asyncio.run(main())


def test_a_save_file_made_again_in_place_is_not_finished_before_its_first_write(
    tmp_path: Path,
) -> None:
    name = "j-s7-n0-w0.save"
    path = tmp_path / name
    config = parse_config(
        "job-name: j\nframework: pytorch\nnode-rank: 0\nnodes: 1\nbackup-interval-minutes: 30\n"
    )

    async def body(closed: set[str]) -> None:
        path.write_bytes(b"first")
        await _until(lambda: name in closed)
        path.unlink()  # the pod removes it (or it went before the daemon could take it)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # a new writer, no byte yet
        try:
            (tmp_path / "sentinel-s0-n0-w0.save").write_bytes(b"x")  # events come in order
            await _until(lambda: "sentinel-s0-n0-w0.save" in closed)
            st = path.stat()
            entries = [Entry(name, False, True, st.st_mtime)]
            # Written a moment ago and not closed: nothing is finished yet.
            assert find_handoffs(config, entries, set(closed), time.time(), 30.0) == []
        finally:
            os.close(fd)

    _run(tmp_path, body)


def test_saves_made_and_removed_leave_nothing_behind(tmp_path: Path) -> None:
    async def body(closed: set[str]) -> None:
        for i in range(300):
            p = tmp_path / f"other-s{i}-n3-w0.save"
            p.write_bytes(b"x")
            p.unlink()
        (tmp_path / "sentinel-s0-n0-w0.save").write_bytes(b"x")
        await _until(lambda: "sentinel-s0-n0-w0.save" in closed)
        assert closed == {"sentinel-s0-n0-w0.save"}, f"{len(closed)} names kept"

    _run(tmp_path, body)
