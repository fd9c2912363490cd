"""Progress bars for ``mtc``'s long reads and writes, drawn by tqdm (rate and ETA included).

A bar is shown on stderr when it is a terminal, or when ``--progress`` asks for it; never
with ``--no-progress``, and not by default with ``--json`` (whose reader is a program).
A bar is a callable told how many more bytes are done, so the storage layer needs no
knowledge of it (``backup_audit.Progress``).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from typing import Protocol, TextIO

from tqdm import tqdm


class Bar(Protocol):
    def __call__(self, n: int, /) -> None: ...

    def close(self) -> None: ...


class ByteBar:
    """``total`` bytes on one line of ``stream``: done, share, rate and time left."""

    def __init__(self, stream: TextIO, total: int, label: str) -> None:
        # A terminal that reports no size (a fresh pty, a serial console) gets nothing from
        # tqdm (zero columns, zero rows: the bar counts as hidden): give it a fixed size.
        sized = _columns(stream) > 0
        self.bar = tqdm(
            total=total,
            desc=label,
            file=stream,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            mininterval=0.2,
            dynamic_ncols=sized,
            ncols=None if sized else 80,
            nrows=None if sized else 24,
            leave=True,
        )

    def __call__(self, n: int, /) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return 0


class NoBar:
    def __call__(self, n: int, /) -> None:
        pass

    def close(self) -> None:
        pass


def wanted(args: argparse.Namespace, stream: TextIO) -> bool:
    """``--progress``/``--no-progress`` when given; otherwise a TTY without ``--json``."""
    chosen: bool | None = getattr(args, "progress", None)
    if chosen is not None:
        return chosen
    return stream.isatty() and not getattr(args, "json", False)


def bar(args: argparse.Namespace, total: int, label: str, stream: TextIO | None = None) -> Bar:
    """A bar for ``total`` bytes when one is ``wanted``; a silent one otherwise."""
    out = sys.stderr if stream is None else stream
    return ByteBar(out, total, label) if wanted(args, out) else NoBar()


def add_option(parser: argparse.ArgumentParser, *, has_json: bool = True) -> None:
    """``--progress``; ``has_json``: the command has a ``--json`` (its help names it)."""
    when = "terminal and not with --json" if has_json else "terminal"
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"a progress bar with rate and ETA on stderr (default: only when stderr is a {when})",
    )
