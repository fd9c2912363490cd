"""File events on CHECKPOINT_DIR, turned into wake-ups for the asyncio loop. I/O module.

Events are hints, never the truth: inotify can drop them, so the daemon re-scans the
directory on every wake-up and on a timer. The one fact an event carries that a scan
cannot see is "this file was closed after writing", which decides when a ``.save`` file
written in place is finished.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileClosedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer


class _Handler(FileSystemEventHandler):
    def __init__(
        self, root: Path, loop: asyncio.AbstractEventLoop, on_event: Callable[[str | None], None]
    ) -> None:
        self._root = os.fspath(root)
        self._loop = loop
        self._on_event = on_event

    def on_any_event(self, event: FileSystemEvent) -> None:
        closed: str | None = None
        if isinstance(event, FileClosedEvent):
            path = os.fsdecode(event.src_path)
            if os.path.dirname(path) == self._root:
                closed = os.path.basename(path)
        # Runs on watchdog's thread: hand over to the loop, never touch its state here.
        self._loop.call_soon_threadsafe(self._on_event, closed)


class DirectoryWatcher:
    """Watches the top level of one directory (not below: the store is ours)."""

    def __init__(self, root: Path, on_event: Callable[[str | None], None]) -> None:
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
