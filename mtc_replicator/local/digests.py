"""Content digests of checkpoint files: BLAKE3, checked as bytes stream in. No I/O.

A file's BLAKE3 digest is computed once, at ingest on the node that produced the step, in
the same read as its crc32c (``local.hashing``), and travels in the manifest
(``core.manifest.FileEntry.blake3``), which COMMITs and restore plans pin by its own digest.
Every byte that comes to a node from outside it is checked against it before the item is
committed: a peer's stream and a push as they arrive (``transport.transfer.ItemWriter``), a
backup download as it arrives (``storage.backup``). The crc32c stays, for bit rot, for the
object stores' own checks and for the local tier's fast path (``local.hashing``: bytes that
only this daemon and the job's own pods can have written since they were hashed); it cannot
stand against an attacker, who can make any bytes of the same size match it.

BLAKE3 rather than SHA-256: measured 3-4x faster on one core here, and more with threads
(docs/performance.md, "Content digests"). gRPC transfers and downloads hash on a
``HashLane`` beside the thread that receives, so receiving and hashing overlap; the data
channel hashes each slice as it writes it, which costs less CPU than a thread hop per slice
(docs/performance.md, "Where a GiB's CPU goes"). Where a file has a
digest, the paths that receive bytes check it and not the crc32c (``crc_checked``): one hash
per byte, not two. No I/O; ``HashLane`` owns one thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import blake3

from mtc_replicator.core.manifest import CorruptItem, FileEntry

_AUTO = blake3.blake3.AUTO


def hasher(*, threads: bool = False) -> blake3.blake3:
    """A fresh BLAKE3 state. ``threads``: split large updates across the cores (worth it
    for reads of MiBs from the local disk; a transfer's 1 MiB chunks hash on one)."""
    return blake3.blake3(max_threads=_AUTO) if threads else blake3.blake3()


def crc_checked(entry: FileEntry) -> bool:
    """Whether a restore path checks this file's whole-file crc32c: only for a format-1
    entry, which has nothing else. A format-2 entry's BLAKE3 already refuses every byte
    its crc32c would (bit rot included), so a path that checks the digest computes no
    whole-file crc32c, and a format-2 entry whose crc32c is wrong but whose digest is
    right restores on every path that receives it: its bytes are exactly the ones the
    producing node hashed. (The local verify checks crc32c alone, so it refuses that copy:
    ``local.hashing``.) (That crc32c is still what a backup upload hands the object store, which
    refuses it there, loudly, before anything is committed; and a gRPC chunk's own crc32c
    is still checked as it arrives, before it is written.)"""
    return entry.blake3 is None


def mismatch(where: str, entry: FileEntry, got: str) -> CorruptItem:
    """The refusal of a file whose bytes have another digest than its manifest's."""
    return CorruptItem(
        f"{where}: content digest (blake3) {got[:16]}..., the manifest says "
        f"{(entry.blake3 or '')[:16]}...: not the bytes the producing node hashed"
    )


class FileCheck:
    """The digest of one file's bytes, fed in order; ``check`` once the last arrived.

    A format-1 entry (no digest) takes the bytes and checks nothing: its crc32c, checked by
    the caller, is all there is.
    """

    def __init__(self, entry: FileEntry, *, threads: bool = False) -> None:
        self.entry = entry
        self._hash = hasher(threads=threads) if entry.blake3 is not None else None

    @property
    def needed(self) -> bool:
        """The entry has a digest to check (format 2)."""
        return self._hash is not None

    def update(self, data: bytes | memoryview) -> None:
        if self._hash is not None:
            self._hash.update(data)

    def check(self, where: str) -> None:
        """``CorruptItem`` unless the bytes fed have the entry's digest."""
        if self._hash is None:
            return
        got = self._hash.hexdigest()
        if got != self.entry.blake3:
            raise mismatch(where, self.entry, got)


class HashLane:
    """One thread that feeds ``FileCheck``s in the order it is handed bytes, beside the
    thread that receives and writes them. At most ``depth`` pieces wait (memory stays at
    that many receives); ``drain`` before a ``check``."""

    def __init__(self, depth: int = 16) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mtc-digest")
        self._pending: deque[Future[object]] = deque()
        self.depth = depth

    def update(self, check: FileCheck, data: bytes | memoryview) -> None:
        if not check.needed:  # a format-1 entry: nothing to hash, no thread hop
            return
        self.feed(check.update, data)

    def feed(
        self, update: Callable[[bytes | memoryview], object], data: bytes | memoryview
    ) -> None:
        """``update(data)`` on the lane's thread. Once this returns at most ``depth``
        pieces wait, so a caller that reads into ``depth + 1`` buffers in turn never
        overwrites one still being hashed."""
        self._pending.append(self._pool.submit(update, data))
        while len(self._pending) > self.depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
