"""Restore pins this node's coordinators have used, recorded in the store. I/O module.

A pin is deleted from the bucket once its round is released; when that delete is refused
(a bucket policy without delete, an outage), the pin stays, and without a record every
later restart of the job would restore the pinned step again: a rollback per restart.
The record is one small JSON file per job in the store (``used-pins/<job>.json``, beside
CHECKPOINT_DIR, out of the pods' reach), holding the digests of the pins used: a pin an
operator writes later has another digest and is honoured.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from mtc_replicator.local import fsutil

log = logging.getLogger(__name__)

DIR_NAME = "used-pins"
KEEP = 64
"""Digests kept per job (the newest): a pin is used once, so a few suffice."""
MAX_FILE_BYTES = 64 * 1024


class UsedPins:
    """The digests of the restore pins used, per job, under ``store_root/used-pins``."""

    def __init__(self, store_root: Path) -> None:
        self.root = store_root / DIR_NAME
        self._lock = threading.Lock()

    def _path(self, job: str) -> Path:
        # Job names are checked (``pin_key``) before they get here: no separators.
        return self.root / f"{job}.json"

    def _read(self, job: str) -> list[str]:
        try:
            raw = fsutil.read_regular(self._path(job), MAX_FILE_BYTES)
            digests = json.loads(raw)["digests"]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self._path(job), exc)
            return []
        return [d for d in digests if isinstance(d, str)] if isinstance(digests, list) else []

    def used(self, job: str, digest: str) -> bool:
        with self._lock:
            return digest in self._read(job)

    def record(self, job: str, digest: str) -> None:
        """Remember that the pin ``digest`` of ``job`` was used (raises ``OSError``)."""
        with self._lock:
            digests = [d for d in self._read(job) if d != digest]
            digests.append(digest)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            body = json.dumps({"digests": digests[-KEEP:]}).encode()
            fsutil.atomic_write_bytes(self._path(job), body, durable=True)
