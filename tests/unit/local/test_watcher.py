"""The watch of CHECKPOINT_DIR on a real directory and real inotify: what each change
reports, how soon, and that the watch stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from mtc_replicator.local.watcher import DirectoryWatcher, _Watches, meaning

Seen = tuple[str | None, bool, bool]


class Recorder:
    """What the watch handed to the loop, with the loop's time of each."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Seen]] = []
        self.news = asyncio.Event()

    def __call__(self, name: str | None, finished: bool, renamed: bool) -> None:
        self.events.append((time.monotonic(), (name, finished, renamed)))
        self.news.set()

    async def first(self, wanted: Seen, timeout: float = 5.0) -> float:
        """When ``wanted`` arrived (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for at, seen in self.events:
                if seen == wanted:
                    return at
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"never saw {wanted}; saw {[e for _, e in self.events]}")
            self.news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.news.wait(), left)

    def seen(self) -> list[Seen]:
        return [e for _, e in self.events]


Body = Callable[[Path, Recorder], Awaitable[None]]


def watched(root: Path) -> Callable[[Body], None]:
    """Runs the decorated coroutine at once, on a loop, with ``root`` watched."""

    def run(body: Body) -> None:
        async def main() -> None:
            recorder = Recorder()
            watcher = DirectoryWatcher(root, recorder)
            watcher.start(asyncio.get_running_loop())
            try:
                await body(root, recorder)
            finally:
                watcher.stop()

        asyncio.run(main())

    return run


def test_a_step_renamed_inside_the_directory_is_reported_at_once(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        # Orbax's way: <step>.orbax-checkpoint-tmp-* renamed to <step> in the same directory.
        # watchdog held the rename's first half up to 0.5 s to pair the two, and often did.
        late = []
        for step in range(20):
            tmp = root / f"{step}.orbax-checkpoint-tmp-1"
            tmp.mkdir()
            (tmp / "state").write_bytes(b"x" * 4096)
            await asyncio.sleep(0.01)
            recorder.events.clear()
            renamed = time.monotonic()
            tmp.rename(root / str(step))
            arrived = await recorder.first((None, False, False))
            late.append(arrived - renamed)
        assert max(late) < 0.1, late


def test_a_file_renamed_into_place_is_finished_by_the_rename(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        (root / "replicator.yaml.tmp").write_text("job-name: j\n")
        (root / "replicator.yaml.tmp").rename(root / "replicator.yaml")
        await recorder.first(("replicator.yaml", True, True))


def test_a_file_written_in_place_is_finished_by_its_close(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        with (root / "a.save").open("wb") as f:
            f.write(b"part")
            f.flush()
            await recorder.first(("a.save", False, False))
            assert ("a.save", True, False) not in recorder.seen()
        await recorder.first(("a.save", True, False))


def test_reads_report_nothing(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        # The daemon reads replicator.yaml at every wake-up: a read that woke it would loop.
        (root / "replicator.yaml").write_text("job-name: j\n")
        await recorder.first(("replicator.yaml", True, False))
        recorder.events.clear()
        for _ in range(5):
            (root / "replicator.yaml").read_text()
            os.listdir(root)
        await asyncio.sleep(0.2)
        assert recorder.seen() == []


def test_directories_and_removals_only_wake(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        (root / "10").mkdir()
        (root / "10").rename(root / "replicator.yaml")  # a directory by a file's name: no writer
        (root / "replicator.yaml").rmdir()
        (root / "x").write_bytes(b"1")
        recorder.events.clear()
        (root / "x").unlink()
        await recorder.first(("x", False, False))  # no finished file of that name now
        assert all(name != "replicator.yaml" for name, _, _ in recorder.seen())


def test_below_the_top_level_is_not_watched(tmp_path: Path) -> None:
    @watched(tmp_path)
    async def _(root: Path, recorder: Recorder) -> None:
        (root / "sub").mkdir()
        await recorder.first((None, False, False))
        recorder.events.clear()
        (root / "sub" / "replicator.yaml").write_text("job-name: j\n")
        await asyncio.sleep(0.2)
        assert recorder.seen() == []


def test_stop_ends_the_watch(tmp_path: Path) -> None:
    async def main() -> None:
        recorder = Recorder()
        watcher = DirectoryWatcher(tmp_path, recorder)
        watcher.start(asyncio.get_running_loop())
        started = time.monotonic()
        watcher.stop()
        assert time.monotonic() - started < 1.0
        (tmp_path / "replicator.yaml").write_text("job-name: j\n")
        await asyncio.sleep(0.2)
        assert recorder.seen() == []
        watcher.stop()  # twice is harmless

    asyncio.run(main())


def test_a_missing_directory_cannot_be_watched(tmp_path: Path) -> None:
    watcher = DirectoryWatcher(tmp_path / "gone", Recorder())
    with pytest.raises(FileNotFoundError):
        watcher.start(asyncio.new_event_loop())
    watcher.stop()


def test_meaning_of_each_event() -> None:
    from inotify_simple import flags

    assert meaning(flags.MOVED_TO, "a.save") == ("a.save", True, True)
    assert meaning(flags.CLOSE_WRITE, "a.save") == ("a.save", True, False)
    assert meaning(flags.MODIFY, "a.save") == ("a.save", False, False)
    assert meaning(flags.MOVED_TO | flags.ISDIR, "10") == (None, False, False)
    assert meaning(flags.CREATE, "a.save") == ("a.save", False, False)
    assert meaning(flags.MOVED_FROM, "replicator.yaml") == ("replicator.yaml", False, False)
    assert meaning(flags.DELETE, "a.save") == ("a.save", False, False)
    assert meaning(flags.DELETE | flags.ISDIR, "10") == (None, False, False)
    assert meaning(flags.Q_OVERFLOW, "") == (None, False, False)


def test_stop_after_the_loop_closed(tmp_path: Path) -> None:
    # The daemon's loop may close before the watch is stopped: the thread leaves on its
    # own at the next event, and stop still returns.
    loop = asyncio.new_event_loop()
    recorder = Recorder()
    watcher = DirectoryWatcher(tmp_path, recorder)
    watcher.start(loop)
    loop.close()
    (tmp_path / "x").write_bytes(b"1")
    time.sleep(0.2)
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 1.0
    assert recorder.seen() == []


def _inotify_fds() -> int:
    """inotify instances this process holds open."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:inotify"
    return count


def test_every_directory_shares_one_inotify_instance(tmp_path: Path) -> None:
    # The kernel allows 128 instances a user by default; a daemon watches CHECKPOINT_DIR
    # and up to 256 job directories. One instance per directory ran out before that.
    before = _inotify_fds()  # another test's watch left running shares our instance

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dirs = [tmp_path / f"job-{i}" for i in range(200)]
        recorders = [Recorder() for _ in dirs]
        watchers = [DirectoryWatcher(d, r) for d, r in zip(dirs, recorders, strict=True)]
        for d, watcher in zip(dirs, watchers, strict=True):
            d.mkdir()
            watcher.start(loop)
        try:
            assert _inotify_fds() <= before + 1
            for i, d in enumerate(dirs):
                (d / f"{i}.save").write_bytes(b"x")
            for i, recorder in enumerate(recorders):
                await recorder.first((f"{i}.save", True, False))
                assert {name for name, _, _ in recorder.seen()} <= {f"{i}.save", None}  # its own
        finally:
            for watcher in watchers:
                watcher.stop()
        assert _inotify_fds() == before  # the last watch closed the instance

    asyncio.run(main())


def test_two_watches_of_one_directory_and_one_stopped(tmp_path: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = Recorder(), Recorder()
        a, b = DirectoryWatcher(tmp_path, first), DirectoryWatcher(tmp_path, second)
        a.start(loop)
        b.start(loop)
        try:
            (tmp_path / "one").write_bytes(b"1")
            await first.first(("one", True, False))
            await second.first(("one", True, False))
            a.stop()
            (tmp_path / "two").write_bytes(b"2")
            await second.first(("two", True, False))  # the kernel's watch is still there
            await asyncio.sleep(0.1)
            assert ("two", True, False) not in first.seen()
        finally:
            a.stop()
            b.stop()

    asyncio.run(main())


def test_a_directory_removed_while_watched_leaves_the_others_watched(tmp_path: Path) -> None:
    before = _inotify_fds()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        (tmp_path / "gone").mkdir()
        (tmp_path / "kept").mkdir()
        gone, kept = Recorder(), Recorder()
        watch_gone = DirectoryWatcher(tmp_path / "gone", gone)
        watch_kept = DirectoryWatcher(tmp_path / "kept", kept)
        watch_gone.start(loop)
        watch_kept.start(loop)
        try:
            (tmp_path / "gone").rmdir()
            await gone.first((None, False, False))  # woken: a scan finds it gone
            await asyncio.sleep(0.1)
            watch_gone.stop()  # its kernel watch went with the directory: harmless
            (tmp_path / "kept" / "a.save").write_bytes(b"x")
            await kept.first(("a.save", True, False))
        finally:
            watch_gone.stop()
            watch_kept.stop()
        assert _inotify_fds() == before

    asyncio.run(main())


def test_a_queue_overflow_wakes_every_watch(tmp_path: Path) -> None:
    # Lost events may have been anyone's: every directory is scanned again.
    from inotify_simple import flags

    async def main() -> None:
        loop = asyncio.get_running_loop()
        watches = _Watches()
        recorders = [Recorder(), Recorder()]
        for i, recorder in enumerate(recorders):
            (tmp_path / str(i)).mkdir()
            watches.add(tmp_path / str(i), loop, recorder)
        handles = [w for ws in watches._by_wd.values() for w in ws]
        try:
            with watches._lock:
                watches._dispatch(-1, flags.Q_OVERFLOW, "")
            for recorder in recorders:
                await recorder.first((None, False, False))
        finally:
            for handle in handles:
                watches.remove(handle)

    asyncio.run(main())


def test_a_flood_on_one_name_takes_constant_memory_and_starves_no_one(tmp_path: Path) -> None:
    # A pod renames one name back and forth while the daemon's loop is busy elsewhere:
    # the loop hears each name's latest state once, and the other directory's event is
    # not queued behind the flood.
    noisy, quiet = tmp_path / "noisy", tmp_path / "quiet"
    noisy.mkdir()
    quiet.mkdir()
    loop = asyncio.new_event_loop()  # not running: the daemon's loop busy elsewhere
    seen_noisy: list[str | None] = []
    seen_quiet: list[tuple[int, str | None]] = []
    a = DirectoryWatcher(noisy, lambda name, *_: seen_noisy.append(name))
    b = DirectoryWatcher(quiet, lambda name, *_: seen_quiet.append((len(seen_noisy), name)))
    a.start(loop)
    b.start(loop)
    try:
        (noisy / "a").write_bytes(b"x")
        for _ in range(20_000):
            os.rename(noisy / "a", noisy / "b")
            os.rename(noisy / "b", noisy / "a")
        (quiet / "q-s1-n0-w0.save").write_bytes(b"x")
        time.sleep(0.5)  # the reader drains the kernel's queue meanwhile
        queued = len(loop._ready)  # type: ignore[attr-defined]
        assert queued <= 16, f"{queued} callbacks queued for two directories"
        loop.run_until_complete(asyncio.sleep(0.2))
        assert ("q-s1-n0-w0.save") in [n for _, n in seen_quiet]
        # What the pod did last to each name is what the loop hears (a wake, had the
        # kernel's queue overflowed meanwhile).
        assert set(seen_noisy) <= {"a", "b", None}
        assert len(seen_noisy) <= 8
    finally:
        a.stop()
        b.stop()
        loop.close()
