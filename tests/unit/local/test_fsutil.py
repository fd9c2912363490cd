"""Opens that a pod's symlinks and FIFOs cannot redirect or block (``mtc_replicator.local.fsutil``).

Every case runs against both ways of opening beneath a directory: openat2(2) (skipped
where the kernel lacks it) and the descriptor walk the daemon falls back on, and against
``open_beneath``, which picks one.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtc_replicator.local import fsutil

Opener = Callable[[int, str, int], int]


def _openat2_available() -> bool:
    try:
        os.close(fsutil.open_beneath_openat2(os.open("/", os.O_RDONLY), "tmp", os.O_RDONLY))
    except OSError as exc:
        return exc.errno not in (errno.ENOSYS, errno.EPERM)
    return True


OPENERS = [
    pytest.param(fsutil.open_beneath_walk, id="walk"),
    pytest.param(
        fsutil.open_beneath_openat2,
        id="openat2",
        marks=pytest.mark.skipif(not _openat2_available(), reason="no openat2 on this kernel"),
    ),
    pytest.param(fsutil.open_beneath, id="open_beneath"),
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/a/b/file, an outside file, and root/link -> a, root/a/flink -> b/file."""
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "file").write_bytes(b"inside")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "file").write_bytes(b"outside")
    (root / "link").symlink_to("a")
    (root / "a" / "flink").symlink_to("b/file")
    (root / "a" / "escape").symlink_to(tmp_path / "outside")
    return root


@pytest.fixture
def root_fd(tree: Path) -> Iterator[int]:
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _errno(opener: Opener, root: int, rel: str, flags: int = os.O_RDONLY) -> int | None:
    """The errno the open fails with; None when it succeeds."""
    try:
        os.close(opener(root, rel, flags))
    except OSError as exc:
        return exc.errno
    return None


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


@pytest.mark.parametrize("opener", OPENERS)
def test_a_plain_path_opens(opener: Opener, root_fd: int) -> None:
    assert _read(opener(root_fd, "a/b/file", os.O_RDONLY)) == b"inside"
    os.close(opener(root_fd, "a/b", os.O_RDONLY | os.O_DIRECTORY))


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize(
    "rel",
    ["link/b/file", "a/flink", "a/escape/file", "a/escape", "link"],
    ids=["symlinked-first-dir", "symlinked-file", "symlinked-middle-dir", "last-dir", "top"],
)
def test_a_symlink_at_any_component_is_refused(opener: Opener, root_fd: int, rel: str) -> None:
    assert _errno(opener, root_fd, rel) == errno.ELOOP


@pytest.mark.parametrize("opener", OPENERS)
@pytest.mark.parametrize(
    "rel", ["../outside/file", "a/../../outside/file", "a/../a/b/file", "/etc"]
)
def test_dot_dot_and_absolute_paths_are_refused(opener: Opener, root_fd: int, rel: str) -> None:
    assert _errno(opener, root_fd, rel) == errno.EXDEV


@pytest.mark.parametrize("opener", OPENERS)
def test_files_are_created_without_following(opener: Opener, root_fd: int, tree: Path) -> None:
    fd = opener(root_fd, "a/b/new", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    os.close(fd)
    assert (tree / "a" / "b" / "new").is_file()
    assert _errno(opener, root_fd, "link/new", os.O_WRONLY | os.O_CREAT) == errno.ELOOP
    assert not (tree / "a" / "new").exists()


def test_the_walk_is_used_when_the_kernel_has_no_openat2(
    monkeypatch: pytest.MonkeyPatch, tree: Path
) -> None:
    calls: list[str] = []

    def no_openat2(*_args: object) -> int:
        calls.append("openat2")
        raise OSError(errno.ENOSYS, "no")

    monkeypatch.setattr(fsutil, "open_beneath_openat2", no_openat2)
    monkeypatch.setattr(fsutil._Openat2, "works", True)
    assert _read(fsutil.open_beneath(tree, "a/b/file", os.O_RDONLY)) == b"inside"
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        fsutil.open_beneath(tree, "link/b/file", os.O_RDONLY)
    assert calls == ["openat2"]  # asked once, then never again
    assert fsutil._Openat2.works is False


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(fsutil.NotRegularFile, match="a FIFO"):
        fsutil.open_file_beneath(tmp_path, "fifo")
    with pytest.raises(fsutil.NotRegularFile, match="a FIFO"):
        fsutil.read_regular(tmp_path / "fifo", 100)


def test_read_regular_refuses_symlinks(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"0123456789")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert fsutil.read_regular(tmp_path / "real", 4) == b"0123"
    with pytest.raises(fsutil.NotRegularFile, match="a symlink"):
        fsutil.read_regular(tmp_path / "link", 100)
    with pytest.raises(FileNotFoundError):
        fsutil.read_regular(tmp_path / "missing", 100)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "regular", "missing"])
def test_append_line_never_follows_a_planted_name(tmp_path: Path, kind: str) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    errors = tmp_path / "replicator.errors"
    if kind == "symlink":
        errors.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(errors)
    elif kind == "regular":
        errors.write_text("first\n")
    fsutil.append_line(errors, "a line")
    assert fsutil.lkind(errors) == "a regular file"
    want = "first\na line\n" if kind == "regular" else "a line\n"
    assert errors.read_text() == want
    assert victim.read_text() == "keep\n"


def test_a_line_written_while_a_reader_claims_the_file_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client claims replicator.errors by renaming it, reads it and deletes it: a line
    whose write lands in the claimed file after that read is written again at the name."""
    errors = tmp_path / "replicator.errors"
    claimed = tmp_path / "claimed.tmp"
    write = os.write
    calls = []

    def claim_first(fd: int, data: bytes) -> int:
        if not calls:  # the reader renames, reads (nothing yet) and deletes, mid-append
            os.rename(errors, claimed)
            assert claimed.read_bytes() == b""
            claimed.unlink()
        calls.append(data)
        return write(fd, data)

    monkeypatch.setattr(fsutil.os, "write", claim_first)
    fsutil.append_line(errors, "a line")
    assert errors.read_text() == "a line\n"
    assert len(calls) == 2
