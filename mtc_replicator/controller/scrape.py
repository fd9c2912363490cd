"""Asks each node's replicator how it is: ``/readyz`` and ``/metrics`` on its metrics port,
at the pod's IP. I/O module; ``controller.report`` makes sense of the answers.

A look at one node is two GETs with short timeouts and a bounded body, from a pool of
threads, so a few hundred nodes take seconds and a silent or hostile node costs its own
timeout only. Nothing is sent but the two paths; the port is the one the NetworkPolicy
opens to this controller (and to the monitoring namespace), plaintext and read-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import urllib3

from mtc_replicator.controller.plan import pod_node, replicator_address
from mtc_replicator.controller.report import BadReport, NodeReport, parse_metrics, readiness_lines

CONNECT_SECONDS = 2.0
READ_SECONDS = 5.0
MAX_BODY = 4 << 20
"""Bytes read of one answer: a node's /metrics is tens of KiB; a hostile one gets cut."""
WORKERS = 32
METRICS_PORT_NAME = "metrics"

_http = urllib3.PoolManager(
    num_pools=WORKERS,
    maxsize=1,
    retries=False,
    timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=READ_SECONDS),
)


class _TooBig(Exception):
    pass


def target(pod: Mapping[str, Any]) -> str | None:
    """``IP:PORT`` of a pod's replicator metrics, or None while it has no IP or no port."""
    return replicator_address(pod, METRICS_PORT_NAME)


def _get(url: str) -> tuple[int, str]:
    r = _http.request("GET", url, preload_content=False, redirect=False)
    try:
        body = r.read(MAX_BODY + 1)
    finally:
        r.release_conn()
    if len(body) > MAX_BODY:
        raise _TooBig(f"{url} answered more than {MAX_BODY} bytes")
    return r.status, body.decode("utf-8", errors="replace")


def look(node: str, address: str) -> NodeReport:
    """One node's report; an unreachable or garbled replicator is a report that says so."""
    try:
        status, body = _get(f"http://{address}/readyz")
        problems = readiness_lines(status, body)
        status, body = _get(f"http://{address}/metrics")
        if status != 200:
            return NodeReport(node, True, problems, f"/metrics answered {status}")
        return parse_metrics(node, problems, body)
    except BadReport as exc:
        return NodeReport(node, True, (), str(exc))
    except (urllib3.exceptions.HTTPError, _TooBig, OSError) as exc:
        return NodeReport(node, False, (), error=_why(exc))


def _why(exc: Exception) -> str:
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    # NewConnectionError is a ConnectTimeoutError to urllib3: asked first.
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        return f"cannot connect: {exc}"[:200]
    if isinstance(exc, urllib3.exceptions.ConnectTimeoutError):
        return f"no answer within {CONNECT_SECONDS:g} s"
    if isinstance(exc, urllib3.exceptions.ReadTimeoutError):
        return f"no answer within {READ_SECONDS:g} s"
    return str(exc)[:200]


def look_all(pods: Sequence[Mapping[str, Any]]) -> dict[str, NodeReport]:
    """Every pod with an address, by node name, at once (at most ``WORKERS`` in flight)."""
    targets = {pod_node(p): a for p in pods if (a := target(p)) is not None}
    if not targets:
        return {}
    with ThreadPoolExecutor(min(WORKERS, len(targets)), thread_name_prefix="mtc-look") as pool:
        found = pool.map(lambda kv: look(*kv), targets.items())
        return {r.node: r for r in found}
