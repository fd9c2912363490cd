"""A SIGTERM that lands while ``AsyncSaver`` is starting a save's writer thread
(after the save was recorded as in flight, before the thread ran) must not hang the
handler: it waited forever for a thread that cannot start until the handler returns."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading
    import torch
    from mtc_replicator.client import async_save

    seen = []
    signal.signal(signal.SIGTERM, lambda s, f: seen.append("previous"))

    class SignalledThread(threading.Thread):
        def start(self):
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, in the main thread
            super().start()

    async_save.threading.Thread = SignalledThread
    saver = async_save.AsyncSaver(sys.argv[1])
    saver.finish_on_sigterm()
    saver.save_state_dict(1, {"w": torch.ones(10)})
    saver.close()
    assert seen == ["previous"], seen
    assert os.path.isfile(os.path.join(sys.argv[1], "1", "state.pt"))
    print("ok")
    """
)


def test_sigterm_while_the_writer_thread_starts_does_not_hang(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]
    try:
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tmp_path)],
            cwd=root,
            env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the SIGTERM handler hung waiting for a writer thread not yet started")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
