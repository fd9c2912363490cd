"""One item's bytes in motion: chunked reading of a committed item, and verified staging and
commit of an incoming one. I/O module; transport-neutral (``peer`` puts it on gRPC).

Incoming bytes are hostile: ``check_manifest`` proves a transfer header's manifest is the
one its digest names; ``ItemWriter`` checks every chunk's order, range and checksum before a
byte is written, creates files only with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to
directory descriptors it opened itself (so no symlink, planted or not, is ever followed),
and checks each file's size and BLAKE3 digest (``local.digests``, fed as the chunks arrive,
in order; the whole-file crc32c instead for a format-1 entry, which has no digest) as its
last chunk arrives, without reading anything back.
``receive_item`` runs the writer in an asyncio loop with bounded memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import os
import re
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import Executor
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, TypeVar

import google_crc32c

from mtc_replicator.core.crc import crc32c_combine
from mtc_replicator.core.manifest import (
    MAX_FILES,
    CancelCheck,
    Cancelled,
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
)
from mtc_replicator.core.pacing import ENTRY_BYTES
from mtc_replicator.local import fsutil
from mtc_replicator.local.digests import FileCheck, HashLane, crc_checked
from mtc_replicator.local.store import DATA, LocalStore, StoreError
from mtc_replicator.transport.streams import TooSlow, TransferError

T = TypeVar("T")
Chunk = tuple[int, int, bytes, int]
"""``(file_index, offset, data, crc32c)``: one slice of one file of an item."""

SEND_CHUNK = 1 << 20
"""Bytes per chunk we send: 1 MiB messages measured fastest over gRPC here (64 KiB was 3-4x
slower, 4 MiB slightly slower)."""
MAX_CHUNK = 4 << 20
"""The protocol's bound on one chunk's data."""
SKIP_ON_LOOP = 64
"""Files one chunk may skip over (empty ones: the manifest alone makes them) that the
receiving loop creates itself; more are created on a thread (``ItemWriter.skip_to``)."""
RESERVE_BYTES = 64 << 20
"""Free space an incoming item must leave on the store's filesystem (see ``room_on``)."""
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LINKED = (errno.ELOOP, errno.EXDEV, errno.ENOTDIR)
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _never() -> bool:
    return False


# --- sending -----------------------------------------------------------------------------------


def iter_chunks(
    manifest: Manifest,
    data: Path,
    chunk_size: int | Callable[[], int] = SEND_CHUNK,
    cancelled: CancelCheck = _never,
    *,
    root: Path | None = None,
) -> Generator[Chunk]:
    """``(file_index, offset, data, crc32c)`` for every byte of an item, in manifest order.

    One ``os.read`` per chunk makes the one copy into ``bytes`` that protobuf needs; with a
    fixed ``chunk_size`` offsets stay multiples of it (page-aligned). A callable
    ``chunk_size`` is asked before every chunk (a paced sender: no chunk larger than what
    its pacer lets it send at once). Empty files send nothing: the manifest alone creates
    them. Memory stays at the chunk the caller holds. From the RAM disk a read is a
    page-cache copy (~0.1 ms per MiB), cheap enough to run in an event loop: a thread hop
    per chunk measured slower on the bench.
    """
    if callable(chunk_size):
        size = chunk_size
    else:
        fixed = chunk_size
        if not 0 < fixed <= MAX_CHUNK:
            raise ValueError(f"chunk size {fixed} is outside 1..{MAX_CHUNK}")

        def size() -> int:
            return fixed

    with contextlib.closing(item_files(manifest, data, root)) as files:
        for index, entry, fd in files:
            offset = 0
            while offset < entry.size:
                if cancelled():
                    raise Cancelled(str(manifest.item))
                want = size()
                if not 0 < want <= MAX_CHUNK:
                    raise ValueError(f"chunk size {want} is outside 1..{MAX_CHUNK}")
                buf = os.read(fd, min(want, entry.size - offset))
                if not buf:
                    raise short_file(manifest, entry, offset)
                yield index, offset, buf, google_crc32c.value(buf)
                offset += len(buf)


def item_files(
    manifest: Manifest, data: Path, root: Path | None = None
) -> Generator[tuple[int, FileEntry, int]]:
    """``(file_index, entry, descriptor)`` of every non-empty file of a committed item, in
    manifest order; each closed when the next is due.

    Every file is reached from ``root`` (the store; by default ``data``'s parent) through no
    symlink at any component, and must be a regular file: a pod that kept a descriptor of
    its step directory may have swapped a directory for a link to the daemon's files since.
    Such an item is ``CorruptItem``.
    """
    base = data.parent if root is None else root
    rel = data.relative_to(base)
    top = None if manifest.kind is ItemKind.FILE else _open_safely(manifest, base, rel, dir_=True)
    try:
        for index, entry in enumerate(manifest.files):
            if entry.size == 0:
                continue
            if top is None:
                fd = _open_safely(manifest, base, rel)
            else:
                fd = _open_safely(manifest, top, PurePosixPath(entry.path))
            try:
                yield index, entry, fd
            finally:
                os.close(fd)
    finally:
        if top is not None:
            os.close(top)


def _open_safely(manifest: Manifest, base: Path | int, rel: PurePath, *, dir_: bool = False) -> int:
    try:
        if dir_:
            return fsutil.open_dir_beneath(base, rel)
        return fsutil.open_file_beneath(base, rel)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if isinstance(exc, fsutil.NotRegularFile) or exc.errno in _LINKED:
            raise CorruptItem(
                f"{manifest.item}: {rel} is not served: a symlink or a special file where the "
                f"item has a {'directory' if dir_ else 'file'} ({exc.strerror})"
            ) from None
        raise


def short_file(manifest: Manifest, entry: FileEntry, offset: int) -> CorruptItem:
    """A local file ended before its manifest's size: the local copy is bad."""
    return CorruptItem(
        f"{manifest.item}: {entry.path or 'the file'} ends at {offset} bytes, "
        f"its manifest says {entry.size}"
    )


# --- receiving ---------------------------------------------------------------------------------


def check_manifest(raw: bytes, digest: str, item: ItemId, max_entries: int = MAX_FILES) -> Manifest:
    """The manifest of a transfer header, proven to be exactly what ``digest`` names, of
    at most ``max_entries`` files and directories.

    Raises ``ManifestError`` (unsafe or malformed), ``TransferError`` (not the item named,
    not canonical) or ``CorruptItem`` (the digest does not match).
    """
    if not _DIGEST_RE.fullmatch(digest):
        raise TransferError(f"manifest digest must be 64 lowercase hex digits: {digest!r:.80}")
    manifest = Manifest.from_json(raw, max_entries)
    if manifest.to_json() != raw:
        # Stored manifests are canonical; another form would commit under another digest.
        raise TransferError(f"{item}: manifest is not in canonical form")
    # The digest names the content; the attestation beside it is checked on its own
    # (``core.attestation``), and canonical form leaves no third part.
    actual = manifest.digest  # hashes the canonical content: once
    if actual != digest:
        raise CorruptItem(f"{item}: manifest has sha256 {actual}, the header says {digest}")
    if manifest.item != item:
        raise TransferError(f"manifest describes {manifest.item}, the header names {item}")
    return manifest


def inodes_on(path: Path) -> tuple[int, int]:
    """``(free, total)`` inodes of ``path``'s filesystem for an unprivileged writer; a
    total of 0 means the filesystem has no fixed number (``core.admission.inode_room``)."""
    st = os.statvfs(path)
    return st.f_favail, st.f_files


def room_on(path: Path, reserve: int = RESERVE_BYTES) -> int:
    """Bytes an incoming item may take on ``path``'s filesystem: its free space minus a
    margin (``reserve``, or a sixteenth of the filesystem when that is smaller)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize - min(reserve, st.f_blocks * st.f_frsize // 16)


class ItemWriter:
    """Writes one incoming item below ``staged/data``, verifying every chunk and file.

    ``accept`` checks a chunk and says where it goes; the caller writes it (``write_all``),
    possibly in another thread while it accepts the next one, and calls ``release`` when no
    write is in flight (``write`` does all three at once). ``close`` is safe at any point and
    leaves only files inside ``staged``, for the caller to remove.
    """

    def __init__(
        self, manifest: Manifest, staged: Path, *, hash_aside: bool = False, made: bool = False
    ) -> None:
        """``hash_aside``: digests on a thread of their own (``HashLane``), for a caller
        that receives in small pieces on one thread (the data channel). ``made``: a part
        of an item (``core.stripes``) whose first part's writer already made ``data`` and
        the directories: this one writes its own files into them."""
        self.manifest = manifest
        self._lane = HashLane() if hash_aside else None
        self.bytes_written = 0
        self._files = manifest.files
        self._index = 0
        """The file the next chunk belongs to, unless it names a later one."""
        self._offset = 0
        self._crc = 0
        self._content: FileCheck | None = None
        """The digest of the file being received, fed with every byte of it in order."""
        self._crc_checked = True
        """The file being received has no digest: its whole-file crc32c is what is checked."""
        self._fd: int | None = None
        self._done: list[int] = []
        self._root: int | None = os.open(staged, _DIR_FLAGS)
        self._data: int | None = None
        try:
            if manifest.kind is ItemKind.DIR:
                if not made:
                    os.mkdir(DATA, 0o755, dir_fd=self._root)
                self._data = os.open(DATA, _DIR_FLAGS, dir_fd=self._root)
                # The manifest lists every parent, and shallower paths first makes them exist.
                for d in sorted(manifest.dirs, key=lambda p: p.count("/")):
                    parent, name = self._parent(d)
                    try:
                        os.mkdir(name, 0o755, dir_fd=parent)
                    finally:
                        os.close(parent)
        except BaseException:
            self.close()
            raise

    def _parent(self, rel: str) -> tuple[int, str]:
        """An open descriptor of ``rel``'s parent, reached without following any symlink."""
        assert self._data is not None
        *parts, name = PurePosixPath(rel).parts
        fd = os.dup(self._data)
        try:
            for part in parts:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd, name

    def _create(self, entry: FileEntry) -> int:
        if self.manifest.kind is ItemKind.FILE:
            assert self._root is not None
            return os.open(DATA, _NEW_FILE_FLAGS, 0o644, dir_fd=self._root)
        parent, name = self._parent(entry.path)
        try:
            return os.open(name, _NEW_FILE_FLAGS, 0o644, dir_fd=parent)
        finally:
            os.close(parent)

    def _where(self, index: int) -> str:
        return f"{self.manifest.item}: {self._files[index].path or 'the file'}"

    def accept(self, file_index: int, offset: int, data: bytes, crc32c: int) -> int:
        """Check one chunk against the manifest and the stream so far; the descriptor to
        write it to (with ``write_all``). Files it completes are verified here and their
        descriptors closed by ``release``, once no write to them can be in flight."""
        if not 0 < len(data) <= MAX_CHUNK:
            raise TransferError(f"{self.manifest.item}: chunk of {len(data)} bytes")
        if file_index >= len(self._files):
            raise TransferError(
                f"{self.manifest.item}: file index {file_index} is out of range "
                f"({len(self._files)} files)"
            )
        if file_index < self._index:
            raise TransferError(f"{self._where(file_index)}: chunk after a later file's")
        if google_crc32c.value(data) != crc32c:  # the one pass over the bytes
            raise CorruptItem(
                f"{self._where(file_index)}: chunk at offset {offset} fails its crc32c"
            )
        return self._place(file_index, offset, data, crc32c)

    def _place(self, file_index: int, offset: int, data: bytes, crc32c: int) -> int:
        """Check a verified slice's place in the stream and extend its file's crc and
        digest."""
        size = len(data)
        while self._index < file_index:
            self._finish_file()
        entry = self._files[file_index]
        if offset != self._offset:
            raise TransferError(
                f"{self._where(file_index)}: chunk at offset {offset}, expected {self._offset}"
            )
        if offset + size > entry.size:
            raise TransferError(
                f"{self._where(file_index)}: data up to {offset + size} bytes, "
                f"the manifest says {entry.size}"
            )
        if self._fd is None:
            self._fd = self._create(entry)
        if self._content is None:
            # The lane's thread already overlaps the hash with the receive; the hasher's own
            # threads on 1 MiB pieces there cost 0.3-0.4 s more CPU per GiB (they spin),
            # for no faster a receive (docs/performance.md, "Content digests").
            self._content = FileCheck(entry, threads=self._lane is None)
            self._crc_checked = crc_checked(entry)
        if self._lane is None:
            self._content.update(data)
        else:
            self._lane.update(self._content, data)
        if self._crc_checked:
            self._crc = crc32c_combine(self._crc, crc32c, size)
        self._offset += size
        self.bytes_written += size
        return self._fd

    @property
    def moved(self) -> int:
        """Bytes written, and ``ENTRY_BYTES`` for each directory made and file done
        (``core.pacing.earned_seconds``); read from another thread, plain reads."""
        return self.bytes_written + ENTRY_BYTES * (self._index + len(self.manifest.dirs))

    @property
    def next_file(self) -> int:
        """The index of the file being received (or due next)."""
        return self._index

    def skip_to(self, file_index: int) -> None:
        """Finish every file before ``file_index`` (a chunk of a later file is next): what
        ``accept`` would do first, for a caller that runs it on another thread. No write may
        be in flight."""
        while self._index < min(file_index, len(self._files)):
            self._finish_file()
        self.release()

    def write(self, file_index: int, offset: int, data: bytes, crc32c: int) -> None:
        """``accept`` and write one chunk, in the calling thread."""
        write_all(self.accept(file_index, offset, data, crc32c), data)
        self.release()

    def write_raw(self, file_index: int, offset: int, data: bytes) -> None:
        """Write a slice that came without a checksum of its own (the data channel's): its
        file's size and digest (whole-file crc32c for a format-1 entry), checked when the
        file completes, still cover it."""
        if not 0 < len(data) <= MAX_CHUNK:
            raise TransferError(f"{self.manifest.item}: slice of {len(data)} bytes")
        if file_index >= len(self._files) or file_index < self._index:
            raise TransferError(f"{self.manifest.item}: slice for file {file_index} out of order")
        # A file with a digest needs no crc32c of its own: one hash per byte, not two.
        crc = google_crc32c.value(data) if crc_checked(self._files[file_index]) else 0
        fd = self._place(file_index, offset, data, crc)
        write_all(fd, data)
        self.release()

    def release(self) -> None:
        """Close the files already verified (no write to them may be in flight)."""
        while self._done:
            os.close(self._done.pop())

    def _finish_file(self) -> None:
        entry = self._files[self._index]
        if self._fd is None:
            # Never handed out, so no write can be in flight: close it now. Holding it to
            # ``release`` would keep one descriptor per empty file of a run (EMFILE).
            os.close(self._create(entry))
        else:
            self._done.append(self._fd)
            self._fd = None
        if not crc_checked(entry):
            if self._offset != entry.size:
                raise CorruptItem(
                    f"{self._where(self._index)}: received {self._offset} bytes, "
                    f"the manifest says {entry.size}"
                )
        elif self._offset != entry.size or self._crc != entry.crc32c:
            raise CorruptItem(
                f"{self._where(self._index)}: received {self._offset} bytes with crc32c "
                f"{self._crc:08x}, the manifest says {entry.size} bytes, {entry.crc32c:08x}"
            )
        content, self._content = self._content or FileCheck(entry), None
        if self._lane is not None:
            self._lane.drain()
        content.check(self._where(self._index))
        self._index += 1
        self._offset = 0
        self._crc = 0

    def finish(self) -> None:
        """The stream ended: every remaining file must be complete (empty ones are made)."""
        while self._index < len(self._files):
            self._finish_file()
        self.close()

    def close(self) -> None:
        self.release()
        if self._lane is not None:
            self._lane.close()
        fds = (self._fd, self._data, self._root)
        self._fd = self._data = self._root = None
        for fd in fds:
            if fd is not None:
                os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (a short write is legal)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --- in an asyncio loop --------------------------------------------------------------------------


class Progress:
    """How far an incoming transfer has got (``ItemWriter.moved``), for its deadline: the
    receiving code hands its writers over (one per connection) once they are made."""

    def __init__(self) -> None:
        self.writers: tuple[ItemWriter, ...] = ()

    def moved(self) -> int:
        return sum(writer.moved for writer in self.writers)


PROGRESS_TICK = 1.0
"""Seconds between two looks at a transfer's progress (``deadline`` with ``earned``): one
timer a second per transfer, nothing per chunk."""


@contextlib.asynccontextmanager
async def deadline(
    seconds: float | None, what: str, earned: Callable[[], float] | None = None
) -> AsyncIterator[None]:
    """Run the body within ``seconds`` in all (None: no bound), else ``TooSlow``: cancelling
    the body's awaits releases what it holds, as any cancellation of a transfer does.

    ``earned``: the seconds the transfer's progress so far allows it
    (``core.pacing.earned_seconds``), looked at every ``PROGRESS_TICK``: it is dropped as
    soon as it has run longer (give or take a tick), not only at ``seconds``.
    """
    if seconds is None:
        yield
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + seconds

    def due() -> float:
        return end if earned is None else min(end, start + earned() + PROGRESS_TICK)

    scope = asyncio.timeout_at(due())
    ticker: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal ticker
        if scope.expired():
            return
        when = due()
        scope.reschedule(when)
        ticker = loop.call_later(PROGRESS_TICK, tick) if when < end else None

    try:
        async with scope:
            if earned is not None:
                ticker = loop.call_later(PROGRESS_TICK, tick)
            yield
    except TimeoutError:
        if not scope.expired():
            raise
        took = loop.time() - start
        if took < seconds - PROGRESS_TICK:
            raise TooSlow(
                f"{what}: too little moved in {took:.0f}s (the whole may take {seconds:.0f}s), "
                "under the minimum rate (--min-transfer-rate of the node that dropped it)"
            ) from None
        raise TooSlow(
            f"{what}: not done within {seconds:.0f}s, under the minimum rate "
            "(--min-transfer-rate of the node that dropped it)"
        ) from None
    finally:
        if ticker is not None:
            ticker.cancel()


class _Serial:
    """Blocking calls run one at a time in an executor; ``drain`` waits for the last one.

    A cancelled await does not stop a call already running in a thread, so cleanup must
    drain before it closes descriptors or removes the files that call is using.
    """

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._last: concurrent.futures.Future[Any] | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        fut = self._executor.submit(fn, *args)
        self._last = fut
        return asyncio.wrap_future(fut)

    def drain(self) -> None:
        if self._last is not None:
            concurrent.futures.wait([self._last])


async def receive_item(
    store: LocalStore,
    manifest: Manifest,
    chunks: AsyncIterator[Chunk],
    executor: Executor,
    progress: Progress | None = None,
) -> int:
    """Stage, verify and commit an incoming item; the bytes written.

    Checks and checksums run in the loop; each write runs in ``executor`` while the loop
    receives and checks the next chunk, so at most two chunks are held and memory does not
    grow with the item. Nothing outside the staging directory is written until the
    commit's rename; on any error the staging directory is removed.
    """
    serial = _Serial(executor)
    staged = store.new_staging()
    writer: ItemWriter | None = None
    try:
        try:
            # Digests on a lane of their own: the loop only checks chunks and hands them on.
            writer = await serial.run(
                functools.partial(ItemWriter, hash_aside=True), manifest, staged
            )
            if progress is not None:
                progress.writers = (writer,)
            pending: asyncio.Future[None] | None = None
            async for file_index, offset, data, crc32c in chunks:
                if file_index - writer.next_file > SKIP_ON_LOOP:
                    # Each file skipped is created (and checked) here: a chunk after 100,000
                    # empty files stalled the loop for a second. A thread makes them.
                    if pending is not None:
                        await pending
                        pending = None
                    await serial.run(writer.skip_to, file_index)
                fd = writer.accept(file_index, offset, data, crc32c)
                if pending is not None:
                    await pending
                writer.release()
                pending = serial.run(write_all, fd, data)
            if pending is not None:
                await pending
            await serial.run(writer.finish)
        except OSError as exc:
            raise StoreError(f"{manifest.item}: cannot stage the incoming copy: {exc}") from exc
        await serial.run(store.commit_staged, staged, manifest)
        return writer.bytes_written
    finally:
        serial.drain()
        if writer is not None:
            writer.close()
        await discard_staging(staged, executor)


async def discard_staging(staged: Path, executor: Executor | None = None) -> None:
    """Remove what a failed transfer staged, on ``executor`` (None: asyncio's): a push of
    100,000 files leaves as many to unlink, which must not stall the event loop. Nothing is
    left after a commit (its rename took the directory).

    Shielded: a push cancelled while its removal waits in the executor's queue would
    otherwise cancel the queued call too, and leave the staged bytes until a restart.
    """
    removal = asyncio.get_running_loop().run_in_executor(executor, fsutil.remove_tree, staged)
    await asyncio.shield(removal)
