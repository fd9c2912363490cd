"""Another job's step, continued under this job's name: PopulationBasedTraining's exploit
through the tiers. I/O: the store, the peer plane, the pool and the bucket.

When Tune tells trial A to continue from trial B's checkpoint, our client writes A's
handshake with ``continue-from-job: B`` and ``continue-from-step: s`` (``core.contract``).
Before A's first round each node brings B's item of its own rank (every worker's) here
from the fastest tier that has it: this node's RAM disk, then the nodes of the pool in B's
rendezvous order (B's node and B's pool holder first: ``core.pool``), then B's COMMIT in
the bucket. Every copy is verified against its manifest's digest and must be attested
for A's owner: a trial reads only steps of its own namespace. The bytes are then committed
as A's item of step ``s`` with the same files (``LocalStore.adopt``: hard links) and
attested by this node, so A's round restores step ``s`` as any step of its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from mtc_replicator.cluster.pool import PoolView
from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.contract import ContinueFrom, JobConfig
from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest, ManifestError
from mtc_replicator.core.policy import worker_slots
from mtc_replicator.core.pool import PoolMember, ranking
from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStoreError
from mtc_replicator.transport.peer_client import PeerClient, PeerError

RunThread = Callable[..., Awaitable[Any]]


class DonorMissing(Exception):
    """The donor's item is in no tier this node can reach: the exploit cannot happen."""


@dataclasses.dataclass
class Donor:
    """Where a node looks for another job's items, and as whom it adopts them."""

    store: LocalStore
    config: JobConfig
    owner: str
    trust: ManifestTrust
    run_thread: RunThread
    log: JobLog
    peers: PeerClient | None = None
    view: PoolView | None = None
    """The pool (``cluster.pool``); None without one."""
    me: str = ""
    backups: BackupStore | None = None
    clock: Callable[[], float] = time.time

    def wanted(self) -> list[ItemId]:
        """The donor's items this node's rank continues from."""
        cf = self.config.continue_from
        assert cf is not None
        rank = self.config.node_rank
        return [ItemId(cf.job, cf.step, rank, w) for w in worker_slots(self.config)]

    def needed(self) -> bool:
        """Whether to bring the donor's step: this node holds no step of this job's rank at
        or past it (else this job ran on from it already, and restores its own)."""
        cf = self.config.continue_from
        if cf is None:
            return False
        job, rank = self.config.job_name, self.config.node_rank
        return not any(i.rank == rank and i.step >= cf.step for i in self.store.manifests(job))

    async def bring(self) -> None:
        """Adopt every wanted item as this job's; ``DonorMissing`` when one is nowhere."""
        cf = self.config.continue_from
        assert cf is not None
        for item in self.wanted():
            t0 = time.monotonic()
            manifest, tier = self.store.get(item), "this node"
            if manifest is not None:
                self.trust.check(manifest, self.owner)
            else:
                manifest, tier = await self._fetch(item, cf)
            own = dataclasses.replace(
                manifest,
                item=dataclasses.replace(item, job=self.config.job_name),
                attestation=None,
            )
            own = self.trust.attest(own, self.owner, self.clock())
            await self.run_thread(self.store.adopt, item, own)
            self.log.info(
                "continues from %s (from %s): %d bytes in %.3fs",
                item,
                tier,
                manifest.total_bytes,
                time.monotonic() - t0,
                step=cf.step,
            )

    async def _fetch(self, item: ItemId, cf: ContinueFrom) -> tuple[Manifest, str]:
        tried: list[str] = []
        if self.peers is not None and self.view is not None:
            for name in ranking(cf.job, await self.view.names(self.owner)):
                if name == self.me:
                    continue
                try:
                    got = await self.view.dial(self.owner, name, lambda m: self._pull(m, item))
                except (PeerError, ManifestError, CorruptItem, StoreError) as exc:
                    tried.append(f"node {name}: {exc}")
                    continue
                if got is not None:
                    return got, f"node {name}"
        if self.backups is not None:
            try:
                return await self.run_thread(self._download, self.backups, item), "the backup"
            except (ObjectStoreError, ManifestError, CorruptItem, StoreError, OSError) as exc:
                tried.append(f"the backup: {exc}")
        raise DonorMissing(
            f"cannot continue from job {cf.job}'s step {cf.step}: its item {item} is neither "
            f"on this node nor {_where(tried)}"
        )

    async def _pull(self, member: PoolMember, item: ItemId) -> Manifest | None:
        """``item`` from ``member`` when it lists it; None when it does not."""
        assert self.peers is not None
        infos = {i.item: i for i in await self.peers.list_items(member.address, item.job)}
        info = infos.get(item)
        if info is None:
            return None
        return await self.peers.pull_item(
            member.address,
            item,
            self.store,
            info.digest,
            total_bytes=info.total_bytes,
            vet=lambda m: self.trust.check(m, self.owner),
        )

    def _download(self, backups: BackupStore, item: ItemId) -> Manifest:
        commit = backups.read_commit(item.job, item.step)
        digest = None if commit is None else commit.items.get(item.key)
        if digest is None:
            raise StoreError(f"no COMMIT of step {item.step} of job {item.job} lists {item}")
        staged = self.store.new_staging()
        try:
            manifest = backups.fetch_pinned(
                item, digest, staged, vet=lambda m: self.trust.check(m, self.owner)
            )
            self.store.commit_staged(staged, manifest)
        finally:
            fsutil.remove_tree(staged)
        return manifest


def _where(tried: Iterable[str]) -> str:
    found = list(tried)
    return "in the pool or the backup" if not found else "in: " + "; ".join(found)[:600]
