"""The HTTP endpoint of a process's metrics: ``/metrics``, ``/healthz`` and ``/readyz``. I/O module.

``serve`` exposes a ``CollectorRegistry`` and a ``Health`` from a thread through the bounded
server of ``obs.httpserver``; the daemon and the CSI plugin both serve this way. What is
recorded is ``obs.metrics``'s; what the probes say is ``obs.health``'s.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from mtc_replicator.obs.health import Health
from mtc_replicator.obs.httpserver import (
    MAX_CONNECTIONS,
    REQUEST_SECONDS,
    BoundedHandler,
    BoundedWSGIServer,
)


class MetricsError(Exception):
    """The metrics endpoint cannot be served (a bad address, or the port is taken)."""


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9464`` for IPv6) as (host, port); raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


@dataclass
class MetricsServer:
    """``/metrics`` served over HTTP by a daemon thread; ``address`` has the bound port."""

    address: str
    _httpd: WSGIServer
    _thread: threading.Thread

    def close(self, timeout: float = 5.0) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)


Environ = dict[str, Any]
StartResponse = Callable[..., Any]
App = Callable[[Environ, StartResponse], list[bytes]]


def _app(
    registry: CollectorRegistry, health: Health
) -> Callable[[Environ, StartResponse], list[bytes]]:
    """``/metrics``; ``/healthz`` (liveness) and ``/readyz`` (readiness): 200 ``ok`` or 503
    with one line per problem; 404 for any other path."""
    metrics = make_wsgi_app(registry)

    def probe(problems: list[str], start_response: StartResponse) -> list[bytes]:
        body = ("\n".join(problems) if problems else "ok").encode() + b"\n"
        status = "503 Service Unavailable" if problems else "200 OK"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [body]

    def app(environ: Environ, start_response: StartResponse) -> list[bytes]:
        said: list[tuple[str, list[tuple[str, str]]]] = []
        body = route(environ, lambda status, headers, *_: said.append((status, headers)))
        status, headers = said[-1]
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers = [*headers, ("Content-Length", str(sum(map(len, body))))]
        start_response(status, headers)
        # HEAD: the same status and headers (Content-Length included), no body (RFC 9110).
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else body

    def route(environ: Environ, start_response: StartResponse) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            # prometheus_client answers HEAD with 405 and a body: serve it as GET instead.
            if environ.get("REQUEST_METHOD") == "HEAD":
                environ = {**environ, "REQUEST_METHOD": "GET"}
            return list(metrics(environ, start_response))
        if path == "/healthz":
            return probe(health.liveness(), start_response)
        if path == "/readyz":
            return probe(health.readiness(), start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics, /healthz or /readyz\n"]

    return app


def serve(
    registry: CollectorRegistry,
    address: str,
    health: Health | None = None,
    *,
    max_connections: int = MAX_CONNECTIONS,
    request_seconds: float = REQUEST_SECONDS,
) -> MetricsServer:
    """Serve ``registry`` at ``http://address/metrics``, and ``health`` at ``/healthz`` and
    ``/readyz`` (None: both always ``ok``), from a thread (port 0: a free port), at most
    ``max_connections`` at once, each for ``request_seconds`` at most (``obs.httpserver``)."""
    app = _app(registry, health or Health())
    try:
        host, port = split_address(address)
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class Server(BoundedWSGIServer):
            address_family = family

        Server.max_connections, Server.request_seconds = max_connections, request_seconds
        httpd = make_server(str(sockaddr[0]), port, app, Server, handler_class=BoundedHandler)
    except (ValueError, OSError) as exc:
        raise MetricsError(f"cannot serve metrics on {address}: {exc}") from None
    thread = threading.Thread(target=httpd.serve_forever, name="mtc-metrics", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(f"{shown}:{httpd.server_port}", httpd, thread)
