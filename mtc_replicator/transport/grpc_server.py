"""The daemon's one gRPC port: our services plus the standard health service. I/O module.

Owns the server's lifecycle: bind (port 0 resolves to the real port), start, report
SERVING once the daemon is ready, and a bounded graceful stop (health turns NOT_SERVING
first, so load balancers and peers stop choosing this node before calls are cut).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtc_replicator.transport.peerwire import SERVER_OPTIONS

log = logging.getLogger(__name__)

READINESS_SERVICE = "readiness"
"""The health service name kubelet's readiness probe asks: SERVING while the daemon's
readiness checks pass (``/readyz``), where ``""`` stays SERVING as long as the loop answers."""


class ServerError(Exception):
    """The gRPC server cannot serve (for example, the address is taken)."""


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class RpcServer:
    """A grpc.aio server in the running loop; services register before ``start``."""

    def __init__(self, interceptor: grpc.aio.ServerInterceptor | None = None) -> None:
        """``interceptor`` sees every call first (``transport.identity``: who the caller is)."""
        self._server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=[interceptor] if interceptor else None
        )
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._services: list[str] = []
        self._started = False
        self._health_server: grpc.aio.Server | None = None

    def add_service(self, name: str, register: Callable[[grpc.aio.Server], None]) -> None:
        """``register`` adds the servicer (``add_XServicer_to_server``); ``name`` is the full
        service name health checks use (``mtc.v1.Peer``)."""
        register(self._server)
        self._services.append(name)

    def bind(self, listen: str, credentials: grpc.ServerCredentials | None = None) -> str:
        """Listen on ``HOST:PORT`` (with TLS when ``credentials`` are given); the bound
        address, with port 0 replaced by the real one."""
        host, _ = split_host_port(listen)
        try:
            if credentials is None:
                port = self._server.add_insecure_port(listen)
            else:
                port = self._server.add_secure_port(listen, credentials)
        except RuntimeError as exc:
            raise ServerError(f"cannot listen on {listen}: {exc}") from None
        if port == 0:
            raise ServerError(f"cannot listen on {listen}")
        return f"{host}:{port}"

    def bind_health(self, listen: str) -> str:
        """Also serve the health service alone, in plaintext, on ``listen``: kubelet's gRPC
        probes cannot present a client certificate, and health says nothing about
        checkpoints. Call before ``start``; the bound address."""
        self._health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
        host, _ = split_host_port(listen)
        try:
            port = self._health_server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise ServerError(f"cannot listen for health checks on {listen}: {exc}") from None
        if port == 0:
            raise ServerError(f"cannot listen for health checks on {listen}")
        return f"{host}:{port}"

    async def start(self) -> None:
        # Up but not ready until the daemon says so (``set_serving``).
        for name in ("", READINESS_SERVICE, *self._services):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        if self._health_server is not None:
            await self._health_server.start()
        self._started = True

    async def set_serving(self) -> None:
        for name in ("", *self._services):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def set_ready(self, ready: bool) -> None:
        """What the ``readiness`` health service says (not ready until first told)."""
        status = health_pb2.HealthCheckResponse
        await self._health.set(READINESS_SERVICE, status.SERVING if ready else status.NOT_SERVING)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, give calls in flight ``grace`` seconds, then cancel them."""
        if not self._started:
            return
        self._started = False
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        log.info("gRPC server stopped")


_WILDCARDS = ("", "0.0.0.0", "::", "[::]")  # noqa: S104 (recognised, not bound)


def advertised_address(bound: str) -> str:
    """What peers should dial when ``--advertise`` is not given: the bound address, with a
    wildcard host replaced by this machine's hostname."""
    host, port = split_host_port(bound)
    if host in _WILDCARDS:
        host = socket.gethostname()
    return f"{host}:{port}"
