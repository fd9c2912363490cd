"""Start and stop a real ``mtc-csi`` plugin process (``python -m mtc_replicator.csi``) for the CSI
tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mtc_replicator.csi.plugin import READY_LINE

ROOT = Path(__file__).resolve().parents[2]


class PluginProcess:
    """One plugin process; its log (stdout and stderr) goes to ``log_path``."""

    def __init__(
        self,
        socket_path: Path,
        ram_dir: Path,
        ram_size: str,
        log_path: Path,
        args: Sequence[str] = (),
    ) -> None:
        self.socket_path = socket_path
        self.args = tuple(args)
        """More flags (``--allowed-namespaces``...)."""
        self.ram_dir = ram_dir
        self.ram_size = ram_size
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._offset = 0
        """Where this process's lines start in a log file that restarts share."""

    def start(self, timeout: float = 20.0) -> PluginProcess:
        """Start and wait for the ready line (the socket is listening by then)."""
        args = [
            sys.executable,
            "-m",
            "mtc_replicator.csi",
            "--endpoint",
            f"unix://{self.socket_path}",
            "--node-id",
            "node-a",
            "--ram-dir",
            str(self.ram_dir),
            "--ram-size",
            self.ram_size,
            "--log-level",
            "DEBUG",
            *self.args,
        ]
        self._offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ)
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self.log():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"plugin exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.02)
        raise TimeoutError(f"plugin not ready after {timeout}s:\n{self.log()}")

    def run_to_exit(self, timeout: float = 20.0) -> int:
        """Start a plugin that is expected to fail at start; its exit code."""
        try:
            self.start(timeout)
        except RuntimeError:
            assert self.proc is not None
            return self.proc.returncode
        raise AssertionError(f"plugin started, expected a failure:\n{self.log()}")

    def log(self) -> str:
        """What this process has logged so far."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(self._offset)
            return f.read().decode(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def kill(self) -> None:
        """SIGKILL: a crash, which leaves the socket file behind."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
