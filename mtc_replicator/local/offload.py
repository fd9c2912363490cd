"""Blocking calls of one owner, run on the daemon's shared thread pool. I/O: none itself.

An incarnation hashes, verifies, downloads and deletes off the event loop; when it stops
it must wait for those calls (a thread cannot be cancelled), and only for its own, not for
another's on the same pool. ``Offload.run`` is what the layers below the agent are handed
to run blocking work (``cluster.sources``, ``storage.upload``): a call down into this
module, never back up into the agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

T = TypeVar("T")


class Offload:
    """Runs blocking functions on ``executor`` and remembers those still running."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._running: set[asyncio.Future[Any]] = set()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the pool; its result."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return await fut

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the calls still running."""
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout)
