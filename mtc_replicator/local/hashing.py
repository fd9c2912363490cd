"""Hashing and checking an item's files on disk against its manifest. I/O module.

``build_manifest`` walks and hashes an item's data (a directory tree or one file) with
crc32c and BLAKE3 in one read (``local.digests``); ``verify_item`` checks data against a
manifest. Reads go in ``CHUNK`` or ``VERIFY_READ`` pieces so memory stays at one piece per
thread whatever the item's size.

Both hash on a pool of one thread per core shared by every ingest and verify of the process
(BLAKE3, crc32c and ``pread`` release the GIL), a file (or a verify's range) per task; at
ingest a file's BLAKE3 hasher spreads over the cores itself only when the item has fewer
files than the pool has threads.
``verify_item`` is the local tier's check, on a restore's critical path: every file, with a
digest or without, is read in ``PIECE``-sized ranges whose crc32cs combine (``core.crc``),
and every byte is read: each range must be exactly there, and nothing may follow a file's
last one. Its BLAKE3 digest is not computed again here: the bytes were hashed (or checked
against it, as they arrived) by this daemon, and since then only the job's own pods (through
the data they handed over and the views they read) and the daemon can have written them, so
what is left to catch is accident, which crc32c catches at a quarter of BLAKE3's cost. Bytes
from anywhere else (a peer, a push, the bucket) are checked against the digest as they
arrive (``local.digests``; SECURITY.md, "Content digests").

Taken data was written by a pod, which may still hold a descriptor of a directory inside
it: every walk and open goes through descriptors with no symlink at any component, from
``root`` (the store) down (``fsutil.open_beneath``), and a FIFO is refused, never waited on.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import google_crc32c

from mtc_replicator.core.crc import crc32c_concat, split_ranges
from mtc_replicator.core.manifest import (
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
from mtc_replicator.local import digests, fsutil

CHUNK = 4 * 1024 * 1024
PIECE = 32 * 1024 * 1024
"""Bytes of one file that one thread verifies: a 1 GiB file keeps every core busy."""
VERIFY_READ = 1024 * 1024
"""Bytes per read while verifying: the least for which crc32c releases the GIL (measured no
slower than 4 MiB here), so the pool's threads hold little memory between them."""
MAX_VERIFY_THREADS = 32
"""Memory bandwidth, not cores, bounds a verify long before this on a large node."""
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


def _open_regular(root: Path | int, rel: str) -> int:
    """A read descriptor of the regular file ``rel`` below ``root``, through no symlink."""
    try:
        return fsutil.open_file_beneath(root, rel)
    except fsutil.NotRegularFile as exc:
        raise ManifestError(f"{rel!r} is {exc.kind}, not a regular file") from None
    except OSError as exc:
        if exc.errno in _LINKED:
            raise _refused(exc, repr(rel)) from None
        raise


def open_regular(path: Path) -> int:
    """A read descriptor of the regular file ``path``, its last component not followed."""
    return _open_regular(path.parent, path.name)


def read_chunks(
    path: Path,
    cancelled: CancelCheck = _never,
    *,
    root: Path | int | None = None,
    rel: str = "",
    size: int = CHUNK,
) -> Iterator[bytes]:
    """Yield a regular file's bytes in ``size`` pieces; memory stays at one piece.

    With ``root``, the file is ``rel`` below it, reached through no symlink; without, it is
    ``path`` (its last component not followed).
    """
    if root is None:
        root, rel = path.parent, path.name
    fd = _open_regular(root, rel)
    try:
        before = _fingerprint(os.fstat(fd))
        read = 0
        while chunk := os.read(fd, size):
            if cancelled():
                raise Cancelled(str(path))
            read += len(chunk)
            yield chunk
        after = os.fstat(fd)
        # A pod that kept a descriptor may write while we read: the bytes yielded would
        # then be no version of the file. A write moves mtime (fine-grained once queried,
        # on kernels with multigrain timestamps); a link or chmod, which changes no byte,
        # moves only ctime, so ctime is not compared.
        if _fingerprint(after) != before or read != after.st_size:
            raise ChangedWhileRead(str(path))
    finally:
        os.close(fd)


class ChangedWhileRead(OSError):
    """A file changed while it was read: what was read is no version of it. Taken data
    stays where it is, to be hashed again (an ``OSError``: the ingest retries)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EAGAIN, "changed while it was read", path)


def _fingerprint(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


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


def file_digests(
    path: Path,
    cancelled: CancelCheck = _never,
    *,
    root: Path | int | None = None,
    rel: str = "",
    threads: bool = True,
) -> tuple[int, int, str]:
    """(size, crc32c, BLAKE3 hex digest) of one regular file, in one read of its bytes
    (``root`` and ``rel`` as for ``read_chunks``). ``threads``: the hasher spreads each
    ``CHUNK`` over the cores; without, reads are ``VERIFY_READ``s, which stay in the core's
    cache from the read to both hashes."""
    crc = 0
    size = 0
    content = digests.hasher(threads=threads)
    step = CHUNK if threads else VERIFY_READ
    # With threads the digest runs on a lane while this thread reads and crcs the next chunk.
    lane = digests.HashLane(depth=1) if threads else None
    try:
        for chunk in read_chunks(path, cancelled, root=root, rel=rel, size=step):
            crc = google_crc32c.extend(crc, chunk)
            if lane is None:
                content.update(chunk)
            else:
                lane.feed(content.update, chunk)
            size += len(chunk)
        if lane is not None:
            lane.drain()
    finally:
        if lane is not None:
            lane.close()
    return size, crc, content.hexdigest()


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
        size, crc, content = file_digests(data, cancelled, root=base, rel=rel)
        return Manifest(item, ItemKind.FILE, (FileEntry("", size, crc, content),))
    if not stat.S_ISDIR(mode):
        raise ManifestError(f"{data} is neither a regular file nor a directory")
    top = fsutil.open_dir_beneath(base, rel)
    try:
        dirs, files = walk_tree(top)
        entries = _hash_files(top, data, files, cancelled)
        # A name added or removed meanwhile (by a pod that kept a descriptor of a directory)
        # would leave a manifest the tree does not match.
        if walk_tree(top) != (dirs, files):
            raise ChangedWhileRead(str(data))
    finally:
        os.close(top)
    return Manifest(item, ItemKind.DIR, tuple(entries), tuple(dirs))


def _hash_files(top: int, data: Path, files: list[str], cancelled: CancelCheck) -> list[FileEntry]:
    """Every file's entry, in ``files``' order, hashed on the verify pool in runs of
    consecutive files (one run per file when there are few; a thread hop per tiny file would
    cost more than its hashing). Each file gets the hasher's own threads only where the pool's
    would leave cores idle: 1 GiB in 8 files hashed in 0.17 s that way on 2 cores, against
    0.33 s a file at a time with threaded hashers."""
    workers = _pool_threads()
    threads = len(files) < workers

    def run(paths: list[str]) -> list[FileEntry]:
        out = []
        for path in paths:
            size, crc, content = file_digests(
                data / path, cancelled, root=top, rel=path, threads=threads
            )
            out.append(FileEntry(path, size, crc, content))
        return out

    if len(files) <= 1:
        return run(files)
    per_run = -(-len(files) // (workers * 4))
    runs = [files[i : i + per_run] for i in range(0, len(files), per_run)]
    futures = [_hash_pool().submit(run, paths) for paths in runs]
    entries: list[FileEntry] = []
    failure: BaseException | None = None
    for fut in futures:
        try:
            entries.extend(fut.result())
        except BaseException as exc:  # re-raised below, once the others ended
            if failure is None:
                failure = exc
                for later in futures:
                    later.cancel()
    if failure is not None:
        raise failure
    return entries


def data_file(data: Path, entry: FileEntry) -> Path:
    return data / entry.path if entry.path else data


def verify_item(
    manifest: Manifest, data: Path, cancelled: CancelCheck = _never, *, root: Path | None = None
) -> None:
    """Raise ``CorruptItem`` unless ``data`` holds exactly the manifest's bytes, by size and
    crc32c (the module's docstring says why not BLAKE3); ``root`` as for
    ``build_manifest``: a symlink anywhere below it is corruption, never followed."""
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
        where = [(base, rel) if top is None else (top, e.path) for e in manifest.files]
        try:
            _verify_files(manifest, where, cancelled)
        except ManifestError as exc:  # a file swapped for a symlink or a special file
            raise CorruptItem(f"{manifest.item}: {exc}") from None
    finally:
        if top is not None:
            os.close(top)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """One thread per core this process may run on (at most ``MAX_VERIFY_THREADS``) for
    every ingest and verify of the process: concurrent ones share the cores rather than
    multiply the threads (and the piece each one holds)."""
    global _pool  # noqa: PLW0603 - one pool per process, made on first use
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_pool_threads(), thread_name_prefix="mtc-verify")
        return _pool


def _pool_threads() -> int:
    return min(len(os.sched_getaffinity(0)) or 1, MAX_VERIFY_THREADS)


class _Stopped(Exception):
    """Another range already failed: this one's answer no longer matters."""


@dataclass(frozen=True)
class _Range:
    """Bytes ``[offset, offset + length)`` of the manifest's file number ``file``."""

    file: int
    where: tuple[Path | int, str]
    """Where the file is: a directory (or its descriptor) and the path below it."""
    offset: int
    length: int
    last: bool
    """The file's last range: nothing may follow it."""


_Result = tuple[int, int | None]
"""(the range's crc32c, None), or (0, the file's size) when its bytes are not all there
or, after the file's last range, more bytes follow."""


def _range_crc(r: _Range, stop: threading.Event, cancelled: CancelCheck) -> _Result:
    """Hash one range (``_Result``)."""
    fd = _open_regular(*r.where)
    try:
        crc, pos, end = 0, r.offset, r.offset + r.length
        while pos < end:
            if stop.is_set():
                raise _Stopped
            if cancelled():
                raise Cancelled(r.where[1])
            chunk = os.pread(fd, min(VERIFY_READ, end - pos), pos)
            if not chunk:
                return 0, os.fstat(fd).st_size
            crc = google_crc32c.extend(crc, chunk)
            pos += len(chunk)
        if r.last and os.pread(fd, 1, end):
            return 0, os.fstat(fd).st_size
        return crc, None
    finally:
        os.close(fd)


def _verify_files(
    manifest: Manifest, where: list[tuple[Path | int, str]], cancelled: CancelCheck
) -> None:
    """Check every file of ``manifest`` (``where``: its root and path, in manifest order)
    on the hashing pool; raise ``CorruptItem`` for the first file, in manifest order, that
    differs."""
    stop = threading.Event()
    ranges = [split_ranges(e.size, PIECE) for e in manifest.files]
    jobs = [
        _Range(i, where[i], off, n, k == len(rs) - 1)
        for i, rs in enumerate(ranges)
        for k, (off, n) in enumerate(rs)
    ]
    if len(jobs) == 1:  # a small item: a thread hop would cost more than it saves
        results = [_range_crc(jobs[0], stop, cancelled)]
    else:
        pool = _hash_pool()
        results = _gather([pool.submit(_range_crc, r, stop, cancelled) for r in jobs], stop)
    by_file: dict[int, list[_Result]] = {}
    for r, result in zip(jobs, results, strict=True):
        by_file.setdefault(r.file, []).append(result)
    for i, entry in enumerate(manifest.files):
        got = by_file[i]
        wrong_size = next((size for _, size in got if size is not None), None)
        name = entry.path or "the file"
        if wrong_size is not None:
            raise CorruptItem(
                f"{manifest.item}: {name} has size {wrong_size}, manifest says size {entry.size}"
            )
        crc = crc32c_concat((c, n) for (c, _), (_, n) in zip(got, ranges[i], strict=True))
        if crc != entry.crc32c:
            raise CorruptItem(
                f"{manifest.item}: {name} has size {entry.size} crc32c {crc:08x}, "
                f"manifest says size {entry.size} crc32c {entry.crc32c:08x}"
            )


def _gather(futures: list[Future[_Result]], stop: threading.Event) -> list[_Result]:
    """Every range's answer; on a failure the others stop early and the failure (the first
    in order, a file's problem before a stop) is raised once all have ended."""
    results: list[_Result] = []
    failure: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.result())
            if results[-1][1] is not None:
                stop.set()  # a wrong size is decided: no need to read the rest
        except _Stopped:
            results.append((0, None))
        except BaseException as exc:  # re-raised below, once the others ended
            stop.set()
            for later in futures:
                later.cancel()
            if failure is None:
                failure = exc
            results.append((0, None))
    if failure is not None:
        raise failure
    return results
