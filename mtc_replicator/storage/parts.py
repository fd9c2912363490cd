"""What the cloud backends share: parallel part uploads in bounded memory, verified
resumable downloads, and checksum encodings. I/O module (reads local files).

No vendor code here: a backend passes in how to upload one part and how to open an object
at an offset, already translating its SDK's errors into ``ObjectStoreError``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import google_crc32c

from mtc_replicator.core.retry import RetryState
from mtc_replicator.local.hashing import open_regular
from mtc_replicator.storage.objectstore import ChecksumMismatch, ObjectStoreError

R = TypeVar("R")


def crc32c_b64(crc: int) -> str:
    """The wire form both S3 and GCS use: base64 of the big-endian 4 bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def b64_crc32c(text: str | None) -> int | None:
    """Inverse of ``crc32c_b64``; None for a missing or malformed value."""
    if not text:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return int.from_bytes(raw, "big") if len(raw) == 4 else None


def md5_digest(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def read_part(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from ``fd``, fewer only at end of file."""
    data = os.read(fd, size)
    if 0 < len(data) < size:  # a short read that is not EOF is rare: top it up
        pieces = [data]
        got = len(data)
        while got < size and (more := os.read(fd, size - got)):
            pieces.append(more)
            got += len(more)
        data = b"".join(pieces)
    return data


def read_small_file(src: Path, limit: int) -> bytes:
    """A whole file of at most ``limit`` bytes; a file that grew past it is an error."""
    fd = open_regular(src)  # a FIFO swapped in by a pod is refused, never waited on
    try:
        data = read_part(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ChecksumMismatch(f"{src} grew while it was being uploaded")
    return data


def upload_parts(
    src: Path,
    part_size: int,
    workers: int,
    upload: Callable[[int, bytes], R],
    *,
    name: str = "upload",
) -> tuple[list[R], int, int]:
    """Upload ``src`` as parts 1..n of ``part_size`` bytes on ``workers`` threads.

    The file is read in order on the calling thread, which also computes its crc32c; a part
    is read only when a worker is free, so at most ``workers + 1`` parts are in memory
    whatever the file's size. Returns (results in part order, size, crc32c). The first
    failing part stops the reading; the error of the lowest failed part is raised after
    the parts in flight have finished.
    """
    if part_size < 1 or workers < 1:
        raise ValueError(f"need part_size >= 1 and workers >= 1, got {part_size}, {workers}")
    slots = threading.BoundedSemaphore(workers)
    failed = threading.Event()
    futures: list[Future[R]] = []

    def run(number: int, data: bytes) -> R:
        try:
            return upload(number, data)
        except BaseException:
            failed.set()
            raise
        finally:
            slots.release()

    crc = size = 0
    fd = open_regular(src)  # a FIFO swapped in by a pod is refused, never waited on
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"mtc-{name}") as pool:
            while not failed.is_set():
                slots.acquire()
                if failed.is_set():
                    slots.release()
                    break
                data = read_part(fd, part_size)
                if not data and futures:
                    slots.release()
                    break
                crc = google_crc32c.extend(crc, data)
                size += len(data)
                futures.append(pool.submit(run, len(futures) + 1, data))
                del data  # the worker owns the part now; only it keeps it alive
    finally:
        os.close(fd)
    return [f.result() for f in futures], size, crc


def verified_chunks(
    open_at: Callable[[int], Iterator[bytes]],
    *,
    what: str,
    size: int,
    crc32c: int | None,
    backoff: RetryState,
) -> Iterator[bytes]:
    """Stream an object of ``size`` bytes, resuming after transient errors, then verify it.

    ``open_at(offset)`` yields the object's bytes from ``offset`` on (the backend pins the
    version it first saw, so a resumed stream never splices two versions). ``backoff``
    bounds each stretch without progress: a cut after new bytes resets it. Raises
    ``ChecksumMismatch`` after the last chunk when the length or the store's crc32c
    disagree: the caller must discard everything it received.
    """
    offset = crc = 0
    while True:
        opened_at = offset
        try:
            for chunk in open_at(offset):
                offset += len(chunk)
                crc = google_crc32c.extend(crc, chunk)
                yield chunk
            break
        except ObjectStoreError as exc:
            if offset > opened_at:
                # Cut after new bytes: a fresh budget, so a long download (and a slow
                # consumer between chunks) is bounded per stall, not overall.
                backoff.reset()
            backoff.failed(exc)  # re-raises when it is final
    if offset != size:
        raise ChecksumMismatch(f"{what}: got {offset} bytes, the store says {size}")
    if crc32c is not None and crc != crc32c:
        raise ChecksumMismatch(
            f"{what}: received bytes have crc32c {crc:08x}, the store says {crc32c:08x}"
        )
