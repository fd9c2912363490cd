"""A faulty object store for chaos trials: the fault proxy of ``tests/storage_servers.py``
in front of moto (S3) or the GCS emulator, and a ``file://`` backup on a tiny tmpfs.

A fault is a window: ``begin(mode)`` until ``end()``. While it is open the proxy answers a
seeded share of requests with the fault, the rest pass (a real service degrades, it rarely
refuses everything). Modes:

- ``slowdown``: 503 with the vendor's throttling error (S3 ``SlowDown``, GCS ``rateLimitExceeded``);
- ``reset``: the request is read, then the connection is reset with no answer (an upload
  cut mid-call);
- ``cut``: a download's body stops halfway and the connection drops;
- ``latency``: every request waits 0.2-1.5 s before it is forwarded;
- ``full`` (``file://`` only): the backup's filesystem is filled to the last byte.

Does I/O (a proxy thread, files).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from pathlib import Path

from tests.storage_servers import (
    FaultProxy,
    Reply,
    Request,
    Rule,
    gcs_create_only,
    gcs_error,
    s3_error,
)

PROXY_MODES = ("slowdown", "reset", "cut", "latency")
SHARE = 0.5
"""The share of requests a fault window hits."""


class StoreFaults:
    """The proxy of one trial's bucket and its fault window."""

    def __init__(self, vendor: str, upstream: str, seed: int, host: str) -> None:
        self.vendor = vendor
        self.mode = ""
        self.hits = 0
        """Requests the fault windows answered (or slowed) so far."""
        self._rng = random.Random(f"store/{seed}")
        self._lock = threading.Lock()
        rules: list[Rule] = [self._rule]
        if vendor == "gcs":
            rules.append(gcs_create_only)  # the emulator ignores ifGenerationMatch=0
        self.proxy = FaultProxy(upstream, rules, [self._reply_rule], host=host).start()

    @property
    def url(self) -> str:
        return self.proxy.url

    def begin(self, mode: str) -> None:
        assert mode in PROXY_MODES, mode
        self.mode = mode

    def end(self) -> None:
        self.mode = ""

    def close(self) -> None:
        self.proxy.stop()

    def _hit(self) -> bool:
        with self._lock:
            hit = self._rng.random() < SHARE
            self.hits += hit
            return hit

    def _rule(self, req: Request, _: FaultProxy) -> Reply | None:
        mode = self.mode
        if mode == "latency":
            with self._lock:
                wait = self._rng.uniform(0.2, 1.5)
                self.hits += 1
            time.sleep(wait)
            return None
        if mode == "slowdown" and self._hit():
            if self.vendor == "s3":
                body = s3_error("SlowDown", "Please reduce your request rate.")
                return Reply(503, [("Content-Type", "application/xml")], body)
            body = gcs_error(503, "rateLimitExceeded", "The service is currently unavailable.")
            return Reply(503, [("Content-Type", "application/json")], body)
        if mode == "reset" and req.method in ("PUT", "POST") and self._hit():
            return Reply(0, reset=True)
        return None

    def _reply_rule(self, req: Request, reply: Reply) -> Reply:
        if (
            self.mode == "cut"
            and req.method == "GET"
            and reply.status < 300
            and len(reply.body) > 64
            and self._hit()
        ):
            reply.cut_after = len(reply.body) // 2
        return reply


class FullDisk:
    """A ``file://`` backup on its own small tmpfs; ``begin`` fills it, ``end`` frees it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ballast = path.parent / f".{path.name}-ballast"
        self.mode = ""

    def begin(self, mode: str) -> None:
        assert mode == "full", mode
        self.mode = mode
        # A file on the same filesystem (the tmpfs's root, beside the backup directory),
        # written unbuffered so that every byte the filesystem takes stays taken.
        fd = os.open(self._ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):  # ENOSPC: full, as wanted
                    while True:
                        os.write(fd, b"\0" * size)
        finally:
            os.close(fd)

    def end(self) -> None:
        self.mode = ""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._ballast)

    def close(self) -> None:
        self.end()
