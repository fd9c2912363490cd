"""``mtc``: the operator CLI. ``mtc demo`` runs the local demonstration end to end."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from replicator import __version__


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mtc", description="Operate the multi-tier checkpoint replicator."
    )
    p.add_argument("--version", action="version", version=__version__)
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run the single-node demo: save, crash, restore locally, restore from backup"
    )
    demo.add_argument(
        "--workdir", type=Path, help="keep logs and the backup here (default: a temp dir)"
    )
    demo.add_argument(
        "--step-seconds", type=float, default=0.05, help="simulated time per training step"
    )
    a = p.parse_args(argv)
    if a.command == "demo":
        from replicator import demo as demo_mod

        return demo_mod.run(a.workdir, a.step_seconds)
    p.error(f"unknown command {a.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
