"""A drain that cancels an ordered upload of another step must stop that upload's
bytes (``BackupOrders.settle``: "cancel an upload of another step, which an upload of
``step`` would share the link with"). Cancelling the asyncio task alone leaves the worker
thread uploading: the ordered upload must be handed a cancel check that the cancel sets."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from mtc_replicator.cluster.backup_orders import BackupOrders
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.storage.backup import CommitRecord

CONFIG = JobConfig(
    job_name="job",
    framework=Framework.ORBAX,
    node_rank=0,
    nodes=1,
    backup_interval=BackupInterval(minutes=None, steps=10),
)


class Store:
    def get(self, item: ItemId) -> Any:
        return type("M", (), {"item": item, "total_bytes": 1})()

    def data_path(self, item: ItemId) -> Path:
        return Path("/nonexistent") / item.key


class Bucket:
    url = "mem://"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: set[int] = set()
        self.overlap = False
        self.old_saw_cancel = False
        self.started = threading.Event()

    def abort_leftover_uploads(self, job: str, keys: Any) -> int:
        return 0

    def upload_item(self, manifest: Any, data: Path, cancelled: Any) -> None:
        step = manifest.item.step
        with self.lock:
            self.active.add(step)
            if len(self.active) > 1:
                self.overlap = True
        try:
            if step == 10:  # the ordered upload: long, stops only when cancelled
                self.started.set()
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline:
                    if cancelled():
                        self.old_saw_cancel = True
                        from mtc_replicator.core.manifest import Cancelled

                        raise Cancelled("cancelled")
                    time.sleep(0.01)
            else:
                time.sleep(0.2)
        finally:
            with self.lock:
                self.active.discard(step)

    def try_commit(self, job: str, step: int, keys: Any) -> CommitRecord:
        return CommitRecord(job, step, dict.fromkeys(keys, "0"), 1.0)


def test_a_drain_stops_the_ordered_upload_it_cancels() -> None:
    bucket = Bucket()

    async def main() -> bool | None:
        orders = BackupOrders(
            CONFIG,
            Store(),  # type: ignore[arg-type]
            bucket,  # type: ignore[arg-type]
            run_thread=asyncio.to_thread,
            error=lambda m, s: None,
        )
        orders.take(10, reported=None)
        await asyncio.to_thread(bucket.started.wait, 2.0)
        done = await orders.drain(20, lambda: False)
        await asyncio.sleep(0.1)  # the old thread's next check (each 10 ms)
        assert bucket.active == set(), "the cancelled ordered upload is still uploading"
        return done

    assert asyncio.run(main()) is True
    assert bucket.old_saw_cancel, "the cancelled ordered upload kept going in its thread"
    # Stopped at its next check, not left running for its whole length (2 s).
    assert bucket.active == set()
