"""File events on CHECKPOINT_DIR, turned into wake-ups for the asyncio loop. I/O module.

Events are hints, never the truth: inotify can drop them, so the daemon re-scans the
directory on every wake-up and on a timer. The one fact events carry that a scan cannot
see is whether a file's writer is done: written (not finished) until it is closed after
writing or renamed into place (finished). That decides when a ``.save`` file or a
``replicator.yaml`` written in place is complete.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from watchdog.events import (
    FileClosedEvent,
    FileClosedNoWriteEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileOpenedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

OnEvent = Callable[[str | None, bool, bool], None]
"""``(name, finished, renamed)``: a top-level file whose writer wrote (False) or is done
(True); ``renamed``: done by a rename into place, so complete when it appeared (no in-place
writer can still be between two writes)."""


class _Handler(FileSystemEventHandler):
    def __init__(self, root: Path, loop: asyncio.AbstractEventLoop, on_event: OnEvent) -> None:
        self._root = os.fspath(root)
        self._loop = loop
        self._on_event = on_event

    def on_any_event(self, event: FileSystemEvent) -> None:
        if isinstance(event, FileOpenedEvent | FileClosedNoWriteEvent):
            return  # a read (our own, of replicator.yaml) changes nothing: no busy loop
        path: str | None = None
        finished = renamed = False
        if isinstance(event, FileClosedEvent):  # closed after writing, not after a read
            path, finished = os.fsdecode(event.src_path), True
        elif isinstance(event, FileMovedEvent):  # renamed into place: complete
            path, finished, renamed = os.fsdecode(event.dest_path), True, True
        elif isinstance(event, FileModifiedEvent):
            path = os.fsdecode(event.src_path)
        name = os.path.basename(path) if path and os.path.dirname(path) == self._root else None
        # Runs on watchdog's thread: hand over to the loop, never touch its state here.
        self._loop.call_soon_threadsafe(self._on_event, name, finished, renamed)


class DirectoryWatcher:
    """Watches the top level of one directory (not below: the store is ours)."""

    def __init__(self, root: Path, on_event: OnEvent) -> None:
        self._root = root
        self._on_event = on_event
        self._observer: Observer | None = None  # type: ignore[valid-type]

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        observer = Observer()
        observer.schedule(
            _Handler(self._root, loop, self._on_event), os.fspath(self._root), recursive=False
        )
        observer.daemon = True
        observer.start()
        self._observer = observer

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
