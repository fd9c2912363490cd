"""``mtc upload``: upload a step of a job that no longer runs on a node to the backup.

Asked of the node's daemon over ``mtc.v1.Node`` (the daemon owns the store and the bucket's
credentials; the same address and TLS flags as ``mtc status``): it uploads the items of the
job's newest step held there (or ``--step``) that the step's ``COMMIT`` lists, then commits
it when the backup holds them all. The daemon refuses the job it runs now. Exit codes: 0
uploaded and committed (or committed already); 1 refused, failed, not committed (the ranks
whose items the backup lacks are named), or the daemon cannot be reached; 2 bad usage.
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
from mtc_replicator.core.layout import format_ranks
from mtc_replicator.tools.status_cli import add_connection_arguments, explain, open_channel
from mtc_replicator.transport.tls import TlsError

PROG = "mtc upload"
DEFAULT_TIMEOUT = 3600.0
"""Seconds to wait for the daemon: an upload moves a whole step (the daemon goes on if the
wait ends first)."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "upload the newest step a node holds of a job that no longer runs there"
    p = sub.add_parser(
        "upload",
        help=about,
        description=about + " to the backup, and commit it when the backup then holds every "
        "item its COMMIT lists (a job of several nodes: run it on each node that holds some)",
    )
    p.add_argument("--job", type=argtypes.job, required=True, help="the job whose step goes up")
    p.add_argument(
        "--step",
        type=argtypes.count,
        help="this step (default: the newest of which the node holds an item the COMMIT lists)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    add_connection_arguments(p)
    p.set_defaults(timeout=DEFAULT_TIMEOUT)


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    request = pb.UploadRequest(job=args.job)
    if args.step is not None:
        request.step = args.step
    try:
        with open_channel(args) as channel:
            reply: pb.UploadResponse = node_pb2_grpc.NodeStub(channel).Upload(
                request, timeout=args.timeout
            )
    except TlsError as exc:
        return _fail(str(exc), 2)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        if isinstance(exc, grpc.Call) and code is grpc.StatusCode.FAILED_PRECONDITION:
            return _fail(f"refused: {exc.details()}")
        if isinstance(exc, grpc.Call) and code is grpc.StatusCode.ABORTED:
            return _fail(f"{exc.details()}")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return _fail(
                f"the daemon at {args.address} did not finish within {args.timeout:g}s; it goes "
                "on uploading: run the same command again to wait for it, or see mtc status"
            )
        return _fail(explain(exc, args))
    body = {
        "job": reply.job,
        "step": reply.step,
        "uploaded": list(reply.uploaded),
        "bytes": reply.bytes,
        "committed": reply.committed,
        "already_committed": reply.already_committed,
        "missing_ranks": list(reply.missing_ranks),
        "backup": reply.backup,
        "seconds": round(reply.seconds, 3),
    }
    if args.json:
        print(json.dumps(body, indent=2, sort_keys=True))
    elif reply.already_committed:
        print(f"job {reply.job} step {reply.step} is committed in {reply.backup} already")
    else:
        print(
            f"uploaded job {reply.job} step {reply.step} from {args.address} to {reply.backup}: "
            f"{', '.join(reply.uploaded)} ({human_bytes(reply.bytes)} in {reply.seconds:.1f}s)"
        )
        if reply.committed:
            print(f"  committed: step {reply.step} is restorable from the backup")
        else:
            print(
                f"  NOT committed: the backup lacks the items of ranks "
                f"{format_ranks(reply.missing_ranks)}; run mtc upload --job {reply.job} "
                "on the nodes that hold them"
            )
    return 0 if reply.committed else 1
