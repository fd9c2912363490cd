"""The metrics and health HTTP server under hostile clients: connections that never finish
their request. Against a real daemon process, and the server in this process with a small
cap to show which connection gives way.

Before the bound, 250 unfinished requests held 268 threads of the daemon for as long as
their clients liked (one thread per connection, no read timeout, no cap).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from mtc_replicator.obs.httpserver import MAX_CONNECTIONS, REQUEST_SECONDS
from mtc_replicator.obs.metrics_endpoint import serve, split_address
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.integration

PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
"""A request whose headers never end."""


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def get(address: str, path: str = "/healthz") -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
        return response.status, response.read()


@contextlib.contextmanager
def partial_requests(address: str, count: int) -> Iterator[list[socket.socket]]:
    host, port = split_address(address)
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(PARTIAL)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_300_unfinished_requests_hold_bounded_threads_and_are_closed(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ckpt", extra_args=("--metrics", "127.0.0.1:0")) as daemon:
        assert daemon.metrics is not None
        before = threads(daemon.pid)
        opened = time.monotonic()
        with partial_requests(daemon.metrics, 300) as socks:
            time.sleep(1.0)  # let the server take them all
            held = threads(daemon.pid)
            assert held <= before + MAX_CONNECTIONS + 2, (before, held)
            assert get(daemon.metrics) == (200, b"ok\n"), "a probe still gets through"
            wait_until(
                lambda: all(closed_by_server(s) for s in socks),
                "every unfinished request closed by the server",
                daemon=daemon,
                timeout=REQUEST_SECONDS + 10,
            )
            assert time.monotonic() - opened <= REQUEST_SECONDS + 10
        wait_until(
            lambda: threads(daemon.pid) <= before + 2,
            "the connection threads ended",
            daemon=daemon,
            timeout=10,
        )
        assert get(daemon.metrics, "/readyz")[0] == 200
        assert "Traceback" not in daemon.log()
        assert "Exception occurred" not in daemon.log(), "a client must not fill the log"


def test_at_the_cap_the_oldest_unfinished_request_gives_way() -> None:
    server = serve(CollectorRegistry(), "127.0.0.1:0", max_connections=4, request_seconds=30)
    try:
        with partial_requests(server.address, 4) as socks:
            time.sleep(0.3)
            assert not any(closed_by_server(s) for s in socks)
            assert get(server.address) == (200, b"ok\n")
            # The probe took the oldest one's slot; the other three still wait for their
            # headers (30 s).
            time.sleep(0.3)
            assert [closed_by_server(s) for s in socks] == [True, False, False, False]
    finally:
        server.close()


def test_a_dripping_request_is_cut_at_the_whole_request_deadline() -> None:
    server = serve(CollectorRegistry(), "127.0.0.1:0", request_seconds=1.5)
    try:
        with partial_requests(server.address, 1) as (sock,):
            started = time.monotonic()
            while not closed_by_server(sock) and time.monotonic() - started < 6:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X")  # one byte every 0.2 s: never idle for a read timeout
                time.sleep(0.2)
            assert closed_by_server(sock)
            assert time.monotonic() - started < 3.0
    finally:
        server.close()
