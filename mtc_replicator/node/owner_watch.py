"""Whose pod this node's CHECKPOINT_DIR belongs to: the CSI plugin's ``owner.json``, read on
the daemon's thread pool (the one its shutdown waits for) at every read of a handshake, at a
resume, at start and once a second (``node.supervisor`` acts on a change: ``core.handoff``).
Does file I/O; the file's format is ``core.ownership``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from mtc_replicator.core.handoff import StoreHandoff, decide_handoff
from mtc_replicator.core.ownership import (
    MAX_OWNER_FILE_BYTES,
    UNOWNED,
    BadOwner,
    Owner,
    parse_owner,
)
from mtc_replicator.local.store_owner import read_store_owner

CHECK_EVERY = 1.0
"""Seconds between two periodic reads: a job ends, and the store is emptied, at most this
late after its node changed hands (a handshake is never judged before: it reads the file
itself)."""


def read_owner(path: Path | None) -> str:
    """The namespace this node's pod belongs to now (UNOWNED without an owner file); raises
    ``BadOwner`` when the file is missing or malformed."""
    return UNOWNED if path is None else read_owner_record(path).namespace


def read_owner_record(path: Path) -> Owner:
    """The whole ``owner.json`` (the pod too); ``BadOwner`` when missing or malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_OWNER_FILE_BYTES + 1)
    except OSError as exc:
        raise BadOwner(f"cannot read the owner file {path}: {exc.strerror or exc}") from None
    try:
        return parse_owner(raw)
    except BadOwner as exc:
        raise BadOwner(f"the owner file {path} is malformed: {exc}") from None


def handed_over(path: Path | None, store_root: Path) -> bool:
    """Whether the node changed hands and its store is not emptied yet (``core.handoff``):
    the Peer server answers nothing of its items meanwhile. False without an owner file, or
    with one that cannot be read (the handshake is refused then)."""
    if path is None:
        return False
    try:
        owner = read_owner(path)
    except BadOwner:
        return False
    return decide_handoff(read_store_owner(store_root), owner) is StoreHandoff.PURGE


class OwnerWatch:
    """Reads of the owner file, now or when the periodic read is due."""

    def __init__(
        self,
        path: Path | None,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        """``--owner-file``; None: every job is unowned."""
        self._executor = executor
        self._clock = clock
        self._checked = 0.0

    async def read(self) -> str:
        """``read_owner`` on the daemon's pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, read_owner, self.path)

    def due(self) -> bool:
        """Whether the periodic read is due: at most once every ``CHECK_EVERY`` seconds, and
        never without an owner file."""
        now = self._clock()
        if self.path is None or now - self._checked < CHECK_EVERY:
            return False
        self._checked = now
        return True
