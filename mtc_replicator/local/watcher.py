"""File events on CHECKPOINT_DIR, turned into wake-ups for the asyncio loop. I/O module.

Events are hints, never the truth: inotify can drop them, so the daemon re-scans the
directory on every wake-up and on a timer. The one fact events carry that a scan cannot
see is whether a file's writer is done: written (not finished) until it is closed after
writing or renamed into place (finished). That decides when a ``.save`` file or a
``replicator.yaml`` written in place is complete.

The raw inotify events (``inotify_simple``) of every watched directory, read by one thread
on one inotify instance and handed over as they come. Not watchdog: to pair the two halves
of a rename it holds a rename's first half for up to 0.5 s, and a rename inside the
directory (Orbax's ``<step>.orbax-checkpoint-tmp-*`` to ``<step>``) often reached the
daemon that late, so the step's ingest started late (docs/performance.md, "Throughput and
cores"). Nothing here needs the pairing: a name renamed into place is complete, whatever
it was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
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
    if mask & (flags.MODIFY | flags.CREATE | flags.DELETE | flags.MOVED_FROM):
        # Created (a writer's first byte may be far off), removed or renamed away: no
        # finished file of that name now, whatever an earlier close said of another one.
        return name, False, False
    return None, False, False


@dataclass(eq=False)
class _Watch:
    """One caller's watch of one directory: where its events go."""

    wd: int
    loop: asyncio.AbstractEventLoop
    on_event: OnEvent
    pending: dict[str | None, tuple[bool, bool]] = field(default_factory=dict)
    """What the loop has not heard yet (under ``_Watches._lock``): each name's latest
    ``(finished, renamed)``, the one thing the consumer keeps of it, and None for a bare
    wake. One hand-over at a time: a pod that does the same to a name over and over costs
    one entry, however long the loop is busy, and delays no other directory's events."""
    scheduled: bool = False
    """A hand-over of ``pending`` is on the loop's queue."""
    removed: bool = False


class _Watches:
    """Every directory this process watches, on one inotify instance read by one thread.

    An instance per directory ran out: the kernel allows 128 instances a user by default,
    while a daemon serves CHECKPOINT_DIR and up to 256 job directories; watches are many
    more (``max_user_watches``, 8,192 and up, one each). Opened by the first watch, closed
    with the last. Watch descriptors are allocated cyclically by the kernel, so one whose
    directory went away (``IN_IGNORED``) is not handed out again meanwhile.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inotify: INotify | None = None
        self._stop_w = -1
        self._thread: threading.Thread | None = None
        self._by_wd: dict[int, list[_Watch]] = {}

    def add(self, root: Path, loop: asyncio.AbstractEventLoop, on_event: OnEvent) -> _Watch:
        """Watch ``root`` from now on; ``OSError`` when it cannot be watched."""
        with self._lock:
            if self._inotify is None:
                self._open()
            assert self._inotify is not None
            try:
                wd = self._inotify.add_watch(os.fspath(root), WATCHED)
            except OSError as exc:
                refused, reader = exc, None if self._by_wd else self._detach()
            else:
                watch = _Watch(wd, loop, on_event)
                self._by_wd.setdefault(wd, []).append(watch)
                return watch
        _stop(reader)
        raise refused

    def remove(self, watch: _Watch) -> None:
        """No event reaches ``watch`` once this returns; the last watch closes the instance."""
        with self._lock:
            sharing = self._by_wd.get(watch.wd, [])
            watch.removed = True
            watch.pending.clear()
            if watch in sharing:
                sharing.remove(watch)
                if not sharing:
                    del self._by_wd[watch.wd]
                    if self._inotify is not None:
                        with contextlib.suppress(OSError):  # its directory went away
                            self._inotify.rm_watch(watch.wd)
            reader = None if self._by_wd else self._detach()
        _stop(reader)

    def _open(self) -> None:
        inotify = INotify()
        stop_r, self._stop_w = os.pipe()
        self._inotify = inotify
        self._thread = threading.Thread(
            target=self._run, args=(inotify, stop_r), name="mtc-watch", daemon=True
        )
        self._thread.start()

    def _detach(self) -> tuple[threading.Thread, int] | None:
        """Forget the instance (under the lock); its reader and stop pipe, for ``_stop``
        once the lock is released: the reader takes the lock to hand events over."""
        thread, stop_w = self._thread, self._stop_w
        self._inotify, self._thread, self._stop_w = None, None, -1
        return None if thread is None else (thread, stop_w)

    def _run(self, inotify: INotify, stop_r: int) -> None:
        poller = select.poll()
        poller.register(inotify.fileno(), select.POLLIN)
        poller.register(stop_r, select.POLLIN)
        try:
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if stop_r in ready:
                    return
                events = inotify.read(timeout=0)
                with self._lock:
                    if self._inotify is not inotify:
                        return  # closed meanwhile: the stop byte is on its way
                    for event in events:
                        self._dispatch(event.wd, event.mask, event.name)
        finally:
            os.close(stop_r)
            inotify.close()

    def _dispatch(self, wd: int, mask: int, name: str) -> None:
        """Hand one event to its watches' loops (under the lock). A queue overflow lost
        events of any directory: it wakes them all."""
        watches = (
            [w for ws in self._by_wd.values() for w in ws]
            if mask & flags.Q_OVERFLOW
            else self._by_wd.get(wd, [])
        )
        seen, finished, renamed = meaning(mask, name)
        for watch in watches:
            watch.pending.pop(seen, None)  # the latest last
            watch.pending[seen] = (finished, renamed)
            if watch.scheduled:
                continue
            # On this thread: hand over to the loop, never touch its state here.
            try:
                watch.loop.call_soon_threadsafe(self._deliver, watch)
            except RuntimeError:  # its loop closed: the daemon is going
                watch.pending.clear()
            else:
                watch.scheduled = True
        if mask & flags.IGNORED:
            self._by_wd.pop(wd, None)  # the directory went away and its watch with it

    def _deliver(self, watch: _Watch) -> None:
        """On ``watch``'s loop: what it has not heard yet."""
        with self._lock:
            pending, watch.pending, watch.scheduled = watch.pending, {}, False
        for name, (finished, renamed) in pending.items():
            if watch.removed:
                return
            try:
                watch.on_event(name, finished, renamed)
            except Exception as exc:  # as the loop would say of a callback of its own
                watch.loop.call_exception_handler(
                    {"message": "file event callback failed", "exception": exc}
                )


def _stop(reader: tuple[threading.Thread, int] | None) -> None:
    """End a detached reader: it leaves at the stop byte, or at its next events."""
    if reader is None:
        return
    thread, stop_w = reader
    with contextlib.suppress(OSError):  # it already left (saw it was detached) and closed
        os.write(stop_w, b"x")
    if thread is not threading.current_thread():
        thread.join(timeout=5)
    os.close(stop_w)


_WATCHES = _Watches()


class DirectoryWatcher:
    """Watches the top level of one directory (not below: the store is ours), on the
    process's one inotify instance (``_Watches``)."""

    def __init__(self, root: Path, on_event: OnEvent) -> None:
        self._root = root
        self._on_event = on_event
        self._watch: _Watch | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch from now on; raises ``OSError`` when the directory cannot be watched."""
        self._watch = _WATCHES.add(self._root, loop, self._on_event)

    def stop(self) -> None:
        if self._watch is not None:
            _WATCHES.remove(self._watch)
            self._watch = None
