"""The store's owner record, ``STORE/store-owner``: the namespace whose items the store
holds (``core.handoff``). I/O: that one file, written only by the daemon, by temp + rename.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from mtc_replicator.core.handoff import (
    MAX_RECORD_BYTES,
    NoRecord,
    owner_record,
    parse_owner_record,
)
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.local import fsutil

log = logging.getLogger(__name__)

RECORD_FILE = "store-owner"


def read_store_owner(store_root: Path) -> str | NoRecord:
    """The namespace the store's items belong to, or why it names none."""
    path = store_root / RECORD_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return NoRecord.MISSING
    except OSError as exc:
        log.warning("the store owner record %s is unreadable: %s", path, exc)
        return NoRecord.MALFORMED
    try:
        raw = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return parse_owner_record(raw)
    except BadOwner as exc:
        log.warning("the store owner record %s is malformed: %s", path, exc)
        return NoRecord.MALFORMED


def write_store_owner(store_root: Path, namespace: str) -> None:
    """Record that the store's items are ``namespace``'s (atomically)."""
    fsutil.atomic_write_bytes(store_root / RECORD_FILE, owner_record(namespace))
