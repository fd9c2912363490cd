"""The backup tier: item upload, step commit and verified download on an ObjectStore.

Layout below the backup URL (``core.backup_layout``; docs/architecture.md, "Backups")::

    <job>/<step>/<hh>/<rank>-<worker>/<files...>     item data (``data`` for a file item)
    <job>/<step>/<hh>/<rank>-<worker>.manifest.json  written after the item's files
    <job>/<step>/COMMIT                              written last, create-only

(layout v2; v1, without ``<hh>/``, is still read). Only a step with a ``COMMIT`` is
restorable; the COMMIT pins each item's manifest digest, so an object changed after the
commit is detected. The COMMIT is signed by the node that
wrote it, and a COMMIT that ``trust`` refuses is never restored (``core.signed``). The daemon
never overwrites or deletes anything under a committed step. I/O goes through the
ObjectStore; no vendor code here.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import google_crc32c

from mtc_replicator.core.backup_layout import (
    LAYOUT,
    LAYOUTS,
    CommitRecord,
    commit_key,
    data_key,
    item_key_of,
    manifest_key,
)
from mtc_replicator.core.contract import ascii_digits
from mtc_replicator.core.crc import split_ranges
from mtc_replicator.core.manifest import (
    CancelCheck,
    Cancelled,
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.pacing import Traffic
from mtc_replicator.core.signed import COMMIT_KIND, OPEN, RecordRefused, RecordTrust, Seal
from mtc_replicator.local.digests import FileCheck, HashLane, crc_checked
from mtc_replicator.local.hashing import PIECE, data_file
from mtc_replicator.local.pacer import Meter, Pacer, SharedMeter
from mtc_replicator.storage.objectstore import (
    ChecksumMismatch,
    LeftoverUploads,
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    ParallelPuts,
    PreconditionFailed,
    SmallFilesSideBySide,
)

log = logging.getLogger(__name__)

T = TypeVar("T", bound="_Put | FileEntry")
"""A file to move: one of an upload's puts, or a download's manifest entry."""


LEFTOVER_SKEW = 60.0
"""Seconds by which the store's clock may run ahead of ours: an incomplete upload is a
leftover only if it began this long before this process started."""


def _never() -> bool:
    return False


@dataclass(frozen=True)
class _Put:
    """One file of an item to upload: its key, its source and the crc32c it must have."""

    key: str
    src: Path
    size: int
    crc32c: int


def _put_files(
    objects: ObjectStore,
    puts: list[_Put],
    meter: Meter,
    cancelled: CancelCheck,
    *,
    what: str,
) -> None:
    """Every file of ``puts`` into ``objects`` through ``meter``: in ranges side by side
    on a ``ParallelPuts`` store (``_put_ranges``); on a ``SmallFilesSideBySide`` one, the
    small files side by side first, then the others one at a time; else one at a time.

    A failure (or ``cancelled``) stops the files not yet begun; those in flight end (each
    object is left whole or as it was), and then the failure of the first file, in the
    order they were taken, is raised.
    """
    workers = objects.put_workers() if isinstance(objects, ParallelPuts) else 1
    if isinstance(objects, ParallelPuts) and workers > 1:
        _put_ranges(objects, puts, SharedMeter(meter), cancelled, what=what, workers=workers)
        return
    small, puts, workers = _small_first(objects, puts)
    if small:
        shared = SharedMeter(meter)  # still one transfer: its threads book slice by slice

        def put_one(put: _Put) -> None:
            # Taken as small: one that grew since would go in parts on each of the
            # workers at once, past the memory side by side is allowed.
            if os.lstat(put.src).st_size != put.size:
                raise ChecksumMismatch(
                    f"{put.key}: source is not the {put.size} bytes taken (it changed since "
                    "its checksum was taken); not uploaded"
                )
            objects.put_file(put.key, put.src, crc32c=put.crc32c, meter=shared)

        calls = [functools.partial(put_one, put) for put in small]
        _run_all(calls, workers, cancelled, what=what, name="mtc-small")
    for put in puts:
        if cancelled():
            raise Cancelled(what)
        objects.put_file(put.key, put.src, crc32c=put.crc32c, meter=meter)


def _small_first(objects: ObjectStore, files: Sequence[T]) -> tuple[list[T], list[T], int]:
    """(the files to move side by side, the rest, how many at once): on a
    ``SmallFilesSideBySide`` store with more than one worker, those of at most its limit,
    when there are two or more."""
    if not isinstance(objects, SmallFilesSideBySide) or objects.small_file_workers() < 2:
        return [], list(files), 1
    limit = objects.side_by_side_limit()
    small = [f for f in files if f.size <= limit]
    if len(small) < 2:
        return [], list(files), 1
    return small, [f for f in files if f.size > limit], objects.small_file_workers()


def _run_all(
    calls: Sequence[Callable[[], object]],
    workers: int,
    cancelled: CancelCheck,
    *,
    what: str,
    name: str,
) -> None:
    """Every one of ``calls``, ``workers`` at a time, in order.

    A failure (or ``cancelled``) stops the calls not yet begun; those running end, and
    then the failure of the first call in ``calls``' order is raised. An interrupt of the
    calling thread (a ``mtc`` command's Ctrl-C) does the same: nothing is cleaned up
    under a thread still writing. It waits on the futures, not on the threads: a
    ``Thread.join`` interrupted by a signal can take a running thread for ended
    (CPython 3.11).
    """
    failed = threading.Event()

    def run(call: Callable[[], object]) -> None:
        if failed.is_set():
            return  # another call failed: its error is raised below
        try:
            if cancelled():
                raise Cancelled(what)
            call()
        except BaseException:
            failed.set()
            raise

    pool = ThreadPoolExecutor(max(1, min(workers, len(calls))), thread_name_prefix=name)
    futures: list[Future[None]] = []
    try:
        for call in calls:
            futures.append(pool.submit(run, call))
        wait(futures)
    except BaseException:
        failed.set()
        for future in futures:
            future.cancel()
        wait(futures)
        raise
    finally:
        pool.shutdown(wait=False)
    for future in futures:
        future.result()


def _locked(progress: Callable[[int], None] | None) -> Callable[[int], None] | None:
    """``progress`` made safe to hear from several threads."""
    if progress is None:
        return None
    lock = threading.Lock()
    told = progress

    def heard(nbytes: int) -> None:
        with lock:
            told(nbytes)

    return heard


def _put_ranges(
    objects: ParallelPuts,
    puts: list[_Put],
    meter: Meter,
    cancelled: CancelCheck,
    *,
    what: str,
    workers: int,
) -> None:
    """``_put_files`` on ``workers`` threads, each taking the next ``PIECE`` of the item in
    file order: small files go side by side, and so do a large file's pieces (an item of
    one 35 GB file uses every core). A file is published by whichever thread copies its
    last piece; one that has not been, when the pool ends, is aborted (left as it was)."""
    ranges = [split_ranges(put.size, PIECE) for put in puts]
    opened = [objects.open_put(p.key, p.src, size=p.size, crc32c=p.crc32c) for p in puts]
    left = [len(r) for r in ranges]
    lock = threading.Lock()

    def copy(i: int, offset: int, length: int) -> None:
        opened[i].copy(offset, length, meter)
        with lock:
            left[i] -= 1
            last = not left[i]
        if last:
            opened[i].finish()

    calls = [functools.partial(copy, i, off, n) for i, rs in enumerate(ranges) for off, n in rs]
    try:
        _run_all(calls, workers, cancelled, what=what, name="mtc-put")
    finally:
        for put in opened:
            put.abort()  # a no-op for every file finished


class BackupStore:
    """Backups of checkpoint items on one ObjectStore.

    ``trust`` signs the COMMITs written and decides which ones read are believed (``OPEN``:
    neither signs nor checks, for processes without TLS material).
    """

    def __init__(
        self, objects: ObjectStore, trust: RecordTrust = OPEN, *, pacer: Pacer | None = None
    ) -> None:
        self.objects = objects
        self.trust = trust
        self.pacer = pacer or Pacer()
        """The node's outgoing transfers: uploads are backups, paced by it (downloads are
        restores and are not)."""
        self.started = time.time()
        """Wall-clock start: uploads begun since may be another live daemon's."""
        self.refused: dict[str, dict[int, str]] = {}
        """Per job, the COMMITs the newest listing refused, and why (told to the job)."""
        self._leftovers_warned = False

    @property
    def url(self) -> str:
        return self.objects.url

    def upload_item(self, manifest: Manifest, data: Path, cancelled: CancelCheck = _never) -> None:
        """Upload an item's files, then its manifest. Safe to repeat before the COMMIT.

        A store that copies in ranges side by side (``ParallelPuts``: a filesystem) takes
        up to its ``put_workers()`` of them at once; the manifest is written only once
        every file is there, whatever the order they finished in.
        """
        if self.objects.head(commit_key(manifest.item.job, manifest.item.step)) is not None:
            raise PreconditionFailed(f"{manifest.item}: step is already committed")
        # The manifest's crc32c: a file changed since it was taken is never uploaded.
        puts = [
            _Put(data_key(manifest.item, e.path, LAYOUT), data_file(data, e), e.size, e.crc32c)
            for e in manifest.files
        ]
        # One transfer for the whole item: it shares the link with the job and the peer
        # plane, behind restores and replication (``core.pacing``).
        with self.pacer.transfer(Traffic.BACKUP, cancelled, manifest.item.job) as meter:
            _put_files(self.objects, puts, meter, cancelled, what=str(manifest.item))
        self.objects.put_bytes(manifest_key(manifest.item, LAYOUT), manifest.to_json())

    def abort_leftover_uploads(self, job: str, item_keys: Collection[str]) -> int:
        """Abort the incomplete uploads (S3 multipart) of ``job``'s items ``item_keys``
        (``<rank>-<worker>``, any step) that a killed daemon left; how many.

        Only uploads begun before this store was made (less ``LEFTOVER_SKEW``): during a
        reschedule the old node's daemon may still be uploading the same items, and an
        upload begun since may be its, live. Failures are logged, never raised: a backup
        does not depend on this (a lifecycle rule is the fallback).
        """
        objects = self.objects
        if not isinstance(objects, LeftoverUploads) or not item_keys:
            return 0
        cutoff = self.started - LEFTOVER_SKEW
        aborted = 0
        try:
            for upload in list(objects.incomplete_uploads(f"{job}/")):
                if upload.initiated < cutoff and item_key_of(job, upload.key) in item_keys:
                    objects.abort_upload(upload)
                    aborted += 1
                    log.info(
                        "aborted an incomplete upload of %s, begun %.0fs ago by an earlier run "
                        "job=%s",
                        upload.key,
                        max(time.time() - upload.initiated, 0.0),
                        job,
                        extra={"job": job},
                    )
        except ObjectStoreError as exc:
            if not self._leftovers_warned:
                self._leftovers_warned = True
                log.warning(
                    "cannot clean up incomplete uploads of job %s (docs/permissions.md; a "
                    "bucket lifecycle rule does it too): %s",
                    job,
                    exc,
                    extra={"job": job},
                )
        return aborted

    def try_commit(
        self, job: str, step: int, item_keys: Collection[str], now: float | None = None
    ) -> CommitRecord | None:
        """Write the step's COMMIT if every listed item's manifest is there.

        Returns the commit (ours or one another writer made first), or None when items are
        still missing. Create-only, so two writers can never replace each other's COMMIT.
        """
        existing = self.read_commit(job, step)
        if existing is not None:
            return existing
        digests: dict[str, str] = {}
        owners: set[str | None] = set()
        for key in sorted(item_keys):
            rank, _, worker = key.partition("-")
            item = ItemId(job, step, int(rank), int(worker))
            try:
                manifest = Manifest.from_json(self.objects.get_bytes(manifest_key(item, LAYOUT)))
            except ObjectNotFound:
                return None
            digests[key] = manifest.digest
            owners.add(None if manifest.attestation is None else manifest.attestation.owner)
        # The owner the items name, signed into the COMMIT; items of two owners in one step
        # are no one's step (each restore refuses the other owner's items anyway).
        owner = owners.pop() if len(owners) == 1 else None
        when = time.time() if now is None else now
        record = CommitRecord(job, step, digests, when, LAYOUT, owner or None)
        try:
            sealed = self.trust.seal(COMMIT_KIND, record.body())
            self.objects.put_bytes(commit_key(job, step), sealed, if_absent=True)
        except PreconditionFailed:
            return self.read_commit(job, step)
        log.info(
            "backup committed job=%s step=%d items=%d", job, step, len(digests), extra={"job": job}
        )
        return record

    def missing_items(self, items: Collection[ItemId]) -> list[ItemId]:
        """Those of ``items`` whose manifest is not in the bucket: what a ``try_commit``
        that returned None still waits for."""
        return [i for i in items if self.objects.head(manifest_key(i, LAYOUT)) is None]

    def read_commit(self, job: str, step: int) -> CommitRecord | None:
        found = self.read_commit_raw(job, step)
        return None if found is None else found[0]

    def read_commit_raw(self, job: str, step: int) -> tuple[CommitRecord, bytes] | None:
        """The step's COMMIT and its exact bytes (which a restore pin identifies it by)."""
        found = self.read_commit_sealed(job, step)
        return None if found is None else found[:2]

    def read_commit_sealed(self, job: str, step: int) -> tuple[CommitRecord, bytes, Seal] | None:
        """The step's COMMIT, its bytes, and what is known of its signature.

        Raises ``RecordRefused`` (a ``ManifestError``) when ``trust`` does not believe it.
        """
        try:
            raw = self.objects.get_bytes(commit_key(job, step))
        except ObjectNotFound:
            return None
        record = CommitRecord.from_json(raw)
        if record.job != job or record.step != step:
            raise ManifestError(
                f"COMMIT at {commit_key(job, step)} names {record.job}/{record.step}"
            )
        try:
            seal = self.trust.check(COMMIT_KIND, raw, record.created)
        except RecordRefused as exc:
            raise RecordRefused(f"COMMIT of job {job} step {step} refused: {exc}") from None
        return record, raw, seal

    def committed_steps(self, job: str) -> dict[int, CommitRecord]:
        """Every committed step of ``job``; unreadable COMMITs are logged and skipped.

        One delimiter listing of ``<job>/`` (its step prefixes) and one read per step: the
        cost follows the number of steps in the bucket, never their items or files.
        """
        found: dict[int, CommitRecord] = {}
        refused: dict[int, str] = {}
        base = f"{job}/"
        for prefix in self.objects.list_prefixes(base):
            name = prefix[len(base) : -1]
            if not ascii_digits(name):
                continue
            step = int(name)
            try:
                record = self.read_commit(job, step)
            except RecordRefused as exc:
                log.warning("never restoring backup %s: %s", commit_key(job, step), exc)
                refused[step] = str(exc)
                continue
            except (ManifestError, ObjectNotFound) as exc:
                log.warning("ignoring backup %s: %s", commit_key(job, step), exc)
                continue
            if record is not None:  # None: a step still uploading, or half pruned
                found[record.step] = record
        self.refused[job] = refused
        return found

    def fetch_item(
        self,
        record: CommitRecord,
        item: ItemId,
        staged: Path,
        cancelled: CancelCheck = _never,
        progress: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Download one item of ``record`` into ``staged/data``, verifying every byte;
        ``progress`` hears the bytes written as they are.

        Raises ``CorruptItem`` when anything differs from what the COMMIT pinned.
        """
        expected = record.items.get(item.key)
        if expected is None or not record.has(item):
            raise CorruptItem(f"{item}: not in the committed backup of step {record.step}")
        return self._fetch(item, expected, (record.layout,), staged, cancelled, progress=progress)

    def item_manifest(self, record: CommitRecord, item: ItemId) -> Manifest:
        """The manifest ``record`` pins for ``item`` (``CorruptItem`` if it is not that one)."""
        expected = record.items.get(item.key)
        if expected is None or not record.has(item):
            raise CorruptItem(f"{item}: not in the committed backup of step {record.step}")
        return self._pinned_manifest(item, expected, (record.layout,))[0]

    def fetch_pinned(
        self,
        item: ItemId,
        digest: str,
        staged: Path,
        cancelled: CancelCheck = _never,
        vet: Callable[[Manifest], object] | None = None,
    ) -> Manifest:
        """Download ``item`` into ``staged/data`` given the manifest digest its COMMIT pins
        (from a restore plan: the coordinator read and checked the COMMIT), verifying every
        byte. No listing and no COMMIT read: a manifest GET, then the item's data.

        The layout is not in the plan: the manifest is looked for where this version
        writes it, then where earlier ones did (one more GET, a miss, for a v1 backup).
        Raises ``CorruptItem`` when anything differs from the digest. ``vet`` judges the
        manifest before any data is read (it raises to refuse the item).
        """
        return self._fetch(item, digest, LAYOUTS, staged, cancelled, vet=vet)

    def _fetch(
        self,
        item: ItemId,
        expected: str,
        layouts: Sequence[int],
        staged: Path,
        cancelled: CancelCheck,
        *,
        progress: Callable[[int], None] | None = None,
        vet: Callable[[Manifest], object] | None = None,
    ) -> Manifest:
        manifest, layout = self._pinned_manifest(item, expected, layouts)
        if vet is not None:
            vet(manifest)
        data = staged / "data"
        if manifest.kind is ItemKind.DIR:
            data.mkdir()
            for d in manifest.dirs:
                (data / d).mkdir(parents=True, exist_ok=True)
        # A restore: never throttled, and this node's uploads trickle while it downloads.
        # Digests on a lane beside the download, which goes on receiving meanwhile.
        lane = HashLane()
        try:
            with self.pacer.transfer(Traffic.RESTORE):
                small, files, workers = _small_first(self.objects, manifest.files)
                if small:
                    # Each small file hashed on the thread that fetched it: no lane hop.
                    heard = _locked(progress)
                    calls = [
                        functools.partial(
                            self._fetch_file,
                            item,
                            entry,
                            data_file(data, entry),
                            layout,
                            cancelled,
                            progress=heard,
                        )
                        for entry in small
                    ]
                    _run_all(calls, workers, cancelled, what=str(item), name="mtc-small")
                for entry in files:
                    self._fetch_file(
                        item,
                        entry,
                        data_file(data, entry),
                        layout,
                        cancelled,
                        lane=lane,
                        progress=progress,
                    )
        finally:
            lane.close()
        return manifest

    def _fetch_file(
        self,
        item: ItemId,
        entry: FileEntry,
        dest: Path,
        layout: int,
        cancelled: CancelCheck,
        *,
        lane: HashLane | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """One file of ``item`` into ``dest``, checked against its manifest entry: size and
        BLAKE3 digest, hashed (on ``lane``, or inline without one) as the bytes arrive;
        the whole-file crc32c only for a format-1 entry, which has no digest
        (``digests.crc_checked``). A cloud store's own checksum of what it returns is
        checked by its ``read_chunks`` either way."""
        crc, size = 0, 0
        content = FileCheck(entry)
        with_crc = crc_checked(entry)
        what = f"{item}: backup object {entry.path or 'data'}"
        try:
            with open(dest, "xb") as out:
                for chunk in self.objects.read_chunks(data_key(item, entry.path, layout)):
                    if cancelled():
                        raise Cancelled(str(item))
                    size += len(chunk)
                    if size > entry.size:
                        break
                    if with_crc:
                        crc = google_crc32c.extend(crc, chunk)
                    if lane is None:
                        content.update(chunk)
                    else:
                        lane.update(content, chunk)
                    out.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
        except ObjectNotFound:
            raise CorruptItem(f"{what} is missing") from None
        except ChecksumMismatch as exc:
            raise CorruptItem(f"{what}: {exc}") from None
        if size != entry.size or (with_crc and crc != entry.crc32c):
            raise CorruptItem(f"{what} does not match its manifest (size {size} vs {entry.size})")
        if lane is not None:
            lane.drain()
        content.check(f"{what} does not match its manifest")

    def _pinned_manifest(
        self, item: ItemId, expected: str, layouts: Sequence[int]
    ) -> tuple[Manifest, int]:
        """The item's manifest, found in the first of ``layouts`` that has one, and that
        layout; ``CorruptItem`` unless its digest is ``expected`` and it describes ``item``."""
        for layout in layouts:
            try:
                raw = self.objects.get_bytes(manifest_key(item, layout))
            except ObjectNotFound:
                continue
            try:
                manifest = Manifest.from_json(raw)
            except ManifestError as exc:
                raise CorruptItem(f"{item}: backup manifest is invalid: {exc}") from None
            if manifest.digest != expected or manifest.item != item:
                raise CorruptItem(f"{item}: backup manifest was modified after its COMMIT")
            return manifest, layout
        raise CorruptItem(f"{item}: backup manifest is missing")
