"""Whose pod this node's CHECKPOINT_DIR belongs to: the CSI plugin's ``owner.json``, read on
the daemon's thread pool (the one its shutdown waits for) at every handshake, at a resume,
and once a second while a job runs. Does file I/O; the file's format is ``core.ownership``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from mtc_replicator.core.ownership import MAX_OWNER_FILE_BYTES, UNOWNED, BadOwner, parse_owner

CHECK_EVERY = 1.0
"""Seconds between two reads while a job runs: a job ends at most this late after its node
changed hands."""


def read_owner(path: Path | None) -> str:
    """The namespace this node's pod belongs to now (UNOWNED without an owner file); raises
    ``BadOwner`` when the file is missing or malformed."""
    if path is None:
        return UNOWNED
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_OWNER_FILE_BYTES + 1)
    except OSError as exc:
        raise BadOwner(f"cannot read the owner file {path}: {exc.strerror or exc}") from None
    try:
        return parse_owner(raw).namespace
    except BadOwner as exc:
        raise BadOwner(f"the owner file {path} is malformed: {exc}") from None


class OwnerWatch:
    """Reads of the owner file, and whether the node changed hands since a job began."""

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

    async def moved_from(self, owner: str) -> bool:
        """Whether the node belongs to another than ``owner`` now; read at most once every
        ``CHECK_EVERY`` seconds (False in between) and never without an owner file."""
        now = self._clock()
        if self.path is None or now - self._checked < CHECK_EVERY:
            return False
        self._checked = now
        try:
            return await self.read() != owner
        except BadOwner:
            return True  # written by rename, so never half there: treat it as changed
