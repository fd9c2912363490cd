"""The plugin's gRPC server on a unix socket: endpoint parsing, the stale-socket check, one
logging interceptor, start and a bounded graceful stop. I/O module.

A synchronous server with a small thread pool: mount calls block, kubelet sends a handful of
calls at a time, and per-target locking (``mtc_replicator.csi.volumes``) keeps concurrent calls
apart.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from mtc_replicator.csi.call_metrics import NO_CALL_METRICS, CallMetrics

log = logging.getLogger(__name__)

_QUIET_WHEN_OK = frozenset(
    {
        "/csi.v1.Identity/Probe",
        "/csi.v1.Identity/GetPluginInfo",
        "/csi.v1.Identity/GetPluginCapabilities",
        "/csi.v1.Node/NodeGetCapabilities",
    }
)
"""Polled every few seconds by kubelet and the sidecars: logged at DEBUG unless they fail."""


class EndpointError(Exception):
    """The endpoint is not a usable unix socket path."""


def parse_endpoint(endpoint: str) -> Path:
    """The socket path of ``unix:///abs/path``, ``unix:/abs/path`` or ``/abs/path``."""
    if endpoint.startswith("unix://"):
        path = endpoint.removeprefix("unix://")
    elif endpoint.startswith("unix:"):
        path = endpoint.removeprefix("unix:")
    elif "://" in endpoint:
        raise EndpointError(f"only unix sockets are served, got {endpoint!r}")
    else:
        path = endpoint
    if not path.startswith("/"):
        raise EndpointError(f"the socket path must be absolute, got {endpoint!r}")
    return Path(path)


def remove_stale_socket(path: Path) -> bool:
    """Delete a socket file left by a plugin that is gone; True when one was removed.

    A socket someone still accepts on is not stale (two plugins must not share one), and a
    file that is not a socket is not ours to delete.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise EndpointError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)
            return True
    raise EndpointError(f"another process is serving on {path}")


class LoggingInterceptor(grpc.ServerInterceptor):
    """One line per call: method, status code and duration; the same into ``metrics``."""

    def __init__(self, metrics: CallMetrics = NO_CALL_METRICS) -> None:
        self.metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED) or a stream
        method = handler_call_details.method
        short = method.rsplit("/", 1)[-1]
        behavior = handler.unary_unary
        metrics = self.metrics

        def logged(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.monotonic()
            failed = True
            try:
                response = behavior(request, context)
                failed = False
            finally:
                seconds = time.monotonic() - start
                metrics.call(short, _log_call(method, context, failed, seconds).name, seconds)
            return response

        return grpc.unary_unary_rpc_method_handler(
            logged,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _log_call(
    method: str, context: grpc.ServicerContext, failed: bool, seconds: float
) -> grpc.StatusCode:
    """Log one call; its status code."""
    # grpc's server context has code() and details(); the type stubs do not declare them.
    code: grpc.StatusCode | None = getattr(context, "code", lambda: None)()
    if code is None:
        code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
    if code is grpc.StatusCode.OK:
        level = logging.DEBUG if method in _QUIET_WHEN_OK else logging.INFO
        log.log(level, "rpc %s %s %.1fms", method, code.name, seconds * 1000)
        return code
    details: Any = getattr(context, "details", lambda: None)()
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    log.warning("rpc %s %s %.1fms: %s", method, code.name, seconds * 1000, details or "")
    return code


class CsiServer:
    """A gRPC server on one unix socket; services register before ``start``."""

    def __init__(
        self, socket_path: Path, workers: int = 4, metrics: CallMetrics = NO_CALL_METRICS
    ) -> None:
        self.socket_path = socket_path
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="csi-rpc"),
            interceptors=[LoggingInterceptor(metrics)],
        )
        self._started = False

    def add(self, register: Callable[[grpc.Server], None]) -> None:
        """``register`` adds one servicer (``add_XServicer_to_server``)."""
        register(self._server)

    def start(self) -> None:
        """Remove a stale socket, bind, serve; raises ``EndpointError`` when it cannot."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if remove_stale_socket(self.socket_path):
            log.info("removed a stale socket at %s", self.socket_path)
        try:
            port = self._server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError as exc:
            raise EndpointError(f"cannot listen on {self.socket_path}: {exc}") from None
        if port == 0:  # pragma: no cover - gRPC reports a failed unix bind this way too
            raise EndpointError(f"cannot listen on {self.socket_path}")
        self._server.start()
        self._started = True

    def stop(self, grace: float) -> None:
        """Refuse new calls, let calls in flight finish for ``grace`` seconds, remove the
        socket so nothing dials a dead endpoint."""
        if not self._started:
            return
        self._started = False
        self._server.stop(grace).wait()
        with contextlib.suppress(OSError):
            self.socket_path.unlink()
