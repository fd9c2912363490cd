"""The local tier: the daemon's private store inside CHECKPOINT_DIR (``.mtc/``). I/O module.

Layout (all on the RAM disk, so taking a step from the workload is one rename)::

    .mtc/items/<job>/<step>/<rank>-<worker>/{MANIFEST.json, data}   committed items
    .mtc/ingest/<job>/<step>/<rank>-<worker>/data                    taken, not yet hashed
    .mtc/staging/<id>/...                                            incoming copies
    .mtc/trash/<id>                                                  being deleted
    .mtc/views/<incarnation>/<job>/<step>/<rank>-<worker>/data       hard-link copies
                                                                     that markers point at

An item exists only once its directory with ``MANIFEST.json`` sits under ``items/``; it
gets there by one rename of a directory whose manifest was written last. Data under
``ingest/`` came from the workload's own atomic rename, so it is complete and is hashed
again after a crash; ``staging/`` and ``trash/`` are wiped at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from replicator.core.contract import JOB_NAME_RE, STORE_DIR, ascii_digits
from replicator.core.manifest import (
    CancelCheck,
    CorruptItem,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
)
from replicator.local import fsutil
from replicator.local.hashing import build_manifest, verify_item

log = logging.getLogger(__name__)

MANIFEST_FILE = "MANIFEST.json"
DATA = "data"


class StoreError(Exception):
    """The store cannot do what was asked (for example, the RAM disk is full)."""


@dataclass(frozen=True)
class OpenReport:
    """What ``LocalStore.open`` found: committed items, and taken data still to hash."""

    items: int
    pending_ingest: tuple[ItemId, ...]
    discarded: tuple[str, ...]


def _parse_item_path(job: str, step: str, key: str) -> ItemId | None:
    if not JOB_NAME_RE.fullmatch(job) or not ascii_digits(step):
        return None
    rank, sep, worker = key.partition("-")
    if not (sep and ascii_digits(rank) and ascii_digits(worker)):
        return None
    return ItemId(job, int(step), int(rank), int(worker))


class LocalStore:
    """Committed items on this node, with an in-memory index of their manifests.

    The daemon is the store's only writer; methods are safe to call from worker threads.
    """

    def __init__(self, checkpoint_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.root = checkpoint_dir / STORE_DIR
        self.items_root = self.root / "items"
        self.ingest_root = self.root / "ingest"
        self.staging_root = self.root / "staging"
        self.trash = self.root / "trash"
        self.views_root = self.root / "views"
        self._lock = threading.Lock()
        self._manifests: dict[ItemId, Manifest] = {}
        self._lock_fd: int | None = None

    # --- start-up --------------------------------------------------------------------------

    def open(self) -> OpenReport:
        """Lock the store, create the layout, wipe in-flight leftovers, index committed items."""
        for d in (self.items_root, self.ingest_root, self.staging_root, self.trash):
            d.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Two daemons on one store would wipe each other's staging and race on commits.
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreError(
                f"another mtc-replicator already serves {self.checkpoint_dir}"
            ) from None
        for leftover in (self.staging_root, self.trash):
            for child in leftover.iterdir():
                fsutil.remove_tree(child)
        discarded: list[str] = []
        manifests: dict[ItemId, Manifest] = {}
        for item, item_dir in self._walk(self.items_root):
            if item is None:
                discarded.append(str(item_dir))
                fsutil.discard_tree(item_dir, self.trash)
                continue
            try:
                manifest = Manifest.from_json((item_dir / MANIFEST_FILE).read_bytes())
                if manifest.item != item:
                    raise ManifestError(f"manifest names {manifest.item}, directory is {item}")
            except (OSError, ManifestError) as exc:
                log.warning("discarding uncommitted or unreadable item %s: %s", item_dir, exc)
                discarded.append(str(item_dir))
                fsutil.discard_tree(item_dir, self.trash)
                continue
            manifests[item] = manifest
        for item, item_dir in self._walk(self.ingest_root):
            if item is None or not (item_dir / DATA).exists():
                discarded.append(str(item_dir))
                fsutil.discard_tree(item_dir, self.trash)
        with self._lock:
            self._manifests = manifests
        self._prune_empty(self.items_root)
        self._prune_empty(self.ingest_root)
        return OpenReport(len(manifests), tuple(self.pending_ingest()), tuple(discarded))

    def close(self) -> None:
        """Release the store's lock, so another ``LocalStore`` (or a restart) can open it."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def pending_ingest(self) -> list[ItemId]:
        """Items taken from the workload but not yet committed (after a crash or a stop)."""
        return sorted(
            item
            for item, item_dir in self._walk(self.ingest_root)
            if item is not None and (item_dir / DATA).exists()
        )

    def _walk(self, root: Path) -> list[tuple[ItemId | None, Path]]:
        found: list[tuple[ItemId | None, Path]] = []
        for job_dir in sorted(root.iterdir()):
            if not job_dir.is_dir():
                found.append((None, job_dir))
                continue
            for step_dir in sorted(job_dir.iterdir()):
                if not step_dir.is_dir():
                    found.append((None, step_dir))
                    continue
                for item_dir in sorted(step_dir.iterdir()):
                    found.append(
                        (_parse_item_path(job_dir.name, step_dir.name, item_dir.name), item_dir)
                    )
        return found

    def _prune_empty(self, root: Path) -> None:
        for job_dir in list(root.iterdir()):
            for step_dir in list(job_dir.iterdir()) if job_dir.is_dir() else []:
                with contextlib.suppress(OSError):
                    step_dir.rmdir()
            with contextlib.suppress(OSError):
                job_dir.rmdir()

    # --- paths -----------------------------------------------------------------------------

    def item_dir(self, item: ItemId) -> Path:
        return self.items_root / item.job / str(item.step) / item.key

    def data_path(self, item: ItemId) -> Path:
        return self.item_dir(item) / DATA

    def marker_target(self, item: ItemId) -> str:
        """The item's data relative to CHECKPOINT_DIR: restore markers must be relative."""
        return os.path.relpath(self.data_path(item), self.checkpoint_dir)

    def owns_link_target(self, target: str) -> bool:
        """Whether a symlink target (as read with readlink) points into this store."""
        norm = os.path.normpath(target)
        return norm == STORE_DIR or norm.startswith(STORE_DIR + os.sep)

    def item_of_link(self, target: str) -> ItemId | None:
        """The item a marker or ``<N>`` link target points at (its data or a view of it)."""
        parts = os.path.normpath(target).split(os.sep)
        if len(parts) >= 5 and parts[0] == STORE_DIR and parts[1] == "items":
            return _parse_item_path(*parts[2:5])
        if len(parts) >= 6 and parts[0] == STORE_DIR and parts[1] == "views":
            return _parse_item_path(*parts[3:6])
        return None

    # --- views: what the workload may see and delete ------------------------------------------

    def expose(self, item: ItemId, view: str) -> str:
        """A hard-link copy of a committed item for one incarnation; its path for a marker.

        Clients may delete what a marker points at (Orbax's retention deletes through the
        ``<N>`` link it made of the marker). Unlinking names in a view leaves the item's own
        names, so committed data survives; tmpfs makes the links nearly free.
        """
        manifest = self.get(item)
        if manifest is None:
            raise StoreError(f"{item}: not in the local store")
        final = self.views_root / view / item.job / str(item.step) / item.key
        if not final.exists():
            staged = self.new_staging()
            src, dst = self.data_path(item), staged / DATA
            try:
                if manifest.kind is ItemKind.FILE:
                    os.link(src, dst)
                else:
                    dst.mkdir()
                    for d in manifest.dirs:
                        # A peer's manifest may list a dir before its parent.
                        (dst / d).mkdir(parents=True, exist_ok=True)
                    for f in manifest.files:
                        os.link(src / f.path, dst / f.path)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.rename(staged, final)
            except OSError as exc:
                fsutil.remove_tree(staged)
                raise StoreError(f"cannot expose {item}: {exc}") from exc
        return os.path.relpath(final / DATA, self.checkpoint_dir)

    def drop_views(self, item: ItemId | None = None) -> None:
        """Remove every view (a new incarnation), or only the views of ``item``."""
        if not self.views_root.is_dir():
            return
        for view in list(self.views_root.iterdir()):
            if item is None:
                fsutil.discard_tree(view, self.trash)
            else:
                fsutil.discard_tree(view / item.job / str(item.step) / item.key, self.trash)

    # --- index -----------------------------------------------------------------------------

    def manifests(self, job: str | None = None) -> dict[ItemId, Manifest]:
        with self._lock:
            return {i: m for i, m in self._manifests.items() if job is None or i.job == job}

    def get(self, item: ItemId) -> Manifest | None:
        with self._lock:
            return self._manifests.get(item)

    # --- writing ---------------------------------------------------------------------------

    def take(self, src: Path, item: ItemId) -> None:
        """Move the workload's finished step dir or ``.save`` file into the store (rename)."""
        dest = self.ingest_root / item.job / str(item.step) / item.key
        if dest.exists():
            # A previous take of the same item never got hashed: the newer data wins.
            fsutil.discard_tree(dest, self.trash)
        dest.mkdir(parents=True)
        try:
            os.rename(src, dest / DATA)
        except OSError:
            dest.rmdir()
            raise

    def commit_ingested(self, item: ItemId, cancelled: CancelCheck | None = None) -> Manifest:
        """Hash taken data, write its manifest last, and publish it as a committed item."""
        src = self.ingest_root / item.job / str(item.step) / item.key
        manifest = build_manifest(item, src / DATA, *([cancelled] if cancelled else []))
        self._publish(src, manifest)
        return manifest

    def discard_ingest(self, item: ItemId) -> None:
        """Drop taken data that can never be committed (for example, it holds a symlink)."""
        fsutil.discard_tree(self.ingest_root / item.job / str(item.step) / item.key, self.trash)

    def new_staging(self) -> Path:
        """A fresh directory for an incoming item; put its data at ``<dir>/data``."""
        path = self.staging_root / uuid.uuid4().hex
        path.mkdir(parents=True)
        return path

    def commit_staged(self, staged: Path, manifest: Manifest) -> None:
        """Publish a verified incoming copy (its data at ``staged/data``)."""
        self._publish(staged, manifest)

    def _publish(self, src: Path, manifest: Manifest) -> None:
        try:
            fsutil.atomic_write_bytes(src / MANIFEST_FILE, manifest.to_json())
            final = self.item_dir(manifest.item)
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                fsutil.discard_tree(final, self.trash)
            os.rename(src, final)
            for parent in (src.parent, src.parent.parent):
                if parent in (self.ingest_root, self.staging_root):
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()  # an emptied ingest step or job directory
        except OSError as exc:
            raise StoreError(f"cannot commit {manifest.item}: {exc}") from exc
        with self._lock:
            self._manifests[manifest.item] = manifest

    def verify(self, item: ItemId, cancelled: CancelCheck | None = None) -> Manifest:
        """Re-read every byte of a committed item; raise ``CorruptItem`` on any mismatch."""
        manifest = self.get(item)
        if manifest is None:
            raise CorruptItem(f"{item}: not in the local store")
        verify_item(manifest, self.data_path(item), *([cancelled] if cancelled else []))
        return manifest

    def delete(self, item: ItemId) -> None:
        """Remove a committed item: it vanishes in one rename, then is deleted."""
        with self._lock:
            self._manifests.pop(item, None)
        fsutil.discard_tree(self.item_dir(item), self.trash)
        step_dir = self.item_dir(item).parent
        for d in (step_dir, step_dir.parent):
            try:
                d.rmdir()
            except OSError:
                break
