"""One rank's upload of one step to the backup, when the coordinator orders it. I/O.

The rank uploads its own items (files, then each manifest) and reports the step uploaded;
the coordinator writes the ``COMMIT`` once every uploader has (``cluster.backup_orders``), so a
backup of N items costs N manifest reads, not one round of checks per uploader.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.manifest import CancelCheck, ItemId
from mtc_replicator.core.policy import rank_items
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import Metrics, TransferKind
from mtc_replicator.obs.stopwatch import Stopwatch
from mtc_replicator.storage.backup import BackupStore


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
    *,
    run_thread: Callable[..., Awaitable[object]],
    log: JobLog,
    metrics: Metrics,
    cancelled: CancelCheck = lambda: False,
) -> None:
    """Upload this rank's items of ``step``.

    Raises ``ItemNotHeld`` before uploading anything of an item no longer in the store, and
    the backup's own errors (``PreconditionFailed``: the step is committed already).
    """
    watch = Stopwatch()
    total = 0
    items = rank_items(config, step)
    await run_thread(backups.abort_leftover_uploads, config.job_name, {i.key for i in items})
    for item in items:
        manifest = store.get(item)
        if manifest is None:
            raise ItemNotHeld(item)
        await run_thread(backups.upload_item, manifest, store.data_path(item), cancelled)
        total += manifest.total_bytes
    dt = watch.seconds()
    log.info("backup of step %d uploaded: %s", step, watch.summary(total, dt), step=step)
    metrics.transfer(TransferKind.BACKUP_UPLOAD, total, dt)
