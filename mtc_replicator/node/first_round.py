"""What a new incarnation brings into the store before its first round plans: pool copies
settled, a one-node job's newest pool copy, the donor's step of an exploit. I/O: through
``cluster.pool`` and ``cluster.donor``.
"""

from __future__ import annotations

from mtc_replicator.cluster.donor import Donor, DonorMissing, RunThread
from mtc_replicator.cluster.pool import PoolCopies
from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.manifest import CorruptItem, ManifestError
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.pool_node import PoolNode
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.transport.peer_client import PeerClient


class CannotContinue(Exception):
    """The donor's step of ``continue-from-job`` cannot be had here (the reason says why)."""


async def bring_first(
    config: JobConfig,
    owner: str,
    run_thread: RunThread,
    *,
    store: LocalStore,
    manifests: ManifestTrust,
    peers: PeerClient,
    backups: BackupStore | None,
    pool: PoolNode | None,
    log: JobLog,
    pool_copies: PoolCopies | None,
) -> None:
    """Before the round: the pool copies held here of this job become its own or go
    (``local.pool_held``); a one-node job's newest step on another node of the pool comes
    here when newer than its own; a job continued from another one's step brings that
    step (``cluster.donor``), or raises ``CannotContinue``."""
    if pool is not None:
        await run_thread(pool.held.settle, config.job_name, config.nodes)
    if pool_copies is not None:
        await pool_copies.fetch_newest()

    donor = Donor(
        store,
        config,
        owner,
        manifests,
        run_thread,
        log,
        peers=peers,
        view=None if pool is None else pool.view,
        me="" if pool is None else pool.name,
        backups=backups,
    )
    if not await run_thread(donor.needed):
        return
    try:
        await donor.bring()
    except DonorMissing as exc:
        raise CannotContinue(str(exc)) from None
    except (ManifestError, CorruptItem) as exc:  # the copy on this node is not the job's
        cf = config.continue_from
        assert cf is not None
        raise CannotContinue(f"cannot continue from job {cf.job}'s step {cf.step}: {exc}") from None
