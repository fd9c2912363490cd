"""``mtc``: the operator CLI. ``mtc demo`` runs the local demonstration end to end."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from replicator import __version__, backups_cli, render


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mtc", description="Operate the multi-tier checkpoint replicator."
    )
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the demo: save, crash, restore locally (or from a peer), restore from backup",
    )
    demo.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="1: the single-node story; N > 1: N daemons and an N-rank job (make demo: 4)",
    )
    demo.add_argument(
        "--workdir", type=Path, help="keep logs and the backup here (default: a temp dir)"
    )
    demo.add_argument(
        "--step-seconds",
        type=float,
        help="simulated time per training step (default 0.05; 0.2 with --nodes > 1)",
    )
    backups_cli.add_parser(sub)
    render.add_parser(sub)
    a = p.parse_args(argv)
    if a.command == "render":
        return render.run(a)
    if a.command == "demo":
        if a.nodes > 1:
            from replicator import demo_cluster

            return demo_cluster.run(a.workdir, a.step_seconds or 0.2, a.nodes)
        if a.nodes < 1:
            p.error("--nodes must be at least 1")
        from replicator import demo as demo_mod

        return demo_mod.run(a.workdir, a.step_seconds or 0.05)
    if a.command == "backups":
        return backups_cli.run(a)
    p.error(f"unknown command {a.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
