"""A launcher of several processes on one node, as ``torchrun --nproc-per-node=N`` starts
them: one parent process, N children with ``LOCAL_RANK`` 0..N-1 and ``LOCAL_WORLD_SIZE``,
each calling our client's ``handshake`` exactly as docs/deploy.md's snippet does.

``python -m tests.integration.node_launcher --dir D --job J --procs N --out O``: each child
writes ``O/<local rank>.json`` (its ``RestoreResult``, or the exception it raised, and how
long the handshake took); the launcher exits 0 once every child has ended.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def worker(a: argparse.Namespace) -> int:
    from mtc_replicator import client

    rank = int(os.environ["LOCAL_RANK"])
    started = time.monotonic()
    record: dict[str, object]
    try:
        result = client.handshake(
            a.dir,
            job_name=a.job,
            framework="pytorch.distributed",
            node_rank=0,
            nodes=1,
            backup_interval_minutes=30,
            timeout=a.timeout,
            poll_interval=0.01,
        )
        record = {
            "step": result.step,
            "path": None if result.path is None else str(result.path),
            "source": result.source,
        }
    except Exception as exc:
        record = {"error": f"{type(exc).__name__}: {exc}"}
    record["seconds"] = time.monotonic() - started
    out = Path(a.out) / f"{rank}.json"
    out.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(out.with_suffix(".tmp"), out)
    return 0


def launch(a: argparse.Namespace) -> int:
    children = []
    for rank in range(a.procs):
        env = {**os.environ, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(a.procs)}
        argv = [sys.executable, "-m", __spec__.name, *sys.argv[1:], "--worker"]
        children.append(subprocess.Popen(argv, env=env))
    return max(child.wait() for child in children)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--worker", action="store_true", help="(internal) run one child")
    a = p.parse_args()
    return worker(a) if a.worker else launch(a)


if __name__ == "__main__":
    sys.exit(main())
