"""The backup tier: item upload, step commit and verified download on an ObjectStore.

Layout below the backup URL (DESIGN.md, "Backups")::

    <job>/<step>/<rank>-<worker>/<files...>        item data (``data`` for a file item)
    <job>/<step>/<rank>-<worker>.manifest.json     written after the item's files
    <job>/<step>/COMMIT                            written last, create-only

Only a step with a ``COMMIT`` is restorable; the COMMIT pins each item's manifest digest,
so an object changed after the commit is detected. The daemon never overwrites or deletes
anything under a committed step. I/O goes through the ObjectStore; no vendor code here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import google_crc32c

from replicator.contract import JOB_NAME_RE
from replicator.manifest import (
    CancelCheck,
    Cancelled,
    CorruptItem,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
    data_file,
)
from replicator.objectstore import (
    ChecksumMismatch,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
)

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_ITEM_KEY_RE = re.compile(r"[0-9]+-[0-9]+")


def _never() -> bool:
    return False


def step_prefix(job: str, step: int) -> str:
    return f"{job}/{step}/"


def manifest_key(item: ItemId) -> str:
    return f"{step_prefix(item.job, item.step)}{item.key}.manifest.json"


def data_key(item: ItemId, path: str) -> str:
    return f"{step_prefix(item.job, item.step)}{item.key}/{path or 'data'}"


def commit_key(job: str, step: int) -> str:
    return f"{step_prefix(job, step)}{COMMIT}"


@dataclass(frozen=True)
class CommitRecord:
    """A committed backup step: the manifest digest of every item, and when it was made."""

    job: str
    step: int
    items: dict[str, str]
    created: float

    def to_json(self) -> bytes:
        body = {"job": self.job, "step": self.step, "items": self.items, "created": self.created}
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CommitRecord:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"COMMIT is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ManifestError("COMMIT must be a JSON object")
        job, step, items, created = (data.get(k) for k in ("job", "step", "items", "created"))
        if not isinstance(job, str) or not JOB_NAME_RE.fullmatch(job):
            raise ManifestError(f"COMMIT has a bad job {job!r:.80}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ManifestError(f"COMMIT has a bad step {step!r:.40}")
        when = math.nan
        if isinstance(created, int | float) and not isinstance(created, bool):
            with contextlib.suppress(OverflowError):  # an int past any float
                when = float(created)
        if not math.isfinite(when):  # NaN and infinities parse as JSON numbers too
            raise ManifestError(f"COMMIT has a bad timestamp {created!r:.40}")
        if not isinstance(items, dict) or not all(
            isinstance(k, str)
            and _ITEM_KEY_RE.fullmatch(k)
            and isinstance(v, str)
            and _DIGEST_RE.fullmatch(v)
            for k, v in items.items()
        ):
            raise ManifestError("COMMIT has a malformed item list")
        return cls(job, step, dict(items), when)

    def has(self, item: ItemId) -> bool:
        return item.job == self.job and item.step == self.step and item.key in self.items


class BackupStore:
    """Backups of checkpoint items on one ObjectStore."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    @property
    def url(self) -> str:
        return self.objects.url

    def upload_item(self, manifest: Manifest, data: Path, cancelled: CancelCheck = _never) -> None:
        """Upload an item's files, then its manifest. Safe to repeat before the COMMIT."""
        if self.objects.head(commit_key(manifest.item.job, manifest.item.step)) is not None:
            raise PreconditionFailed(f"{manifest.item}: step is already committed")
        for entry in manifest.files:
            if cancelled():
                raise Cancelled(str(manifest.item))
            # The manifest's crc32c: a file changed since it was taken is never uploaded.
            self.objects.put_file(
                data_key(manifest.item, entry.path), data_file(data, entry), crc32c=entry.crc32c
            )
        self.objects.put_bytes(manifest_key(manifest.item), manifest.to_json())

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
        for key in sorted(item_keys):
            rank, _, worker = key.partition("-")
            item = ItemId(job, step, int(rank), int(worker))
            try:
                digests[key] = Manifest.from_json(self.objects.get_bytes(manifest_key(item))).digest
            except ObjectNotFound:
                return None
        record = CommitRecord(job, step, digests, time.time() if now is None else now)
        try:
            self.objects.put_bytes(commit_key(job, step), record.to_json(), if_absent=True)
        except PreconditionFailed:
            return self.read_commit(job, step)
        log.info("backup committed job=%s step=%d items=%d", job, step, len(digests))
        return record

    def read_commit(self, job: str, step: int) -> CommitRecord | None:
        found = self.read_commit_raw(job, step)
        return None if found is None else found[0]

    def read_commit_raw(self, job: str, step: int) -> tuple[CommitRecord, bytes] | None:
        """The step's COMMIT and its exact bytes (which a restore pin identifies it by)."""
        try:
            raw = self.objects.get_bytes(commit_key(job, step))
        except ObjectNotFound:
            return None
        record = CommitRecord.from_json(raw)
        if record.job != job or record.step != step:
            raise ManifestError(
                f"COMMIT at {commit_key(job, step)} names {record.job}/{record.step}"
            )
        return record, raw

    def committed_steps(self, job: str) -> dict[int, CommitRecord]:
        """Every committed step of ``job``; unreadable COMMITs are logged and skipped."""
        found: dict[int, CommitRecord] = {}
        for info in self.objects.list(f"{job}/"):
            parts = info.key.split("/")
            if len(parts) != 3 or parts[2] != COMMIT or not parts[1].isdigit():
                continue
            try:
                record = self.read_commit(job, int(parts[1]))
            except (ManifestError, ObjectNotFound) as exc:
                log.warning("ignoring backup %s: %s", info.key, exc)
                continue
            if record is not None:
                found[record.step] = record
        return found

    def fetch_item(
        self, record: CommitRecord, item: ItemId, staged: Path, cancelled: CancelCheck = _never
    ) -> Manifest:
        """Download one committed item into ``staged/data``, verifying every byte.

        Raises ``CorruptItem`` when anything differs from what the COMMIT pinned.
        """
        expected = record.items.get(item.key)
        if expected is None or not record.has(item):
            raise CorruptItem(f"{item}: not in the committed backup of step {record.step}")
        try:
            manifest = Manifest.from_json(self.objects.get_bytes(manifest_key(item)))
        except ObjectNotFound:
            raise CorruptItem(f"{item}: backup manifest is missing") from None
        except ManifestError as exc:
            raise CorruptItem(f"{item}: backup manifest is invalid: {exc}") from None
        if manifest.digest != expected or manifest.item != item:
            raise CorruptItem(f"{item}: backup manifest was modified after its COMMIT")
        data = staged / "data"
        if manifest.kind is ItemKind.DIR:
            data.mkdir()
            for d in manifest.dirs:
                (data / d).mkdir(parents=True, exist_ok=True)
        for entry in manifest.files:
            crc, size = 0, 0
            try:
                with open(data_file(data, entry), "xb") as out:
                    for chunk in self.objects.read_chunks(data_key(item, entry.path)):
                        if cancelled():
                            raise Cancelled(str(item))
                        size += len(chunk)
                        if size > entry.size:
                            break
                        crc = google_crc32c.extend(crc, chunk)
                        out.write(chunk)
            except ObjectNotFound:
                raise CorruptItem(
                    f"{item}: backup object {entry.path or 'data'} is missing"
                ) from None
            except ChecksumMismatch as exc:
                raise CorruptItem(f"{item}: backup object {entry.path or 'data'}: {exc}") from None
            if size != entry.size or crc != entry.crc32c:
                raise CorruptItem(
                    f"{item}: backup object {entry.path or 'data'} does not match its manifest "
                    f"(size {size} vs {entry.size})"
                )
        return manifest
