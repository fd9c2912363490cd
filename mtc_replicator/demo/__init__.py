"""``mtc demo``: the local demonstration, with real daemons and a real PyTorch job.

Not part of the product: no other package of ``mtc_replicator`` imports this one (the
import contracts in ``pyproject.toml`` hold it). ``mtc`` finds the command through the
``mtc.commands`` entry point. ``single`` tells the one-node story, ``cluster`` the N-node
one, and ``trainer`` is the training job both run (it uses ``mtc_replicator/client/``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mtc_replicator.core import argtypes


def _nodes(text: str) -> int:
    try:
        nodes = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nodes must be a whole number, not {text!r}") from None
    if nodes < 1:
        raise argparse.ArgumentTypeError("--nodes must be at least 1")
    return nodes


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "run the demo: save, crash, restore locally (or from a peer), restore from backup"
    demo = sub.add_parser("demo", help=about, description=about)
    demo.add_argument(
        "--nodes",
        type=_nodes,
        default=1,
        help="1: the single-node story; N > 1: N daemons and an N-rank job (make demo: 4; "
        "default: %(default)s)",
    )
    demo.add_argument(
        "--workdir", type=Path, help="keep logs and the backup here (default: a temp dir)"
    )
    demo.add_argument(
        "--step-seconds",
        type=argtypes.non_negative,
        help="simulated time per training step (default 0.05; 0.2 with --nodes > 1)",
    )


def run(args: argparse.Namespace) -> int:
    if args.nodes > 1:
        from mtc_replicator.demo import cluster

        return cluster.run(args.workdir, args.step_seconds or 0.2, args.nodes)
    from mtc_replicator.demo import single

    return single.run(args.workdir, args.step_seconds or 0.05)
