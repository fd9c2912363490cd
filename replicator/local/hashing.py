"""Hashing and checking an item's files on disk against its manifest. I/O module.

``build_manifest`` walks and hashes an item's data (a directory tree or one file) with
crc32c; ``verify_item`` checks data against a manifest. Reads go in ``CHUNK`` pieces so
memory stays at one chunk whatever the item's size.

Taken data was written by a pod, which may still hold a descriptor of a directory inside
it: every walk and open goes through descriptors with no symlink at any component, from
``root`` (the store) down (``fsutil.open_beneath``), and a FIFO is refused, never waited on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import google_crc32c

from replicator.core.manifest import (
    CancelCheck,
    Cancelled,
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
    check_path,
)
from replicator.local import fsutil

CHUNK = 4 * 1024 * 1024
_LINKED = (errno.ELOOP, errno.EXDEV, errno.ENOTDIR)
"""What ``fsutil.open_beneath`` says when a component is a symlink (or not a directory)."""


def _refused(exc: OSError, what: str) -> ManifestError:
    return ManifestError(f"{what}: a symlink where a file or directory must be ({exc.strerror})")


def _never() -> bool:
    return False


def _descend(root: Path | None, data: Path) -> tuple[Path | int, str]:
    """Where to open ``data`` from: ``root`` (default: ``data``'s parent) and the way down."""
    base = data.parent if root is None else root
    return base, str(data.relative_to(base))


def read_chunks(
    path: Path, cancelled: CancelCheck = _never, *, root: Path | int | None = None, rel: str = ""
) -> Iterator[bytes]:
    """Yield a regular file's bytes in CHUNK-sized pieces; memory stays at one chunk.

    With ``root``, the file is ``rel`` below it, reached through no symlink; without, it is
    ``path`` (its last component not followed).
    """
    if root is None:
        root, rel = path.parent, path.name
    try:
        fd = fsutil.open_file_beneath(root, rel)
    except fsutil.NotRegularFile as exc:
        raise ManifestError(f"{rel!r} is {exc.kind}, not a regular file") from None
    except OSError as exc:
        if exc.errno in _LINKED:
            raise _refused(exc, repr(rel)) from None
        raise
    try:
        while chunk := os.read(fd, CHUNK):
            if cancelled():
                raise Cancelled(str(path))
            yield chunk
    finally:
        os.close(fd)


def file_crc32c(
    path: Path, cancelled: CancelCheck = _never, *, root: Path | int | None = None, rel: str = ""
) -> tuple[int, int]:
    """(size, crc32c) of one regular file (``root`` and ``rel`` as for ``read_chunks``)."""
    crc = 0
    size = 0
    for chunk in read_chunks(path, cancelled, root=root, rel=rel):
        crc = google_crc32c.extend(crc, chunk)
        size += len(chunk)
    return size, crc


def walk_tree(root: Path | int) -> tuple[list[str], list[str]]:
    """(dirs, files) below ``root`` (a path, or a directory descriptor) as sorted relative
    POSIX paths; no symlinks allowed, none followed, and no path a manifest could not carry
    (``check_path``). One descriptor below ``root`` is open at a time, whatever the tree's
    width: an item of many directories must not run out of them."""
    dirs: list[str] = []
    files: list[str] = []
    top = root if isinstance(root, int) else fsutil.open_dir_beneath(root, "")
    stack = [""]
    try:
        while stack:
            rel = stack.pop()
            # Opened beneath ``top`` without following any component: a directory swapped
            # for a symlink since its parent was scanned is refused (ELOOP), never walked.
            fd = fsutil.open_dir_beneath(top, rel) if rel else top
            try:
                with os.scandir(fd) as it:
                    names = [(e.name, e.stat(follow_symlinks=False).st_mode) for e in it]
            finally:
                if fd != top:
                    os.close(fd)
            for name, mode in names:
                sub = check_path(f"{rel}/{name}" if rel else name)
                if stat.S_ISDIR(mode):
                    dirs.append(sub)
                    stack.append(sub)
                elif stat.S_ISREG(mode):
                    files.append(sub)
                else:
                    raise ManifestError(f"{sub!r} is neither a regular file nor a directory")
    except OSError as exc:
        if exc.errno in _LINKED:
            raise _refused(exc, "walking the item") from None
        raise
    finally:
        if top is not root:
            os.close(top)
    return sorted(dirs), sorted(files)


def _lmode(base: Path | int, rel: str) -> int:
    """The mode of ``rel`` below ``base``, without following it or any component of it."""
    parent, _, name = rel.rpartition("/")
    try:
        fd = fsutil.open_dir_beneath(base, parent)
    except OSError as exc:
        if exc.errno in _LINKED:
            raise _refused(exc, rel) from None
        raise
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    finally:
        os.close(fd)


def build_manifest(
    item: ItemId, data: Path, cancelled: CancelCheck = _never, *, root: Path | None = None
) -> Manifest:
    """Hash an item's data (a directory tree or one file) into its manifest.

    ``root``: a directory above ``data`` (the store) from which no component may be a
    symlink; by default ``data``'s parent.
    """
    base, rel = _descend(root, data)
    mode = _lmode(base, rel)
    if stat.S_ISREG(mode):
        size, crc = file_crc32c(data, cancelled, root=base, rel=rel)
        return Manifest(item, ItemKind.FILE, (FileEntry("", size, crc),))
    if not stat.S_ISDIR(mode):
        raise ManifestError(f"{data} is neither a regular file nor a directory")
    top = fsutil.open_dir_beneath(base, rel)
    try:
        dirs, files = walk_tree(top)
        entries = []
        for path in files:
            size, crc = file_crc32c(data / path, cancelled, root=top, rel=path)
            entries.append(FileEntry(path, size, crc))
    finally:
        os.close(top)
    return Manifest(item, ItemKind.DIR, tuple(entries), tuple(dirs))


def data_file(data: Path, entry: FileEntry) -> Path:
    return data / entry.path if entry.path else data


def verify_item(
    manifest: Manifest, data: Path, cancelled: CancelCheck = _never, *, root: Path | None = None
) -> None:
    """Raise ``CorruptItem`` unless ``data`` holds exactly the manifest's bytes (``root`` as
    for ``build_manifest``: a symlink anywhere below it is corruption, never followed)."""
    base, rel = _descend(root, data)
    try:
        mode = _lmode(base, rel)
    except FileNotFoundError:
        raise CorruptItem(f"{manifest.item}: data is missing") from None
    except ManifestError as exc:
        raise CorruptItem(f"{manifest.item}: {exc}") from None
    if manifest.kind is ItemKind.DIR:
        if not stat.S_ISDIR(mode):
            raise CorruptItem(f"{manifest.item}: expected a directory")
        try:
            top = fsutil.open_dir_beneath(base, rel)
        except OSError as exc:
            if exc.errno in _LINKED:
                raise CorruptItem(f"{manifest.item}: {_refused(exc, rel)}") from None
            raise
    elif not stat.S_ISREG(mode):
        raise CorruptItem(f"{manifest.item}: expected a regular file")
    else:
        top = None
    try:
        if top is not None:
            try:
                dirs, files = walk_tree(top)
            except ManifestError as exc:
                raise CorruptItem(f"{manifest.item}: {exc}") from None
            if files != sorted(f.path for f in manifest.files) or dirs != sorted(manifest.dirs):
                raise CorruptItem(f"{manifest.item}: the file list differs from the manifest")
        for entry in manifest.files:
            _verify_file(
                manifest, entry, data, cancelled, (base, rel) if top is None else (top, entry.path)
            )
    finally:
        if top is not None:
            os.close(top)


def _verify_file(
    manifest: Manifest,
    entry: FileEntry,
    data: Path,
    cancelled: CancelCheck,
    where: tuple[Path | int, str],
) -> None:
    try:
        size, crc = file_crc32c(data_file(data, entry), cancelled, root=where[0], rel=where[1])
    except ManifestError as exc:
        raise CorruptItem(f"{manifest.item}: {exc}") from None
    if size != entry.size or crc != entry.crc32c:
        name = entry.path or "the file"
        raise CorruptItem(
            f"{manifest.item}: {name} has size {size} crc32c {crc:08x}, "
            f"manifest says size {entry.size} crc32c {entry.crc32c:08x}"
        )
