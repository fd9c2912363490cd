"""One rank's upload of one step to the backup, for a one-node job and a cluster alike. I/O.

The callers differ only in when a step is due (their own interval, or the coordinator's
order) and in what they remember afterwards; the upload, the ``COMMIT`` attempt, the log
line and the metrics are the same.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection

from replicator.core.backup_layout import CommitRecord
from replicator.core.contract import JobConfig
from replicator.core.manifest import CancelCheck, ItemId
from replicator.core.policy import rank_items
from replicator.local.store import LocalStore
from replicator.obs.logs import JobLog
from replicator.obs.metrics import Metrics, TransferKind
from replicator.storage.backup import BackupStore


class ItemNotHeld(Exception):
    """An item of the step is gone from the store (retention dropped it meanwhile)."""

    def __init__(self, item: ItemId) -> None:
        super().__init__(str(item))
        self.item = item


async def upload_step(
    backups: BackupStore,
    store: LocalStore,
    config: JobConfig,
    step: int,
    commit_keys: Collection[str],
    *,
    run_thread: Callable[..., Awaitable[object]],
    log: JobLog,
    metrics: Metrics,
    cancelled: CancelCheck = lambda: False,
) -> CommitRecord | None:
    """Upload this rank's items of ``step``, then try the ``COMMIT`` naming ``commit_keys``.

    Returns the commit record, or None when other ranks' items are still missing. Raises
    ``ItemNotHeld`` before uploading anything of an item no longer in the store, and the
    backup's own errors (``PreconditionFailed``: the step is committed already).
    """
    t0 = time.monotonic()
    total = 0
    for item in rank_items(config, step):
        manifest = store.get(item)
        if manifest is None:
            raise ItemNotHeld(item)
        await run_thread(backups.upload_item, manifest, store.data_path(item), cancelled)
        total += manifest.total_bytes
    found = await run_thread(backups.try_commit, config.job_name, step, list(commit_keys))
    record = found if isinstance(found, CommitRecord) else None
    dt = max(time.monotonic() - t0, 1e-9)
    log.info(
        "backup of step %d %s: %d bytes in %.2fs (%.1f MB/s)",
        step,
        "committed" if record else "uploaded, awaiting other ranks",
        total,
        dt,
        total / dt / 1e6,
        step=step,
    )
    metrics.transfer(TransferKind.BACKUP_UPLOAD, total, dt)
    metrics.backed_up(config.job_name, step, record.created if record else None)
    return record
