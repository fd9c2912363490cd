"""``mtc status``: one node's jobs, held steps, progress and peers, asked of its daemon.

The daemon answers over ``mtc.v1.Node`` on its gRPC port, under the same mutual TLS as
every node RPC, so ``mtc status`` takes the daemon's TLS flags (and the same ``MTC_TLS_*``
variables: inside the daemon's pod it needs no flags). Exit codes: 0 answered, 1 the daemon
cannot be reached or refused us, or ``--job`` is not on the node, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

import grpc

from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator._pb.mtc.v1 import node_pb2_grpc
from mtc_replicator.core import argtypes
from mtc_replicator.core.humanize import human_age
from mtc_replicator.transport.tls import (
    DEFAULT_SERVER_NAME,
    TlsError,
    open_material,
    refused_certificate,
)

PROG = "mtc status"
DEFAULT_ADDRESS = "127.0.0.1:7070"
SHOWN_STEPS = 5
"""Steps listed per rank in the table (the newest); --json lists them all."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "a node's jobs, held steps, progress and peers, from its daemon"
    p = sub.add_parser("status", help=about, description=about)
    p.add_argument("--job", type=argtypes.job, help="only this job (default: every job)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    add_connection_arguments(p)


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """How to reach a daemon's ``mtc.v1.Node``: its address, a timeout, its TLS."""
    env = os.environ
    p.add_argument(
        "--address",
        type=argtypes.host_port,
        default=env.get("MTC_STATUS_ADDRESS", DEFAULT_ADDRESS),
        help="the daemon's gRPC address, HOST:PORT [MTC_STATUS_ADDRESS] (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=argtypes.seconds,
        default=10.0,
        help="seconds to wait for the daemon (default: %(default)s)",
    )
    p.add_argument(
        "--tls-cert",
        default=env.get("MTC_TLS_CERT") or None,
        help="a certificate from the nodes' CA (PEM), with --tls-key and --tls-ca: needed "
        "when the daemon runs with TLS [MTC_TLS_CERT] (default: plaintext)",
    )
    p.add_argument(
        "--tls-key",
        default=env.get("MTC_TLS_KEY") or None,
        help="its key (PEM) [MTC_TLS_KEY] (default: none)",
    )
    p.add_argument(
        "--tls-ca",
        default=env.get("MTC_TLS_CA") or None,
        help="the nodes' CA (PEM) [MTC_TLS_CA] (default: none)",
    )
    p.add_argument(
        "--tls-server-name",
        default=env.get("MTC_TLS_SERVER_NAME", DEFAULT_SERVER_NAME),
        help="the DNS name in node certificates [MTC_TLS_SERVER_NAME] (default: %(default)s)",
    )


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the daemon of ``add_connection_arguments``; ``TlsError`` for bad TLS
    files."""
    tls = open_material(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    if tls is None:
        return grpc.insecure_channel(args.address)
    return grpc.secure_channel(
        args.address, tls.channel_credentials(), options=tls.channel_options()
    )


def ask(args: argparse.Namespace) -> pb.NodeStatusResponse:
    """The daemon's answer; ``TlsError`` for bad TLS files, ``grpc.RpcError`` for a call
    that failed."""
    with open_channel(args) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        reply: pb.NodeStatusResponse = stub.Status(
            pb.NodeStatusRequest(job=args.job or ""), timeout=args.timeout
        )
        return reply


def run(args: argparse.Namespace) -> int:
    try:
        reply = ask(args)
    except TlsError as exc:
        return _fail(str(exc), 2)
    except grpc.RpcError as exc:
        return _fail(explain(exc, args))
    if args.job is not None and not reply.jobs:
        return _fail(f"job {args.job} is not on the node at {args.address}")
    body = status_json(reply)
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
    else:
        print_status(body, time.time())
    return 0


def explain(exc: grpc.RpcError, args: argparse.Namespace) -> str:
    """One line for a failed call to the daemon: what went wrong and what to try."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    where = f"the daemon at {args.address}"
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return f"{where} does not serve status (an older version?): {details}"
    if refused_certificate(details) or (
        code is grpc.StatusCode.UNAVAILABLE and "ssl" in details.lower()
    ):
        return f"TLS handshake with {where} failed: {_tls_failure(details, args)}"
    if code is grpc.StatusCode.UNAVAILABLE and args.tls_cert and "Socket closed" in details:
        # The daemon hung up in the handshake: it refused our certificate.
        return (
            f"{where} closed the connection in the TLS handshake: it did not accept the "
            f"certificate {args.tls_cert} (it must be issued by the CA the daemon trusts, "
            "its --tls-ca), or it does not speak TLS there"
        )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"{where} did not answer within {args.timeout:g}s"
    if code is grpc.StatusCode.UNAVAILABLE:
        hint = "" if args.tls_cert else " (or it needs TLS: --tls-cert, --tls-key, --tls-ca)"
        return f"cannot reach {where}: {details}; is mtc-replicator running there?{hint}"
    name = code.name if code is not None else "error"
    return f"{where} answered {name}: {details}"


_OPENSSL_REASON = re.compile(r"OPENSSL_internal:([A-Z0-9_]+)(?::\s*([^:]+))?")


def _tls_failure(details: str, args: argparse.Namespace) -> str:
    """Why a handshake failed, in words, from gRPC's details (which carry OpenSSL's reason
    deep inside a chain of prefixes)."""
    found = _OPENSSL_REASON.search(details)
    reason = details
    if found is not None:
        reason = found[1] + (f": {found[2].strip()}" if found[2] and found[2].strip() else "")
    if not args.tls_cert:
        return f"{reason}; it needs TLS: pass --tls-cert, --tls-key, --tls-ca"
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            f"its certificate is not issued by the CA in --tls-ca {args.tls_ca} ({reason}); "
            "pass the CA of the nodes' certificates"
        )
    return reason


# --- output --------------------------------------------------------------------------------


def _peer_json(p: pb.PeerContact) -> dict[str, Any]:
    return {
        "rank": p.rank,
        "address": p.address,
        "reachable": p.reachable if p.contacted else None,
        "last_contact_at": p.last_contact_at if p.contacted else None,
        "last_answer_at": p.last_answer_at or None,
        "error": p.error or None,
    }


def _job_json(j: pb.JobStatus) -> dict[str, Any]:
    active = j.active
    copies = [{"rank": c.rank, "steps": list(c.steps)} for c in j.peer_copies]
    return {
        "job": j.job,
        "active": active,
        "incarnation": j.incarnation if active else None,
        "rank": j.rank if active else None,
        "nodes": j.nodes if active else None,
        "phase": j.phase if active else None,
        "coordinator": (j.coordinator or None) if active else None,
        "last_replicated": j.last_replicated if j.HasField("last_replicated") else None,
        "last_backed_up": j.last_backed_up if j.HasField("last_backed_up") else None,
        "local_steps": list(j.local_steps),
        # A job not running here: the node no longer knows which rank was its own, so its
        # copies are "held", not "peer" copies.
        "peer_copies": copies if active else None,
        "held_copies": None if active else copies,
        "peers": [_peer_json(p) for p in j.peers],
        "committed_backup_step": (
            j.committed_backup_step if j.HasField("committed_backup_step") else None
        ),
        "kept_without_backup": j.kept_without_backup,
        "off_node_copies": j.off_node_copies if active else None,
    }


def status_json(reply: pb.NodeStatusResponse) -> dict[str, Any]:
    """The ``--json`` document (docs/cli.md lists its keys)."""
    return {
        "address": reply.address,
        "version": reply.version,
        "jobs": [_job_json(j) for j in reply.jobs],
    }


def _steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    shown = ", ".join(str(s) for s in steps[-SHOWN_STEPS:])
    return shown if len(steps) <= SHOWN_STEPS else f"{shown} (+{len(steps) - SHOWN_STEPS} older)"


def _or_dash(x: object) -> str:
    return "-" if x is None else str(x)


def print_status(body: dict[str, Any], now: float) -> None:
    print(f"node {body['address'] or '?'} (mtc-replicator {body['version']})")
    if not body["jobs"]:
        print("  no jobs")
    for j in body["jobs"]:
        if j["active"]:
            print(
                f"job {j['job']}: rank {j['rank']}/{j['nodes']}, {j['phase']}, incarnation "
                f"{j['incarnation']}, coordinator {_or_dash(j['coordinator'])}"
            )
            if j["nodes"] == 1:
                replicated = "not replicated (one node)"
            elif not j["off_node_copies"]:
                replicated = (
                    "NOT REPLICATED: no other node holds this rank's steps (peers-per-node: 0), "
                    "a lost node restores from the backup"
                )
            else:
                replicated = f"last replicated {_or_dash(j['last_replicated'])}"
            print(f"  {replicated}, last backed up {_or_dash(j['last_backed_up'])}")
            print(f"  local steps: {_steps(j['local_steps'])}")
        elif j["kept_without_backup"]:
            print(
                f"job {j['job']}: not running here; its newest step held is NOT in the backup "
                f"(newest committed: {_or_dash(j['committed_backup_step'])}): kept, it may be "
                f"the only copy (mtc upload --job {j['job']} uploads it; mtc drop --job "
                f"{j['job']} --even-if-only-copy frees it)"
            )
        elif j["committed_backup_step"] is not None:
            print(
                f"job {j['job']}: not running here; backed up (step "
                f"{j['committed_backup_step']}): dropped when the room is needed or after "
                "--foreign-job-ttl"
            )
        else:
            print(f"job {j['job']}: not running here (items held from an earlier incarnation)")
        for c in j["peer_copies"] if j["active"] else j["held_copies"]:
            print(f"  copies of rank {c['rank']}: {_steps(c['steps'])}")
        if j["peers"]:
            rows = [["RANK", "PEER", "REACHABLE", "LAST ANSWER", "ERROR"]]
            for p in j["peers"]:
                reach = {None: "unknown", True: "yes", False: "NO"}[p["reachable"]]
                seen = p["last_answer_at"]
                ago = "never" if seen is None else f"{human_age(now - seen)} ago"
                error = _printable(p["error"] or "")
                rows.append([str(p["rank"]), _printable(p["address"]), reach, ago, error])
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
            for r in rows:
                cells = [c.ljust(w) for c, w in zip(r, widths, strict=False)]
                print("  " + "  ".join([*cells, r[-1]]).rstrip())


def _printable(text: str) -> str:
    """``text`` with control characters escaped: a peer's error comes from the peer, and a
    hostile one must not write escape sequences to the operator's terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
