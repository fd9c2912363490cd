"""``mtc drop``: give back the RAM a job that no longer runs on a node holds there.

Asked of the node's daemon over ``mtc.v1.Node`` (the daemon owns the store; the same
address and TLS flags as ``mtc status``). The daemon refuses the job it runs now, and a
job whose newest step held is not committed in the backup unless ``--even-if-only-copy``
says the items may go although they may be its only copy. Exit codes: 0 dropped, 1 refused
or the daemon cannot be reached, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator._pb.mtc.v1 import node_pb2_grpc
from mtc_replicator.core import argtypes
from mtc_replicator.core.humanize import human_bytes
from mtc_replicator.tools.status_cli import add_connection_arguments, explain, open_channel
from mtc_replicator.transport.tls import TlsError

PROG = "mtc drop"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "drop a node's items of a job that no longer runs there"
    p = sub.add_parser(
        "drop",
        help=about,
        description=about + ": never the job it runs now; items whose newest step is not "
        "committed in the backup only with --even-if-only-copy",
    )
    p.add_argument("--job", type=argtypes.job, required=True, help="the job whose items go")
    p.add_argument(
        "--even-if-only-copy",
        action="store_true",
        help="drop them even when the backup does not hold the newest step held there",
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    add_connection_arguments(p)


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    try:
        with open_channel(args) as channel:
            stub = node_pb2_grpc.NodeStub(channel)
            reply: pb.DropResponse = stub.Drop(
                pb.DropRequest(job=args.job, even_if_only_copy=args.even_if_only_copy),
                timeout=args.timeout,
            )
    except TlsError as exc:
        return _fail(str(exc), 2)
    except grpc.RpcError as exc:
        if isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
            return _fail(f"refused: {exc.details()}")
        return _fail(explain(exc, args))
    committed = reply.committed_backup_step if reply.HasField("committed_backup_step") else None
    body = {
        "job": reply.job,
        "bytes": reply.bytes,
        "dropped": [{"rank": c.rank, "steps": list(c.steps)} for c in reply.dropped],
        "committed_backup_step": committed,
    }
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
        return 0
    print(f"dropped job {reply.job} from {args.address}: {human_bytes(reply.bytes)}")
    for c in reply.dropped:
        print(f"  rank {c.rank}: steps {', '.join(str(s) for s in c.steps)}")
    print(f"  newest step committed in the backup: {'-' if committed is None else committed}")
    return 0
