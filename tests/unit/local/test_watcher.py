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

from mtc_replicator.local.watcher import DirectoryWatcher, meaning

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
        await recorder.first((None, False, False))
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
    assert meaning(flags.CREATE, "a.save") == (None, False, False)
    assert meaning(flags.MOVED_FROM, "replicator.yaml") == (None, False, False)
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
