"""The local tier: the daemon's private store, beside CHECKPOINT_DIR. I/O module.

Layout (all on the RAM disk, so taking a step from the workload is one rename)::

    STORE/items/<job>/<step>/<rank>-<worker>/{MANIFEST.json, data}   committed items
    STORE/aside/<job>/<step>/<rank>-<worker>/{MANIFEST.json, data}   committed, set aside
    STORE/ingest/<job>/<step>/<rank>-<worker>/data                    taken, not yet hashed
    STORE/staging/<generation>-<id>/...                               incoming copies
    STORE/trash/<id>                                                  being deleted
    STORE/store-owner                     whose items these are (``local.store_owner``)
    CHECKPOINT_DIR/.mtc/views/<incarnation>/<job>/<step>/<rank>-<worker>/data
                                            hard-link copies that markers point at

STORE (``--store-dir``, by default ``<CHECKPOINT_DIR>.mtc-store``) is outside CHECKPOINT_DIR,
which training pods read and write, and on its filesystem (``core.storedir``). Pods see only
the views of the job they run. Nothing found under ``CHECKPOINT_DIR/.mtc`` is ever taken for
the store's: an older daemon's store there is discarded at start.

An item exists only once its directory with ``MANIFEST.json`` sits under ``items/``; it
gets there by one rename of a directory whose manifest was written last. Data under
``ingest/`` came from the workload's own atomic rename, so it is complete and is hashed
again after a crash; ``staging/`` and ``trash/`` are wiped at start. Items a restore round
passed over move to ``aside/`` (one rename each way, ``core.aside``): out of the index, so
nothing exposes, serves, pushes or counts them, and back for the next incarnation's join.
Taken data may still be changed by a pod that kept a descriptor into it, so it is read only
through descriptors that refuse a symlink at every component (``fsutil.open_beneath``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mtc_replicator.core.contract import STORE_DIR, ascii_digits
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import (
    CancelCheck,
    CorruptItem,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.storedir import VIEWS_DIR, default_store_dir, placement_problem
from mtc_replicator.local import fsutil
from mtc_replicator.local.hashing import build_manifest, verify_item

log = logging.getLogger(__name__)

MANIFEST_FILE = "MANIFEST.json"
DATA = "data"


class StoreError(Exception):
    """The store cannot do what was asked (for example, the RAM disk is full)."""


class StorePlacementError(StoreError):
    """The store is inside CHECKPOINT_DIR or on another filesystem: a configuration error."""


@dataclass(frozen=True)
class OpenReport:
    """What ``LocalStore.open`` found: committed items, and taken data still to hash."""

    items: int
    pending_ingest: tuple[ItemId, ...]
    discarded: tuple[str, ...]


def item_path(item: ItemId) -> PurePosixPath:
    """``<job>/<step>/<rank>-<worker>``: where an item sits below ``items/``, ``ingest/`` and
    a view; the inverse of ``_parse_item_path``."""
    return PurePosixPath(item.job, str(item.step), item.key)


def view_path(view: str, item: ItemId) -> PurePosixPath:
    """The data of ``item``'s view for incarnation ``view``, relative to CHECKPOINT_DIR."""
    return PurePosixPath(STORE_DIR, VIEWS_DIR, view) / item_path(item) / DATA


def _parse_item_path(job: str, step: str, key: str) -> ItemId | None:
    if not is_job_name(job) or not ascii_digits(step):
        return None
    rank, sep, worker = key.partition("-")
    if not (sep and ascii_digits(rank) and ascii_digits(worker)):
        return None
    return ItemId(job, int(step), int(rank), int(worker))


class LocalStore:
    """Committed items on this node, with an in-memory index of their manifests.

    The daemon is the store's only writer; methods are safe to call from worker threads.
    """

    def __init__(self, checkpoint_dir: Path, store_dir: Path | None = None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.root = store_dir or Path(default_store_dir(PurePosixPath(checkpoint_dir)))
        self.items_root = self.root / "items"
        self.aside_root = self.root / "aside"
        self.ingest_root = self.root / "ingest"
        self.staging_root = self.root / "staging"
        self.trash = self.root / "trash"
        self.views_root = checkpoint_dir / STORE_DIR / VIEWS_DIR
        """In CHECKPOINT_DIR, where pods can change anything: reached only by descriptors."""
        self._lock = threading.Lock()
        self._manifests: dict[ItemId, Manifest] = {}
        self._aside: dict[ItemId, Manifest] = {}
        self._lock_fd: int | None = None
        self._generation = 0
        """Bumped by ``purge``: a copy staged or taken before it is never committed after."""

    # --- start-up --------------------------------------------------------------------------

    def open(self) -> OpenReport:
        """Lock the store, create the layout, wipe in-flight leftovers, index committed items."""
        self._check_placement()
        for d in (
            self.items_root,
            self.aside_root,
            self.ingest_root,
            self.staging_root,
            self.trash,
        ):
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
        discarded = self._discard_pod_store()
        manifests = self._index(self.items_root, discarded)
        aside = self._index(self.aside_root, discarded)
        for item, item_dir in self._walk(self.ingest_root):
            if item is None or not (item_dir / DATA).exists():
                discarded.append(str(item_dir))
                fsutil.discard_tree(item_dir, self.trash)
        with self._lock:
            self._manifests = manifests
            self._aside = aside
        for root in (self.items_root, self.aside_root, self.ingest_root):
            self._prune_empty(root)
        return OpenReport(len(manifests), tuple(self.pending_ingest()), tuple(discarded))

    def _index(self, root: Path, discarded: list[str]) -> dict[ItemId, Manifest]:
        """The items under ``root`` with a readable manifest naming them; others discarded."""
        manifests: dict[ItemId, Manifest] = {}
        for item, item_dir in self._walk(root):
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
        return manifests

    def _check_placement(self) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        ckpt = PurePosixPath(self.checkpoint_dir.resolve())
        # Inside CHECKPOINT_DIR is refused before anything is made there.
        problem = placement_problem(ckpt, PurePosixPath(self.root.resolve()), same_filesystem=True)
        if problem is None:
            self.root.mkdir(parents=True, exist_ok=True)
            root = self.root.resolve()
            same = os.stat(ckpt).st_dev == os.stat(root).st_dev
            problem = placement_problem(ckpt, PurePosixPath(root), same_filesystem=same)
        if problem is not None:
            raise StorePlacementError(problem)

    def _discard_pod_store(self) -> list[str]:
        """Discard everything under ``CHECKPOINT_DIR/.mtc`` but the views.

        Pods write there: an older daemon's store (``items/``, ``ingest/``, ...) or anything
        planted is never committed, whatever manifests it carries. Its jobs restore from
        peers or the backup instead.
        """
        discarded: list[str] = []
        try:
            pod_dir = self._open_pod_dir(create=False)
        except FileNotFoundError:
            return discarded
        try:
            for name in sorted(os.listdir(pod_dir)):
                if name == VIEWS_DIR and stat.S_ISDIR(
                    os.stat(name, dir_fd=pod_dir, follow_symlinks=False).st_mode
                ):
                    continue
                discarded.append(str(self.checkpoint_dir / STORE_DIR / name))
                self._discard_at(pod_dir, name)
        finally:
            os.close(pod_dir)
        if discarded:
            log.warning(
                "discarded %s: a store inside CHECKPOINT_DIR, which pods can write, is never "
                "trusted; its jobs restore from peers or the backup",
                ", ".join(discarded),
            )
        return discarded

    def _open_pod_dir(self, *, create: bool) -> int:
        """A descriptor of ``CHECKPOINT_DIR/.mtc``; a symlink or file a pod put there is
        removed (and, with ``create``, replaced by a directory)."""
        return _open_own_dir(self.checkpoint_dir, STORE_DIR, create=create)

    def _open_views(self, *, create: bool) -> int:
        pod_dir = self._open_pod_dir(create=create)
        try:
            return _open_own_dir(pod_dir, VIEWS_DIR, create=create)
        finally:
            os.close(pod_dir)

    def _discard_at(self, dir_fd: int, name: str) -> None:
        """``discard_tree`` of ``name`` in ``dir_fd``: gone in one rename, deleted after."""
        target = self.trash / uuid.uuid4().hex
        try:
            os.rename(name, target, src_dir_fd=dir_fd)
        except FileNotFoundError:
            return
        fsutil.remove_tree(target)

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
        return self.items_root / item_path(item)

    def data_path(self, item: ItemId) -> Path:
        return self.item_dir(item) / DATA

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
        """A hard-link copy of a committed item for one incarnation; its path for a marker,
        relative to CHECKPOINT_DIR (``.mtc/views/<view>/<job>/<step>/<key>/data``).

        Clients may delete what a marker points at (Orbax's retention deletes through the
        ``<N>`` link it made of the marker). Unlinking names in a view leaves the item's own
        names, so committed data survives; tmpfs makes the links nearly free. The view is
        built in the store and renamed into CHECKPOINT_DIR through descriptors, so no
        symlink a pod put on the way is followed, and whatever a pod put at its name is
        replaced.
        """
        manifest = self.get(item)
        if manifest is None:
            raise StoreError(f"{item}: not in the local store")
        staged = self.new_staging()
        try:
            self._link_copy(manifest, staged / DATA)
            views = self._open_views(create=True)
            try:
                parent = views
                for name in (view, *item_path(item).parent.parts):
                    sub = _open_own_dir(parent, name, create=True)
                    if parent != views:
                        os.close(parent)
                    parent = sub
                try:
                    self._discard_at(parent, item.key)
                    os.rename(staged, item.key, dst_dir_fd=parent)
                finally:
                    if parent != views:
                        os.close(parent)
            finally:
                os.close(views)
        except OSError as exc:
            fsutil.remove_tree(staged)
            raise StoreError(f"cannot expose {item}: {exc}") from exc
        return str(view_path(view, item))

    def _link_copy(self, manifest: Manifest, dst: Path) -> None:
        """Hard-link every file of a committed item at ``dst`` (in the store's staging),
        reading the item through no symlink; a file that is not regular is refused."""
        data = self.data_path(manifest.item).relative_to(self.root)
        if manifest.kind is ItemKind.FILE:
            parent = fsutil.open_dir_beneath(self.root, data.parent)
            try:
                _link_regular(parent, data.name, dst)
            finally:
                os.close(parent)
            return
        dst.mkdir()
        for d in manifest.dirs:
            # A peer's manifest may list a dir before its parent.
            (dst / d).mkdir(parents=True, exist_ok=True)
        top = fsutil.open_dir_beneath(self.root, data)
        try:
            for f in manifest.files:
                rel = PurePosixPath(f.path)
                parent = fsutil.open_dir_beneath(top, rel.parent)
                try:
                    _link_regular(parent, rel.name, dst / f.path)
                finally:
                    os.close(parent)
        finally:
            os.close(top)

    def drop_views(self, item: ItemId | None = None, *, keep: Collection[str] = ()) -> None:
        """Remove every view but those of the incarnations in ``keep`` (a new incarnation;
        other job directories' run on), or only the views of ``item``."""
        try:
            views = self._open_views(create=False)
        except FileNotFoundError:
            return
        try:
            for name in os.listdir(views):
                if item is None:
                    if name not in keep:
                        self._discard_at(views, name)
                    continue
                try:
                    step = fsutil.open_dir_beneath(
                        views, PurePosixPath(name) / item_path(item).parent
                    )
                except OSError:
                    continue  # not a view of this item (or not ours: discarded with the rest)
                try:
                    self._discard_at(step, item.key)
                finally:
                    os.close(step)
        finally:
            os.close(views)

    # --- index -----------------------------------------------------------------------------

    def manifests(self, job: str | None = None) -> dict[ItemId, Manifest]:
        with self._lock:
            return {i: m for i, m in self._manifests.items() if job is None or i.job == job}

    def get(self, item: ItemId) -> Manifest | None:
        with self._lock:
            return self._manifests.get(item)

    # --- set aside: committed items a restore round passed over (core.aside) ----------------

    def aside(self, job: str | None = None) -> dict[ItemId, Manifest]:
        """The items set aside (not in ``manifests``), of ``job`` or of every job."""
        with self._lock:
            return {i: m for i, m in self._aside.items() if job is None or i.job == job}

    def set_aside(self, item: ItemId) -> None:
        """Take a committed item out of the index, its files kept (one rename)."""
        with self._lock:
            manifest = self._manifests.pop(item, None)
        if manifest is None:
            return
        dest = self.aside_root / item_path(item)
        try:
            if dest.exists():
                fsutil.discard_tree(dest, self.trash)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.rename(self.item_dir(item), dest)
        except OSError as exc:
            with self._lock:
                self._manifests[item] = manifest
            raise StoreError(f"cannot set {item} aside: {exc}") from exc
        with self._lock:
            self._aside[item] = manifest
        self._remove_empty_parents(self.item_dir(item))

    def bring_back(self, job: str | None = None) -> list[ItemId]:
        """Put the aside items (of ``job``, or all) back among the committed ones, for a new
        incarnation's join; one committed again meanwhile keeps the newer copy."""
        back: list[ItemId] = []
        for item, manifest in sorted(self.aside(job).items()):
            src = self.aside_root / item_path(item)
            if self.get(item) is not None:
                self.delete_aside(item)
                continue
            try:
                self.item_dir(item).parent.mkdir(parents=True, exist_ok=True)
                os.rename(src, self.item_dir(item))
            except OSError as exc:
                raise StoreError(f"cannot bring {item} back: {exc}") from exc
            with self._lock:
                self._aside.pop(item, None)
                self._manifests[item] = manifest
            self._remove_empty_parents(src)
            back.append(item)
        return back

    def delete_aside(self, item: ItemId) -> None:
        """Remove an item set aside: it vanishes in one rename, then is deleted."""
        with self._lock:
            self._aside.pop(item, None)
        path = self.aside_root / item_path(item)
        fsutil.discard_tree(path, self.trash)
        self._remove_empty_parents(path)

    # --- writing ---------------------------------------------------------------------------

    def take(self, src: Path, item: ItemId) -> None:
        """Move the workload's finished step dir or ``.save`` file into the store (rename)."""
        dest = self.ingest_root / item_path(item)
        if dest.exists():
            # A previous take of the same item never got hashed: the newer data wins.
            fsutil.discard_tree(dest, self.trash)
        dest.mkdir(parents=True)
        try:
            os.rename(src, dest / DATA)
        except OSError:
            dest.rmdir()
            raise

    def commit_ingested(
        self,
        item: ItemId,
        cancelled: CancelCheck | None = None,
        attest: Callable[[Manifest], Manifest] | None = None,
    ) -> Manifest:
        """Hash taken data, write its manifest last, and publish it as a committed item;
        ``attest`` adds the producing node's attestation (``core.attestation``)."""
        generation = self._generation
        src = self.ingest_root / item_path(item)
        manifest = build_manifest(
            item, src / DATA, *([cancelled] if cancelled else []), root=self.root
        )
        if attest is not None:
            manifest = attest(manifest)
        self._publish(src, manifest, generation)
        return manifest

    def discard_ingest(self, item: ItemId) -> None:
        """Drop taken data that can never be committed (for example, it holds a symlink)."""
        fsutil.discard_tree(self.ingest_root / item_path(item), self.trash)

    def new_staging(self) -> Path:
        """A fresh directory for an incoming item; put its data at ``<dir>/data``."""
        path = self.staging_root / f"{self._generation}-{uuid.uuid4().hex}"
        path.mkdir(parents=True)
        return path

    def commit_staged(self, staged: Path, manifest: Manifest) -> None:
        """Publish a verified incoming copy (its data at ``staged/data``); refused when the
        store was purged since ``new_staging`` made ``staged``."""
        generation, _, _ = staged.name.partition("-")
        self._publish(staged, manifest, int(generation) if generation.isdigit() else -1)

    def _publish(self, src: Path, manifest: Manifest, generation: int) -> None:
        if generation != self._generation:
            raise StoreError(f"cannot commit {manifest.item}: the store was purged meanwhile")
        try:
            fsutil.atomic_write_bytes(src / MANIFEST_FILE, manifest.to_json())
            final = self.item_dir(manifest.item)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                # Staged copies are wiped at start: swapped, a kill leaves the old copy or
                # the new; taken data survives under ingest/, so there the old may go first.
                swap = not src.is_relative_to(self.ingest_root)
                fsutil.replace_tree(src, final, self.trash, swap=swap)
            except OSError:
                if not final.exists():
                    with self._lock:
                        self._manifests.pop(manifest.item, None)  # its copy is gone
                raise
            for parent in (src.parent, src.parent.parent):
                if parent in (self.ingest_root, self.staging_root):
                    break
                with contextlib.suppress(OSError):
                    parent.rmdir()  # an emptied ingest step or job directory
        except OSError as exc:
            raise StoreError(f"cannot commit {manifest.item}: {exc}") from exc
        with self._lock:
            purged = generation != self._generation
            if not purged:
                self._manifests[manifest.item] = manifest
        if purged:  # a purge ran between the check and the rename: this copy goes too
            fsutil.discard_tree(final, self.trash)
            raise StoreError(f"cannot commit {manifest.item}: the store was purged meanwhile")

    def adopt(self, src: ItemId, manifest: Manifest) -> None:
        """Commit ``manifest``'s item with the very files of committed item ``src``
        (hard-linked, nothing copied or re-read): another job's step continued under this
        job's name (``cluster.donor``). The two manifests must list the same files."""
        held = self.get(src)
        if held is None:
            raise StoreError(f"{src}: not in the local store")
        if (held.kind, held.files, held.dirs) != (manifest.kind, manifest.files, manifest.dirs):
            raise StoreError(f"{manifest.item}: its manifest lists other files than {src}'s")
        staged = self.new_staging()
        try:
            self._link_copy(held, staged / DATA)
            self.commit_staged(staged, manifest)
        except OSError as exc:
            raise StoreError(f"cannot adopt {src} as {manifest.item}: {exc}") from exc
        finally:
            fsutil.remove_tree(staged)  # gone with the commit's rename, unless it failed

    def verify(self, item: ItemId, cancelled: CancelCheck | None = None) -> Manifest:
        """Re-read every byte of a committed item; raise ``CorruptItem`` on any mismatch."""
        manifest = self.get(item)
        if manifest is None:
            raise CorruptItem(f"{item}: not in the local store")
        verify_item(
            manifest, self.data_path(item), *([cancelled] if cancelled else []), root=self.root
        )
        return manifest

    def purge(self) -> dict[ItemId, Manifest]:
        """Remove every item, committed, set aside or on its way in (a node handoff): the
        indexes empty first, then ``items/``, ``aside/`` and ``ingest/`` vanish in one rename
        each, and no copy being staged or hashed now is committed after. Returns what was
        committed (set-aside items included: they would come back at the next join)."""
        with self._lock:
            gone, self._manifests = self._manifests, {}
            gone.update(self._aside)
            self._aside = {}
            self._generation += 1
        for root in (self.items_root, self.aside_root, self.ingest_root):
            fsutil.discard_tree(root, self.trash)
            root.mkdir(exist_ok=True)
        for child in list(self.staging_root.iterdir()):
            fsutil.discard_tree(child, self.trash)
        return gone

    def delete(self, item: ItemId) -> None:
        """Remove a committed item: it vanishes in one rename, then is deleted."""
        with self._lock:
            self._manifests.pop(item, None)
        fsutil.discard_tree(self.item_dir(item), self.trash)
        self._remove_empty_parents(self.item_dir(item))

    def _remove_empty_parents(self, item_dir: Path) -> None:
        """An item's step and job directories, once it left them empty."""
        for d in (item_dir.parent, item_dir.parent.parent):
            try:
                d.rmdir()
            except OSError:
                break


def _open_own_dir(parent: Path | int, name: str, *, create: bool) -> int:
    """A descriptor of directory ``name`` in ``parent``, which pods can write: a symlink,
    file or FIFO a pod put at the name is unlinked (never followed) and, with ``create``, a
    directory made in its place. ``FileNotFoundError`` when absent and not ``create``."""
    for _ in range(3):
        try:
            return fsutil.open_dir_beneath(parent, name)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            pfd = (
                parent if isinstance(parent, int) else os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            )
            try:
                os.unlink(name, dir_fd=pfd)
            finally:
                if pfd is not parent:
                    os.close(pfd)
            if not create:
                raise FileNotFoundError(errno.ENOENT, "removed a planted name", name) from None
        pfd = parent if isinstance(parent, int) else os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o755, dir_fd=pfd)
        finally:
            if pfd is not parent:
                os.close(pfd)
    raise StoreError(f"cannot make the directory {name}: something keeps replacing it")


def _link_regular(src_dir: int, name: str, dst: Path) -> None:
    """Hard-link the regular file ``name`` of ``src_dir`` at ``dst``, never a symlink."""
    if not stat.S_ISREG(os.stat(name, dir_fd=src_dir, follow_symlinks=False).st_mode):
        raise OSError(errno.EINVAL, f"{name} is not a regular file")
    os.link(name, dst, src_dir_fd=src_dir, follow_symlinks=False)
