"""File events on CHECKPOINT_DIR, turned into wake-ups for the asyncio loop. I/O module.

Events are hints, never the truth: inotify can drop them, so the daemon re-scans the
directory on every wake-up and on a timer. The one fact events carry that a scan cannot
see is whether a file's writer is done: written (not finished) until it is closed after
writing or renamed into place (finished). That decides when a ``.save`` file or a
``replicator.yaml`` written in place is complete.

The raw inotify events (``inotify_simple``), read by one thread per watched directory and
handed over as they come. Not watchdog: to pair the two halves of a rename it holds a
rename's first half for up to 0.5 s, and a rename inside the directory (Orbax's
``<step>.orbax-checkpoint-tmp-*`` to ``<step>``) often reached the daemon that late, so
the step's ingest started late (docs/performance.md, "Throughput and cores"). Nothing
here needs the pairing: a name renamed into place is complete, whatever it was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path

from inotify_simple import INotify, flags

OnEvent = Callable[[str | None, bool, bool], None]
"""``(name, finished, renamed)``: a top-level file whose writer wrote (False) or is done
(True); ``renamed``: done by a rename into place, so complete when it appeared (no in-place
writer can still be between two writes)."""

WATCHED = (
    flags.MODIFY
    | flags.CLOSE_WRITE
    | flags.MOVED_TO
    | flags.MOVED_FROM
    | flags.CREATE
    | flags.DELETE
    | flags.DELETE_SELF
    | flags.MOVE_SELF
)
"""No ``OPEN``, ``ACCESS`` or ``CLOSE_NOWRITE``: a read (our own, of ``replicator.yaml``)
changes nothing, and reporting it would make every wake-up cause the next."""


def meaning(mask: int, name: str) -> tuple[str | None, bool, bool]:
    """What one inotify event says, as ``OnEvent`` takes it. A directory's or the watched
    directory's own events only wake (no name): only files have writers to wait for."""
    if not name or mask & flags.ISDIR:
        return None, False, False
    if mask & flags.MOVED_TO:
        return name, True, True
    if mask & flags.CLOSE_WRITE:
        return name, True, False
    if mask & flags.MODIFY:
        return name, False, False
    return None, False, False  # created, deleted, renamed away: a scan tells what is there


class DirectoryWatcher:
    """Watches the top level of one directory (not below: the store is ours)."""

    def __init__(self, root: Path, on_event: OnEvent) -> None:
        self._root = root
        self._on_event = on_event
        self._stop_w = -1
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch from now on; raises ``OSError`` when the directory cannot be watched."""
        inotify = INotify()
        try:
            inotify.add_watch(os.fspath(self._root), WATCHED)
        except OSError:
            inotify.close()
            raise
        stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(
            target=self._run, args=(inotify, stop_r, loop), name="mtc-watch", daemon=True
        )
        self._thread.start()

    def _run(self, inotify: INotify, stop_r: int, loop: asyncio.AbstractEventLoop) -> None:
        poller = select.poll()
        poller.register(inotify.fileno(), select.POLLIN)
        poller.register(stop_r, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if stop_r in ready:
                    return
                for event in inotify.read(timeout=0):
                    # On this thread: hand over to the loop, never touch its state here.
                    loop.call_soon_threadsafe(self._on_event, *meaning(event.mask, event.name))
        except RuntimeError:
            return  # the loop closed under us: the daemon is going
        finally:
            os.close(stop_r)
            inotify.close()

    def stop(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(OSError):  # the thread already left (its loop closed)
            os.write(self._stop_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._stop_w)
        self._thread = None
