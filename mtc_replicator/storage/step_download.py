"""Downloading one committed backup step into a directory, every byte verified. I/O module.

The checks are the daemon's restore's: the COMMIT is read through ``trust`` (a refused
signature refuses the download), each item's manifest must have the digest the COMMIT pins
and an attestation its producer signed for the COMMIT's owner (``attested``),
and every file's size and crc32c must match its manifest (``BackupStore.fetch_item``).
Items are staged in a hidden directory inside the target and renamed to their final names
only once every one of them verified, so a failure leaves nothing at those names.

Each item lands at ``DIR/n<rank>-w<worker>``: what that worker's restore marker would point
at (the step directory of a directory item, the file of a file item).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.core.attestation import OPEN_MANIFESTS, ManifestTrust
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.local import fsutil
from mtc_replicator.storage.backup import BackupStore

STAGING_PREFIX = ".mtc-download-"


class DownloadError(Exception):
    """The step cannot be downloaded as asked: not committed, no such rank, a bad target."""


@dataclass(frozen=True)
class DownloadPlan:
    record: CommitRecord
    items: tuple[tuple[ItemId, Manifest], ...]

    @property
    def total_bytes(self) -> int:
        return sum(m.total_bytes for _, m in self.items)


def target_name(item: ItemId) -> str:
    """Where ``item`` goes below the target directory."""
    return f"n{item.rank}-w{item.worker}"


def _item_of(record: CommitRecord, key: str) -> ItemId:
    rank, _, worker = key.partition("-")
    return ItemId(record.job, record.step, int(rank), int(worker))


def plan_download(
    store: BackupStore,
    job: str,
    step: int,
    rank: int | None = None,
    attested: ManifestTrust = OPEN_MANIFESTS,
) -> DownloadPlan:
    """The step's COMMIT (checked by the store's trust) and the manifest of every item asked
    for, each attested as ``attested`` wants for the COMMIT's owner. Raises
    ``DownloadError`` when the step is not committed or has no such rank,
    ``RecordRefused``/``ManifestError`` for a COMMIT that cannot be believed, ``CorruptItem``
    for a manifest that is not the one committed (``Unattested``: not one its producer
    signed for that owner)."""
    record = store.read_commit(job, step)
    if record is None:
        raise DownloadError(f"step {step} of job {job} is not committed in {store.url}")
    # A set: a hostile COMMIT may name one item twice ("1-0" and "01-0").
    items = sorted({_item_of(record, key) for key in record.items})
    if rank is not None:
        items = [i for i in items if i.rank == rank]
        if not items:
            ranks = sorted({i.rank for i in _all(record)})
            raise DownloadError(
                f"step {step} of job {job} has no rank {rank} (its ranks: "
                f"{', '.join(map(str, ranks)) or 'none'})"
            )
    manifests = tuple((i, store.item_manifest(record, i)) for i in items)
    for _, manifest in manifests:
        attested.check(manifest, record.owner or UNOWNED)
    return DownloadPlan(record, manifests)


def _all(record: CommitRecord) -> list[ItemId]:
    return [_item_of(record, key) for key in record.items]


def check_target(dest: Path, *, force: bool) -> None:
    """Refuse a target that is not a directory, or one that holds anything, unless ``force``."""
    if dest.exists() and not dest.is_dir():
        raise DownloadError(f"{dest} is not a directory")
    if dest.is_dir() and not force and any(dest.iterdir()):
        raise DownloadError(f"{dest} is not empty; add --force to download into it anyway")


def download(
    store: BackupStore,
    plan: DownloadPlan,
    dest: Path,
    *,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Fetch and verify every item of ``plan``, then move them into ``dest``; the paths made.

    With ``force``, an item's final name already in ``dest`` is replaced (nothing else there
    is touched). Raises ``CorruptItem`` (nothing moved into place) when a byte differs.
    """
    check_target(dest, force=force)
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=dest))
    try:
        for item, _ in plan.items:
            staged = staging / target_name(item)
            staged.mkdir()
            store.fetch_item(plan.record, item, staged, progress=progress)
        return _place(plan, staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _place(plan: DownloadPlan, staging: Path, dest: Path) -> list[Path]:
    """Move every staged item to its final name, all or none: a name already there is moved
    aside into ``staging`` first, and on any failure the items placed so far are taken
    back out and what they replaced is put back."""
    placed: list[tuple[Path, Path | None]] = []
    try:
        for item, _ in plan.items:
            final = dest / target_name(item)
            aside: Path | None = None
            if final.exists() or final.is_symlink():
                aside = staging / f"replaced-{target_name(item)}"
                os.replace(final, aside)
            placed.append((final, aside))
            os.replace(staging / target_name(item) / "data", final)
    except OSError:
        for final, aside in reversed(placed):
            with contextlib.suppress(OSError):
                fsutil.remove_tree(final)
                if aside is not None:
                    os.replace(aside, final)
        raise
    return [final for final, _ in placed]
