"""Hashing and checking an item's files on disk against its manifest. I/O module.

``build_manifest`` walks and hashes an item's data (a directory tree or one file) with
crc32c; ``verify_item`` checks data against a manifest. Reads go in ``CHUNK`` pieces so
memory stays at one chunk whatever the item's size.
"""

from __future__ import annotations

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

CHUNK = 4 * 1024 * 1024


def _never() -> bool:
    return False


def read_chunks(path: Path, cancelled: CancelCheck = _never) -> Iterator[bytes]:
    """Yield a file's bytes in CHUNK-sized pieces; memory stays at one chunk."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        while chunk := os.read(fd, CHUNK):
            if cancelled():
                raise Cancelled(str(path))
            yield chunk
    finally:
        os.close(fd)


def file_crc32c(path: Path, cancelled: CancelCheck = _never) -> tuple[int, int]:
    """(size, crc32c) of one regular file."""
    crc = 0
    size = 0
    for chunk in read_chunks(path, cancelled):
        crc = google_crc32c.extend(crc, chunk)
        size += len(chunk)
    return size, crc


def walk_tree(root: Path) -> tuple[list[str], list[str]]:
    """(dirs, files) below ``root`` as sorted relative POSIX paths; no symlinks allowed, and
    no path a manifest could not carry (``check_path``)."""
    dirs: list[str] = []
    files: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(root / rel if rel else root) as it:
            for entry in it:
                sub = check_path(f"{rel}/{entry.name}" if rel else entry.name)
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    dirs.append(sub)
                    stack.append(sub)
                elif stat.S_ISREG(mode):
                    files.append(sub)
                else:
                    raise ManifestError(f"{sub!r} is neither a regular file nor a directory")
    return sorted(dirs), sorted(files)


def build_manifest(item: ItemId, data: Path, cancelled: CancelCheck = _never) -> Manifest:
    """Hash an item's data (a directory tree or one file) into its manifest."""
    mode = os.lstat(data).st_mode
    if stat.S_ISREG(mode):
        size, crc = file_crc32c(data, cancelled)
        return Manifest(item, ItemKind.FILE, (FileEntry("", size, crc),))
    if not stat.S_ISDIR(mode):
        raise ManifestError(f"{data} is neither a regular file nor a directory")
    dirs, files = walk_tree(data)
    entries = []
    for rel in files:
        size, crc = file_crc32c(data / rel, cancelled)
        entries.append(FileEntry(rel, size, crc))
    return Manifest(item, ItemKind.DIR, tuple(entries), tuple(dirs))


def data_file(data: Path, entry: FileEntry) -> Path:
    return data / entry.path if entry.path else data


def verify_item(manifest: Manifest, data: Path, cancelled: CancelCheck = _never) -> None:
    """Raise ``CorruptItem`` unless ``data`` holds exactly the manifest's bytes."""
    try:
        mode = os.lstat(data).st_mode
    except FileNotFoundError:
        raise CorruptItem(f"{manifest.item}: data is missing") from None
    if manifest.kind is ItemKind.DIR:
        if not stat.S_ISDIR(mode):
            raise CorruptItem(f"{manifest.item}: expected a directory")
        try:
            dirs, files = walk_tree(data)
        except ManifestError as exc:
            raise CorruptItem(f"{manifest.item}: {exc}") from None
        if files != sorted(f.path for f in manifest.files) or dirs != sorted(manifest.dirs):
            raise CorruptItem(f"{manifest.item}: the file list differs from the manifest")
    elif not stat.S_ISREG(mode):
        raise CorruptItem(f"{manifest.item}: expected a regular file")
    for entry in manifest.files:
        size, crc = file_crc32c(data_file(data, entry), cancelled)
        if size != entry.size or crc != entry.crc32c:
            where = entry.path or "the file"
            raise CorruptItem(
                f"{manifest.item}: {where} has size {size} crc32c {crc:08x}, "
                f"manifest says size {entry.size} crc32c {entry.crc32c:08x}"
            )
