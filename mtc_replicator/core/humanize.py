"""Numbers as operators read them: sizes in binary units, ages in two units at most, counts
with their noun in the right number. Pure.

In ``core`` rather than in ``tools`` because the prune policy (``core.prune``) words its
reasons with ``human_age``, and ``mtc``'s output must say the same thing the same way.
"""

from __future__ import annotations

import math


def human_bytes(n: int) -> str:
    """``1.5 GiB``: binary units, one decimal, as operators compare them with ``du -h``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def human_age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h12m``, ``2d4h``: two units at most, enough to judge a backup."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 0:
        # Clocks of the writer and of this machine differ a little; more is worth showing.
        return "0s" if seconds > -60 else f"{human_age(-seconds)} ahead"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: "1 item", "2 items", "0 steps"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
