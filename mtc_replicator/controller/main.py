"""``mtc-controller``: elect a leader, then run kopf's handlers; probes and metrics on one port.

Every replica serves ``/healthz`` (the process answers), ``/readyz`` (following, or leading
with kopf's watches up) and ``/metrics``. Only the Lease's holder reconciles; when it loses
the Lease it stops (exit 1) and the Deployment restarts it as a follower.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kopf
from kubernetes import client
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest

from mtc_replicator.controller import handlers, rank_handlers
from mtc_replicator.controller.kube import load_config
from mtc_replicator.controller.leader import LeaseElector, Timing
from mtc_replicator.transport.tls import DEFAULT_SERVER_NAME, TlsError, open_material

log = logging.getLogger("mtc_replicator.controller")
LEADER = Gauge("mtc_controller_leader", "1 while this replica holds the Lease and reconciles")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mtc-controller",
        description="the CheckpointConfiguration controller: makes, rolls and removes each "
        "configuration's node stack and keeps its status",
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "mtc-system"),
        help="the namespace of the leader-election Lease (default $POD_NAMESPACE or mtc-system)",
    )
    p.add_argument("--lease-name", default="mtc-controller", help="the Lease's name")
    p.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the Lease (default $POD_NAME)",
    )
    p.add_argument(
        "--lease-duration",
        type=float,
        default=15.0,
        help="seconds a Lease unrenewed stays its holder's (default 15): the failover time",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=10.0,
        help="seconds the leader tries to renew before it stops (default 10)",
    )
    p.add_argument(
        "--retry-period", type=float, default=2.0, help="seconds between tries (default 2)"
    )
    p.add_argument(
        "--no-leader-elect",
        action="store_true",
        help="reconcile at once, without a Lease (one replica only)",
    )
    for flag, env, what in (
        (
            "--tls-cert",
            "MTC_TLS_CERT",
            "the controller's certificate (URI SAN "
            "spiffe://mtc-replicator/controller: `mtc certs controller`)",
        ),
        ("--tls-key", "MTC_TLS_KEY", "its key"),
        ("--tls-ca", "MTC_TLS_CA", "the node stack's CA"),
    ):
        p.add_argument(
            flag,
            default=os.environ.get(env),
            help=f"{what}, for the calls to the replicators (sticky ranks) [{env}]",
        )
    p.add_argument(
        "--tls-server-name",
        default=os.environ.get("MTC_TLS_SERVER_NAME", DEFAULT_SERVER_NAME),
        help="the DNS name in node certificates [MTC_TLS_SERVER_NAME] (default: %(default)s)",
    )
    p.add_argument(
        "--health-listen",
        default="0.0.0.0:8080",
        help="HOST:PORT of /healthz, /readyz and /metrics (default 0.0.0.0:8080)",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=os.environ.get("MTC_LOG_LEVEL", "INFO").upper(),
        help="DEBUG, INFO (default, or $MTC_LOG_LEVEL), WARNING or ERROR",
    )
    args = p.parse_args(argv)
    if not 0 < args.retry_period < args.renew_deadline < args.lease_duration:
        # As client-go: a leader that may renew as late as its Lease expires overlaps the
        # follower that takes it (two leaders at once).
        p.error(
            "need 0 < --retry-period < --renew-deadline < --lease-duration "
            f"(got {args.retry_period:g}, {args.renew_deadline:g}, {args.lease_duration:g})"
        )
    return args


class _State:
    def __init__(self) -> None:
        self.leading = threading.Event()
        self.kopf_ready = threading.Event()
        self.follower = threading.Event()


def _serve(listen: str, state: _State) -> ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif self.path == "/readyz":
                ready = state.follower.is_set() or state.kopf_ready.is_set()
                self._send(200 if ready else 503, b"ok\n" if ready else b"starting\n", "text/plain")
            elif self.path == "/metrics":
                self._send(200, generate_latest(), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, kind: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # probes every few seconds: not logged
            return

    server = ThreadingHTTPServer((host or "0.0.0.0", int(port)), Handler)  # noqa: S104
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


async def _operate(lost: threading.Event, ready: threading.Event) -> None:
    """kopf's operator until SIGTERM or the Lease is lost. Its stop flag is an asyncio.Event:
    a threading one would be waited on in an executor thread that the loop's shutdown then
    joins forever (a SIGTERM'd replica never exited)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def _on_lost() -> None:
        lost.wait()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to stop
            loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=_on_lost, name="lost", daemon=True).start()
    await kopf.operator(
        registry=handlers.REGISTRY,
        clusterwide=True,
        standalone=True,
        stop_flag=stop,
        ready_flag=ready,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.tls_cert and not os.path.exists(args.tls_cert):
        # The Deployment mounts Secret mtc-controller-tls optionally: not made (yet).
        log.warning("no controller certificate at %s", args.tls_cert)
        args.tls_cert = args.tls_key = args.tls_ca = None
    try:
        tls = open_material(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    except TlsError as exc:
        print(f"mtc-controller: error: {exc}", file=sys.stderr)
        return 2
    rank_handlers.use_tls(tls)
    if tls is None:
        log.warning(
            "no --tls-cert/--tls-key/--tls-ca: sticky ranks call the replicators in plaintext, "
            "which a node stack with TLS refuses (the jobs then keep their pods' indexes)"
        )
    load_config()
    state = _State()
    server = _serve(args.health_listen, state)
    log.info(
        "mtc-controller starting: identity=%s lease=%s/%s health=%s",
        args.identity,
        args.lease_namespace,
        args.lease_name,
        f"{server.server_address[0]!s}:{server.server_address[1]}",
    )
    stop = threading.Event()
    lost = threading.Event()
    elector = None
    if not args.no_leader_elect:
        timing = Timing(args.lease_duration, args.renew_deadline, args.retry_period)
        elector = LeaseElector(
            client.ApiClient(), args.lease_namespace, args.lease_name, args.identity, timing
        )
        state.follower.set()
        log.info("waiting for the Lease %s/%s", args.lease_namespace, args.lease_name)
        elector.acquire(stop)
        state.follower.clear()
        threading.Thread(target=elector.keep, args=(stop, lost), name="lease", daemon=True).start()
    LEADER.set(1)
    log.info("leading: reconciling CheckpointConfigurations")
    try:
        asyncio.run(_operate(lost, state.kopf_ready))
    finally:
        stop.set()
        LEADER.set(0)
        if elector is not None and not lost.is_set():
            elector.release()
        server.shutdown()
    return 1 if lost.is_set() else 0


@kopf.on.login(registry=handlers.REGISTRY)
def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


if __name__ == "__main__":
    raise SystemExit(main())
