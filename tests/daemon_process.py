"""Start and stop a real ``mtc-replicator`` daemon process for integration tests."""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_LINE = "daemon started"
_READY_RE = re.compile(rb"daemon started:.* listen=(\S+) advertise=(\S+) backup=")
_METRICS_RE = re.compile(rb"daemon started:.* metrics=(\S+)")


def _default_log(checkpoint_dir: Path) -> Path:
    """Beside CHECKPOINT_DIR, or beside its RAM disk when that is a mount: never on a small
    tmpfs that a test fills up."""
    parent = checkpoint_dir.parent
    if os.path.ismount(parent):
        return parent.parent / f"{parent.name}-{checkpoint_dir.name}.daemon.log"
    return parent / f"{checkpoint_dir.name}.daemon.log"


class DaemonProcess:
    """One real daemon process on ``checkpoint_dir``; its log goes to ``log_path``."""

    def __init__(
        self,
        checkpoint_dir: Path,
        *,
        backup: str | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        max_open_files: int | None = None,
        prefix: tuple[str, ...] = (),
        listen: str = "127.0.0.1:0",
        make_checkpoint_dir: bool = True,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.make_checkpoint_dir = make_checkpoint_dir
        """Create CHECKPOINT_DIR before each start, as the CSI plugin does on a node (the
        daemon refuses one that does not exist)."""
        self.backup = backup
        self.extra_args = extra_args
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or _default_log(checkpoint_dir)
        self.max_open_files = max_open_files
        """RLIMIT_NOFILE of the daemon, when given (a node with a low descriptor limit)."""
        self.prefix = prefix
        """A command the daemon runs under (``ip netns exec NS``: a node of its own network)."""
        self.listen_arg = listen
        self.proc: subprocess.Popen[bytes] | None = None
        self.listen: str | None = None
        """The gRPC address the daemon bound (its ``127.0.0.1:0`` resolved), once ready."""
        self.advertise: str | None = None
        self.metrics: str | None = None
        """Where the daemon serves ``/metrics`` (``--metrics``, port 0 resolved), once ready."""

    def start(self, timeout: float = 30.0) -> DaemonProcess:
        if self.make_checkpoint_dir:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        args = [
            *self.prefix,
            sys.executable,
            "-m",
            "mtc_replicator.node.daemon",
            "--checkpoint-dir",
            str(self.checkpoint_dir),
            "--listen",
            self.listen_arg,
            *(["--backup", self.backup] if self.backup else []),
            *self.extra_args,
        ]
        start_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if self.max_open_files is not None:
            # Set from outside at once (no preexec_fn in a threaded parent); the daemon opens
            # few descriptors before its store.
            limit = (self.max_open_files, self.max_open_files)
            resource.prlimit(self.proc.pid, resource.RLIMIT_NOFILE, limit)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            with self.log_path.open("rb") as f:
                f.seek(start_offset)
                text = f.read()
            ready = _READY_RE.search(text)
            if ready:
                self.listen, self.advertise = (g.decode() for g in ready.groups())
                metrics = _METRICS_RE.search(text)
                self.metrics = metrics[1].decode() if metrics and metrics[1] != b"None" else None
                return self
            time.sleep(0.05)
        raise TimeoutError(f"daemon not ready after {timeout}s:\n{self.log()}")

    @property
    def address(self) -> str:
        """Where to dial this daemon's gRPC services."""
        assert self.listen is not None, "the daemon has not started"
        return self.listen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
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
        """SIGKILL: the crash case."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the daemon has not started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.stop()
