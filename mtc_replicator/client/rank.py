"""``python -m mtc_replicator.client.rank``: this pod's rank, as the node stack assigned it,
for torchrun and our client (docs/client.md, "The node rank on Kubernetes").

After a restart the pods of a job land on nodes in any order; mtc-controller gives each the
rank whose checkpoints its node holds, and the node's replicator writes it into
CHECKPOINT_DIR (``mtc-rank.json``, ``core.rank_file``). This waits for that file, naming
this pod (``$POD_UID``, from the downward API; without it any record is taken), and prints
one shell line::

    export NODE_RANK=3 MASTER_ADDR=10.0.0.5 MASTER_PORT=8476 NNODES=4

so that a container runs ``eval "$(python -m mtc_replicator.client.rank)"`` and then
``torchrun --node-rank=$NODE_RANK --master-addr=$MASTER_ADDR ...``. No assignment within
``--timeout`` (900 s, as Orbax waits for ``jax-init-info.txt``): the pod's own index
(``$JOB_COMPLETION_INDEX`` or ``--index``) as ``NODE_RANK``, one warning on stderr saying
so and why, exit 0; MASTER_ADDR and the rest stay as the environment has them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mtc_replicator.core.rank_file import (
    MAX_RANK_FILE_BYTES,
    RANK_FILE,
    BadRankRecord,
    RankRecord,
    parse_rank_file,
)

CHECKPOINT_DIR_VARIABLES = ("MTC_CHECKPOINT_DIR", "CHECKPOINT_DIR")
DEFAULT_TIMEOUT = 900.0
"""Seconds, as Orbax's ``initialize_multi_tier_checkpointing`` waits for its file."""
POLL = 0.5
INDEX_VARIABLE = "JOB_COMPLETION_INDEX"
POD_UID_VARIABLE = "POD_UID"


def read_assignment(directory: Path, pod_uid: str | None) -> tuple[RankRecord | None, str]:
    """The record in ``directory`` for this pod, or None and why not (for the warning)."""
    path = directory / RANK_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RANK_FILE_BYTES + 1)
    except FileNotFoundError:
        return None, f"no {RANK_FILE} appeared in {directory}"
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"
    try:
        record = parse_rank_file(raw)
    except BadRankRecord as exc:
        return None, f"{path} is not a rank record: {exc}"
    if pod_uid and record.pod_uid and record.pod_uid != pod_uid:
        return None, f"{path} names pod {record.pod_uid}, not this pod ({pod_uid})"
    return record, ""


def wait_for_assignment(
    directory: Path,
    pod_uid: str | None,
    timeout: float,
    *,
    poll: float = POLL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[RankRecord | None, str]:
    """``read_assignment`` every ``poll`` seconds until it finds one or ``timeout`` passes."""
    deadline = clock() + timeout
    while True:
        record, why = read_assignment(directory, pod_uid)
        if record is not None or clock() >= deadline:
            return record, why
        sleep(poll)


def exports(record: RankRecord) -> str:
    """The shell line for an assignment."""
    host = record.coordinator_host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # torchrun takes an IPv6 address bare
    values = {
        "NODE_RANK": str(record.rank),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(record.coordinator_port),
        "NNODES": str(record.nodes),
    }
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in values.items())


def _index(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise argparse.ArgumentTypeError(f"not a pod index (0, 1, ...): {value!r}")
    return int(value)


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mtc_replicator.client.rank",
        description="Wait for the rank the node stack assigned this pod and print it as "
        "shell exports (NODE_RANK, MASTER_ADDR, MASTER_PORT, NNODES) for eval; without "
        "one within --timeout, the pod's index.",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=next((env[v] for v in CHECKPOINT_DIR_VARIABLES if env.get(v)), None),
        help="the checkpoint directory (default: $MTC_CHECKPOINT_DIR, else $CHECKPOINT_DIR)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for an assignment (default: {DEFAULT_TIMEOUT:.0f})",
    )
    p.add_argument(
        "--index",
        type=_index,
        default=env.get(INDEX_VARIABLE) or None,
        help=f"the pod's index, the rank without an assignment (default: ${INDEX_VARIABLE})",
    )
    return p


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """0: a line printed (the assignment, or the index after the timeout); 2: usage, or no
    assignment and no index to fall back to."""
    env = os.environ if env is None else env
    p = _parser(env)
    args = p.parse_args(argv)
    if args.checkpoint_dir is None:
        p.error("--checkpoint-dir, MTC_CHECKPOINT_DIR or CHECKPOINT_DIR is required")
    if args.timeout < 0:
        p.error("--timeout must be 0 or more")
    index: int | None = args.index  # argparse applies _index to the default from env too
    pod_uid = env.get(POD_UID_VARIABLE) or None
    record, why = wait_for_assignment(args.checkpoint_dir, pod_uid, args.timeout)
    if record is not None:
        print(exports(record))
        return 0
    if index is None:
        print(
            f"mtc rank: no assignment after {args.timeout:g}s ({why}) and no index to fall "
            f"back to: set ${INDEX_VARIABLE} or pass --index",
            file=sys.stderr,
        )
        return 2
    print(
        f"mtc rank: WARNING: no assignment after {args.timeout:g}s ({why}); falling back to "
        f"the pod's index {index} as NODE_RANK: this rank may restore over the network",
        file=sys.stderr,
    )
    print(f"export NODE_RANK={index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
