"""The handshake file ``replicator.yaml`` in CHECKPOINT_DIR as the daemon sees it: what its
writer's events said, the reads of its text so far, and the file operations on it (read,
remove once judged, remove when it is not a regular file). Does file I/O; when the text is
settled enough to judge is decided in ``core.settle``.
"""

from __future__ import annotations

from pathlib import Path

from mtc_replicator.core.contract import CONFIG_FILE, MAX_CONFIG_BYTES
from mtc_replicator.core.settle import Reads, observe
from mtc_replicator.local import fsutil


class HandshakeFile:
    def __init__(self, checkpoint_dir: Path) -> None:
        self.path = checkpoint_dir / CONFIG_FILE
        self.finished = False
        """Whether the yaml's writer is done: closed after writing or renamed into place."""
        self.renamed = False
        """Whether it was renamed into place, with no write since: complete as it appeared."""
        self.reads: Reads | None = None
        """The reads of a handshake not judged yet; None when there is none pending."""

    def trust_existing(self) -> None:
        """At start: a yaml written while the daemon was down has no events left to tell."""
        self.finished = self.path.exists()

    def event(self, finished: bool, renamed: bool) -> None:
        """What the directory watcher saw of it."""
        self.finished, self.renamed = finished, renamed

    def read(self) -> str | None:
        """The handshake's text; None when there is none. ``NotRegularFile`` for a symlink
        (it could name any file the daemon reads) or a FIFO (a read would block forever)."""
        try:
            raw = fsutil.read_regular(self.path, MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            return None
        except fsutil.NotRegularFile as exc:
            if exc.kind == "a directory":
                return None  # the workload's own business, as before
            raise
        return raw.decode("utf-8", errors="replace")

    def observe(self, text: str | None, now: float) -> Reads | None:
        """Record one read of ``text`` at ``now`` (``time.monotonic``)."""
        self.reads = None if text is None else observe(self.reads, text, now)
        return self.reads

    def delete(self, judged: str) -> None:
        """Remove the file if it still holds the text judged: a newer handshake written
        meanwhile must survive. Nothing is pending afterwards either way."""
        try:
            current = self.read()
        except fsutil.NotRegularFile:
            current = None  # replaced meanwhile: the next check refuses it
        if current == judged:
            self.path.unlink(missing_ok=True)
            self.finished = self.renamed = False
        self.reads = None

    def remove_not_regular(self) -> None:
        """Remove a handshake that is a symlink or FIFO, never reading it."""
        if fsutil.lkind(self.path) not in (None, "a regular file"):
            self.path.unlink(missing_ok=True)  # unlink never follows the link it removes
        self.finished = self.renamed = False
        self.reads = None
