"""Object storage backends behind one small interface. I/O module.

Backups and the registry only need: put a file, stream an object back, put a small object
(optionally create-only), read it, head, list (every object, or one level of "directories")
and delete. ``FileObjectStore``
serves ``file://`` URLs and local runs; ``MemoryObjectStore`` is a real implementation held
in memory, for unit tests. A file put with a ``Meter`` sends its bytes at the meter's pace
(a backup shares the node's link with the training job, ``local.pacer``); small objects
and reads are never paced. ``s3://`` (``storage.s3``) and ``gs://`` (``storage.gcs``)
plug in behind the same interface; their SDKs are optional and imported only when used.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import urlparse

import google_crc32c

from mtc_replicator.core.crc import crc32c_concat
from mtc_replicator.local import fsutil
from mtc_replicator.local.hashing import CHUNK, open_regular
from mtc_replicator.local.pacer import Meter


class ObjectStoreError(Exception):
    """A backend operation failed; ``transient`` says whether a retry may help."""

    transient = False


def is_transient(exc: BaseException) -> bool:
    """Whether a retry may help: our errors say so; anything else is not ours to retry."""
    return isinstance(exc, ObjectStoreError) and exc.transient


class ObjectNotFound(ObjectStoreError):
    pass


class PreconditionFailed(ObjectStoreError):
    """A create-only write found the object already there."""


class TransientError(ObjectStoreError):
    """Throttling, a server error, a timeout or a dropped connection: worth a retry."""

    transient = True


class DamagedInTransit(TransientError):
    """The server reports other bytes than were sent: the body is still in memory, and is
    sent again (the SDKs do not retry this themselves)."""


class ResendRequested(TransientError):
    """The server asks for the same request again (S3, after a concurrent conditional
    write to the key), which the SDK's retry modes do not do."""


def is_resendable(exc: BaseException) -> bool:
    """What we send again ourselves once the SDK's own retries have answered."""
    return isinstance(exc, DamagedInTransit | ResendRequested)


class StorageTimeout(TransientError):
    """A request kept failing until its deadline (``--storage-timeout``) ran out."""


def is_resumable(exc: BaseException) -> bool:
    """Whether a download cut off mid-body may resume: a transient error, but not one that
    already used up its request's deadline."""
    return is_transient(exc) and not isinstance(exc, StorageTimeout)


class PermissionDenied(ObjectStoreError):
    """Credentials are missing, wrong or not allowed: retrying cannot help."""


class NoCredentials(PermissionDenied):
    """The SDK found no credentials in any source it tries: no request was made, so no
    permission can be named; the message says which sources were tried."""


class BucketNotFound(ObjectStoreError):
    """The bucket in the store's URL does not exist."""


class ChecksumMismatch(ObjectStoreError):
    """Bytes did not match their checksum: a source that changed, or a damaged object.

    Raised before a bad upload becomes visible, and at the end of a download whose bytes
    the store's own checksum does not confirm (the caller must discard what it received).
    """


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float


class ObjectStore(Protocol):
    """Keys are ``/``-separated and relative to the store's URL prefix."""

    url: str

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        """Upload a file; with ``crc32c`` raise ``ChecksumMismatch`` if its bytes differ.

        Either the whole file becomes the object or the object is left as it was. With
        ``meter`` every byte sent (re-sent ones too) waits for it first.
        """
        ...

    def read_chunks(self, key: str) -> Iterator[bytes]:
        """Stream an object; raises ``ChecksumMismatch`` at the end if the store's own
        checksum disagrees with what was streamed (cloud backends)."""
        ...

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object; with ``if_absent`` raise ``PreconditionFailed`` if it exists.

        A cloud backend that retries a create-only write whose answer was lost may find its
        own object there and raise ``PreconditionFailed``: callers re-read to see who won.
        """
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""
        ...

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        """The "directories" one level below ``prefix``, in key order: each distinct
        ``prefix + name + "/"`` that begins the key of at least one object (S3's and
        GCS's delimiter listing). Its cost follows the number of prefixes, not of objects
        below them, on the cloud backends."""
        ...

    def delete(self, key: str) -> None: ...


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload begun and never completed or aborted (its parts are billed)."""

    key: str
    upload_id: str
    initiated: float


@runtime_checkable
class LeftoverUploads(Protocol):
    """A store whose large uploads can outlive a killed writer, invisible to ``list``
    (S3 multipart uploads): what is left can be found and aborted."""

    def incomplete_uploads(self, prefix: str) -> Iterator[IncompleteUpload]:
        """The incomplete uploads of keys starting with ``prefix``."""
        ...

    def abort_upload(self, upload: IncompleteUpload) -> None: ...


class RangedPut(Protocol):
    """One file being put in ranges (``ParallelPuts.open_put``): ``copy`` every range of
    its ``size`` bytes once, in any order and on any threads, then ``finish``; ``abort``
    leaves the key as it was, whenever it is called (a no-op once finished)."""

    def copy(self, offset: int, length: int, meter: Meter | None) -> None:
        """Copy the source's bytes ``[offset, offset + length)``; ``ChecksumMismatch`` if
        the source ends before them."""
        ...

    def finish(self) -> None:
        """Check the whole file's crc32c (and that nothing follows its ``size`` bytes),
        make it durable and publish it under its key."""
        ...

    def abort(self) -> None: ...


@runtime_checkable
class ParallelPuts(Protocol):
    """A store whose ``put_file`` is one thread's copy of the file (a filesystem): an
    item's files are copied in ranges, ``put_workers()`` ranges at once (several files, or
    the pieces of one large file), so a step's upload uses the node's cores whatever the
    sizes of its files. The cloud backends send each file's parts on threads of their own
    already (``storage.parts``), and take an item's files one at a time."""

    def put_workers(self) -> int:
        """How many ranges to copy at once (at least 1)."""
        ...

    def open_put(self, key: str, src: Path, *, size: int, crc32c: int | None) -> RangedPut:
        """A put of ``src``, which must hold exactly ``size`` bytes with crc32c ``crc32c``
        (None: not checked), as ``key``; nothing is opened before its first ``copy``."""
        ...


@runtime_checkable
class SmallFilesSideBySide(Protocol):
    """A cloud store that sends or fetches a small file in one request: an item's files of
    at most ``side_by_side_limit()`` bytes go ``small_file_workers()`` at once, up and
    down, since what an item of many small files waits on is each request's round trip,
    not its bytes; memory stays at that many small files. Larger files go one at a time,
    each in parts, chunks or ranges of its own (``storage.parts``)."""

    def small_file_workers(self) -> int:
        """How many small files to move at once (at least 1)."""
        ...

    def side_by_side_limit(self) -> int:
        """The largest file moved beside others: one request, in memory."""
        ...


SIDE_BY_SIDE_MAX = 8 * 1024 * 1024
"""The largest file a cloud store puts beside others: at 100 MB/s its bytes take 80 ms,
as long as a few round trips; above it the bytes, not the wait, are the cost."""


MAX_PUT_WORKERS = 16
"""Memory bandwidth, not cores, bounds a filesystem's copies long before this."""


def prefixes_of(prefix: str, keys: Iterator[str]) -> Iterator[str]:
    """``list_prefixes`` computed from keys in key order (for stores that list anyway)."""
    last = None
    for key in keys:
        if not key.startswith(prefix):
            continue
        name, sep, _ = key[len(prefix) :].partition("/")
        found = f"{prefix}{name}/"
        if sep and found != last:
            last = found
            yield found


def check_key(key: str) -> str:
    """``key`` if it is safe (relative, no empty, ``.`` or ``..`` part), else ValueError."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"unsafe object key {key!r}")
    return key


class FileObjectStore:
    """Objects as files under a directory; writes are temp + rename (+ fsync: real disks)."""

    def __init__(self, root: Path, url: str | None = None) -> None:
        self.root = root
        self.url = url or root.as_uri()
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_workers(self) -> int:
        """One file per core this process may run on: each put reads, crc32cs and writes
        (all three release the GIL) as fast as one core copies (``ParallelPuts``)."""
        return max(1, min(len(os.sched_getaffinity(0)), MAX_PUT_WORKERS))

    def open_put(self, key: str, src: Path, *, size: int, crc32c: int | None) -> RangedPut:
        return _FilePut(self._path(key), key, src, size, crc32c)

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        """One range of ``open_put``'s, on this thread: the same checks (the crc32c, no
        byte past the size the source had when the put began) and the same rename."""
        try:
            size = os.lstat(src).st_size  # a symlink is refused when the range opens it
        except OSError as exc:
            raise _translate(exc, key) from exc
        put = self.open_put(key, src, size=size, crc32c=crc32c)
        try:
            put.copy(0, size, meter)
        except BaseException:
            put.abort()
            raise
        put.finish()

    def read_chunks(self, key: str) -> Iterator[bytes]:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise _translate(exc, key) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ObjectNotFound(key)  # a directory is a key prefix, not an object
            while chunk := os.read(fd, CHUNK):
                yield chunk
        finally:
            os.close(fd)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not if_absent:
                fsutil.atomic_write_bytes(dest, data, durable=True)
                return
        except OSError as exc:
            raise _translate(exc, key) from exc
        if os.path.lexists(dest):  # before writing anything: a full disk still answers
            raise PreconditionFailed(f"{key} already exists")
        tmp = fsutil.tmp_name(dest)
        try:
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            # link(2) fails if the name exists: an atomic create-only publish.
            os.link(tmp, dest)
        except FileExistsError:
            raise PreconditionFailed(f"{key} already exists") from None
        except OSError as exc:
            raise _translate(exc, key) from exc
        finally:
            tmp.unlink(missing_ok=True)
        fsutil.fsync_dir(dest.parent)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise _translate(exc, key) from exc

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None  # a directory is a key prefix, not an object
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if base:
            try:
                check_key(base)
            except ValueError:
                return  # no safe key starts with it; walking it could leave the root
        start = self.root / base if base else self.root
        if not start.is_dir():
            return
        found: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if name.startswith(fsutil.TMP_PREFIX):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if key.startswith(prefix):
                    st = os.stat(os.path.join(dirpath, name))
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        yield from sorted(found, key=lambda o: o.key)

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        base, sep, start = prefix.rpartition("/")
        if sep and not base:
            return  # no key starts with "/"
        if base:
            try:
                check_key(base)
            except ValueError:
                return  # no safe key starts with it; walking it could leave the root
        parent = self.root / base if base else self.root
        try:
            names = sorted(e.name for e in os.scandir(parent) if e.name.startswith(start))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            # A directory is a prefix only with an object below it, as on S3 and GCS
            # (a pruned step can leave its empty directories behind).
            if self._holds_an_object(parent / name):
                yield f"{base}/{name}/" if base else f"{name}/"

    @staticmethod
    def _holds_an_object(path: Path) -> bool:
        if path.is_symlink() or not path.is_dir():
            return False
        for _, _, filenames in os.walk(path):
            if any(not n.startswith(fsutil.TMP_PREFIX) for n in filenames):
                return True
        return False

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()


class _FilePut:
    """``FileObjectStore``'s ``RangedPut``: ranges ``pwrite`` into one temporary file
    beside the key, each range's crc32c kept apart and combined at ``finish``
    (``core.crc``); renamed into place only when the whole checks."""

    def __init__(self, dest: Path, key: str, src: Path, size: int, crc32c: int | None) -> None:
        self.key = key
        self.size = size
        self._dest = dest
        self._src = src
        self._crc32c = crc32c
        self._lock = threading.Lock()
        self._fds: tuple[int, int] | None = None
        self._tmp: Path | None = None
        self._crcs: dict[int, tuple[int, int]] = {}
        """Per range copied, by its offset: its crc32c and length."""
        self._ended = False

    def _open(self) -> tuple[int, int]:
        """The source's and the temporary file's descriptors, opened by the first range."""
        with self._lock:
            if self._ended:
                raise ObjectStoreError(f"{self.key}: this put has ended")
            if self._fds is None:
                self._dest.parent.mkdir(parents=True, exist_ok=True)
                src = open_regular(self._src)
                tmp = fsutil.tmp_name(self._dest)
                try:
                    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                except BaseException:
                    os.close(src)
                    raise
                self._fds, self._tmp = (src, out), tmp
            return self._fds

    def copy(self, offset: int, length: int, meter: Meter | None) -> None:
        try:
            src, out = self._open()
            crc, pos, end = 0, offset, offset + length
            while pos < end:
                # bytes, not a reused buffer: google-crc32c takes read-only buffers only.
                chunk = os.pread(src, min(CHUNK, end - pos), pos)
                if not chunk:
                    raise ChecksumMismatch(
                        f"{self.key}: source ends at {pos} bytes, expected {self.size} "
                        "(it changed since its checksum was taken); not uploaded"
                    )
                crc = google_crc32c.extend(crc, chunk)
                _pwrite_all(out, chunk, pos, meter)
                pos += len(chunk)
        except OSError as exc:
            raise _translate(exc, self.key) from exc
        with self._lock:
            self._crcs[offset] = (crc, length)

    def finish(self) -> None:
        src, out = self._open()
        try:
            if os.pread(src, 1, self.size):
                raise ChecksumMismatch(
                    f"{self.key}: source is longer than {self.size} bytes (it changed since "
                    "its checksum was taken); not uploaded"
                )
            offsets = sorted(self._crcs)
            ends = [o + self._crcs[o][1] for o in offsets]
            if offsets[:1] != [0] or ends[-1:] != [self.size] or offsets[1:] != ends[:-1]:
                raise ValueError(f"{self.key}: its ranges do not cover {self.size} bytes once")
            check_crc32c(self.key, crc32c_concat(self._crcs[o] for o in offsets), self._crc32c)
            os.fsync(out)
            assert self._tmp is not None
            os.replace(self._tmp, self._dest)
            self._tmp = None
        except OSError as exc:
            raise _translate(exc, self.key) from exc
        finally:
            self.abort()

    def abort(self) -> None:
        with self._lock:
            self._ended = True
            fds, self._fds = self._fds, None
            tmp, self._tmp = self._tmp, None
        for fd in fds or ():
            with contextlib.suppress(OSError):  # each descriptor closed whatever the others do
                os.close(fd)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def _pwrite_all(fd: int, data: bytes, offset: int, meter: Meter | None) -> None:
    """``data`` written at ``offset`` of ``fd``, a slice at a time as ``meter`` allows."""
    for piece in [memoryview(data)] if meter is None else meter.paced(data):
        left = piece
        while left:
            written = os.pwrite(fd, left, offset)
            left, offset = left[written:], offset + written


def check_crc32c(key: str, actual: int, expected: int | None) -> None:
    """Raise ``ChecksumMismatch`` unless ``expected`` is None or equals ``actual``."""
    if expected is not None and actual != expected:
        raise ChecksumMismatch(
            f"{key}: source has crc32c {actual:08x}, expected {expected:08x} "
            "(it changed since its checksum was taken); not uploaded"
        )


def _translate(exc: OSError, key: str) -> ObjectStoreError:
    # Below an object, or a directory (a key prefix): no object has that key either.
    if isinstance(exc, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return ObjectNotFound(key)
    if exc.errno in (errno.EAGAIN, errno.EINTR, errno.EBUSY):
        return TransientError(f"{key}: {exc}")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDenied(f"{key}: {exc}")
    return ObjectStoreError(f"{key}: {exc}")


class MemoryObjectStore:
    """A complete object store in a dict, for unit tests of backup logic."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()
        self._clock = 0.0

    def _put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._clock += 1.0
            self._objects[check_key(key)] = (data, self._clock)

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        check_key(key)
        data = src.read_bytes()
        check_crc32c(key, google_crc32c.value(data), crc32c)
        if meter is not None:
            meter.take(len(data))
        self._put(key, data)

    def read_chunks(self, key: str) -> Iterator[bytes]:
        data = self.get_bytes(key)
        for i in range(0, len(data), CHUNK):
            yield data[i : i + CHUNK]

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        check_key(key)
        with self._lock:
            if if_absent and key in self._objects:
                raise PreconditionFailed(f"{key} already exists")
            self._clock += 1.0
            self._objects[check_key(key)] = (data, self._clock)

    def get_bytes(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key][0]
            except KeyError:
                raise ObjectNotFound(key) from None

    def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        with self._lock:
            found = self._objects.get(key)
        return None if found is None else ObjectInfo(key, len(found[0]), found[1])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, v) for k, v in self._objects.items() if k.startswith(prefix))
        for key, (data, mtime) in items:
            yield ObjectInfo(key, len(data), mtime)

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = sorted(self._objects)
        yield from prefixes_of(prefix, iter(keys))

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)


def split_bucket_url(url: str, scheme: str) -> tuple[str, str]:
    """``(bucket, prefix)`` of ``scheme://bucket/prefix``; the prefix is "" or ends in "/"."""
    parsed = urlparse(url)
    if parsed.scheme != scheme or not parsed.netloc:
        raise ValueError(f"expected {scheme}://bucket/prefix, got {url!r}")
    if parsed.query or parsed.fragment or parsed.params:
        raise ValueError(f"storage URL {url!r} must not have a query or fragment")
    prefix = parsed.path.strip("/")
    if prefix:
        check_key(prefix)
    return parsed.netloc, f"{prefix}/" if prefix else ""
