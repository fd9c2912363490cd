"""The HTTP server behind ``/metrics``, ``/healthz`` and ``/readyz``: bounded. I/O module.

The standard library's threading WSGI server runs one thread per connection with no read
timeout and no cap: 250 connections that never finish their request held 268 threads for
as long as their clients liked. Here a connection gets ``request_seconds`` in all (not per
read: a client dripping one byte a second gets no more), and at most ``max_connections``
are open at once. At the cap, a new connection makes room by closing the oldest one that
has not sent its whole request yet, so a probe (one small request, answered at once) still
gets through while idle connections hold every slot; when every open connection is being
answered, the new one is closed unanswered. The daemon and the CSI plugin both serve
through ``obs.metrics_endpoint.serve``, so both are bounded alike.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
"""Open connections at most: Prometheus and the kubelet each hold one at a time."""
REQUEST_SECONDS = 10.0
"""A connection's whole life: its request read and its answer written. kubelet's probes
time out after 1 s by default and a scrape of this daemon takes milliseconds."""


@dataclass
class _Open:
    deadline: float
    reading: bool = True
    """Whether its request is still being read (the connections that may be evicted)."""


class BoundedWSGIServer(ThreadingWSGIServer):
    """``ThreadingWSGIServer`` with a connection cap and a whole-request deadline."""

    max_connections = MAX_CONNECTIONS
    request_queue_size = 128
    """The listen backlog (socketserver's 5 makes a burst of connects wait for SYN retries)."""
    request_seconds = REQUEST_SECONDS
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._open: dict[socket.socket, _Open] = {}
        self._changed = threading.Condition()
        self._closing = False
        self._reaper = threading.Thread(target=self._reap, name="mtc-http-reaper", daemon=True)
        super().__init__(*args, **kwargs)  # a failed bind calls server_close from here
        self._reaper.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """Admit the connection (evicting the oldest one still reading at the cap) or close
        it; the handler's thread starts only for an admitted one."""
        now = self.clock()
        with self._changed:
            if len(self._open) >= self.max_connections:
                reading = [(o.deadline, s) for s, o in self._open.items() if o.reading]
                if not reading:
                    self.shutdown_request(request)
                    return
                _, oldest = min(reading, key=lambda pair: pair[0])
                _cut(oldest)
                del self._open[oldest]  # its thread still ends; the slot is free now
            self._open[request] = _Open(now + self.request_seconds)
            self._changed.notify()
        super().process_request(request, client_address)

    def request_read(self, request: Any) -> None:
        """The handler read the whole request: from now on it is answered, not evicted."""
        with self._changed:
            held = self._open.get(request)
            if held is not None:
                held.reading = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One debug line, not socketserver's traceback on stderr: a connection this server
        cut, or a client that hung up, is routine, and a client must not fill the log."""
        log.debug("HTTP connection from %s ended: %s", client_address, sys.exc_info()[1])

    def shutdown_request(self, request: Any) -> None:
        with self._changed:
            self._open.pop(request, None)
        super().shutdown_request(request)

    def server_close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify()
        super().server_close()
        if self._reaper.ident is not None:
            self._reaper.join(5.0)

    def _reap(self) -> None:
        """Cut every connection past its deadline; sleep until the next one is due."""
        with self._changed:
            while not self._closing:
                now = self.clock()
                for sock, held in list(self._open.items()):
                    if held.deadline <= now:
                        _cut(sock)
                        del self._open[sock]
                due = min((o.deadline for o in self._open.values()), default=None)
                self._changed.wait(None if due is None else max(due - now, 0.01))


def _cut(sock: socket.socket) -> None:
    """Unblock the handler's read or write at once; its thread then closes the socket."""
    with contextlib.suppress(OSError):  # already closed by its thread
        sock.shutdown(socket.SHUT_RDWR)


class BoundedHandler(WSGIRequestHandler):
    """Reads with the server's deadline as the socket timeout too, and tells the server when
    the request is read. No access log: Prometheus and kubelet poll every few seconds."""

    server: BoundedWSGIServer
    timeout = REQUEST_SECONDS

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            self.server.request_read(self.request)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        pass
