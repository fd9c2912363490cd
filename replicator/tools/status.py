"""``mtc status``: what one node's daemon holds and whom it reaches (stub)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "a node's jobs, held steps, progress and peers, from its daemon"
    sub.add_parser("status", help=about, description=about)


def run(args: argparse.Namespace) -> int:
    print("mtc status: error: not available yet", file=sys.stderr)
    return 1
