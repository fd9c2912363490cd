"""Calls in flight together, counted by the tests of work that runs side by side."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class Flight:
    """Calls of one kind in flight together: the most at once, their keys in the order
    they began. With ``workers`` over 1 the first call waits until a second has begun, so
    calls made one at a time fail (after 10 s) instead of passing unseen."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.order: list[str] = []
        self.second = threading.Event()

    @contextlib.contextmanager
    def call(self, key: str) -> Iterator[None]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.order.append(key)
            first = len(self.order) == 1
            if len(self.order) == 2:
                self.second.set()
        try:
            if first and self.workers > 1 and not self.second.wait(10):
                raise AssertionError(f"no second call began while {key} was in flight")
            yield
        finally:
            with self.lock:
                self.now -= 1
