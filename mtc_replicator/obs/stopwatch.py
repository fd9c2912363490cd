"""One transfer's stopwatch: its seconds for the metrics, and the bytes, seconds and MB/s
that every transfer log line ends with, written the same way everywhere."""

from __future__ import annotations

import time
from collections.abc import Callable


class Stopwatch:
    """Started when made; ``seconds`` so far, and ``summary`` of the bytes moved in them."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()

    def seconds(self) -> float:
        return self._clock() - self.started

    def summary(self, nbytes: int, seconds: float | None = None) -> str:
        """``"<nbytes> bytes in <s>s (<MB/s> MB/s)"``, for ``seconds`` (default: so far)."""
        took = self.seconds() if seconds is None else seconds
        return f"{nbytes} bytes in {took:.3f}s ({rate(nbytes, took):.1f} MB/s)"


def rate(nbytes: int, seconds: float) -> float:
    """MB/s, for the transfer log lines."""
    return nbytes / max(seconds, 1e-9) / 1e6
