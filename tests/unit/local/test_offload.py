"""``local.offload``: blocking calls run off the loop, and ``wait`` waits for its owner's
calls still running, not for another owner's on the same pool."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from mtc_replicator.local.offload import Offload


def test_run_returns_the_result_from_another_thread() -> None:
    with ThreadPoolExecutor(2) as pool:
        offload = Offload(pool)
        loop_thread = threading.get_ident()
        got = asyncio.run(offload.run(lambda a, b: (a + b, threading.get_ident()), 2, 3))
    assert got[0] == 5
    assert got[1] != loop_thread


def test_wait_waits_for_its_own_calls_only() -> None:
    mine_may_end, others_may_end = threading.Event(), threading.Event()
    ended: list[str] = []

    def work(name: str, may_end: threading.Event) -> None:
        may_end.wait(5)
        ended.append(name)

    async def scenario() -> None:
        with ThreadPoolExecutor(2) as pool:
            mine, others = Offload(pool), Offload(pool)
            call = asyncio.ensure_future(mine.run(work, "mine", mine_may_end))
            other = asyncio.ensure_future(others.run(work, "other", others_may_end))
            await asyncio.sleep(0.05)
            asyncio.get_running_loop().call_later(0.1, mine_may_end.set)
            await mine.wait(timeout=5)  # returns while the other owner's call still runs
            assert ended == ["mine"]
            others_may_end.set()
            await asyncio.gather(call, other)
            assert ended == ["mine", "other"]

    asyncio.run(scenario())
