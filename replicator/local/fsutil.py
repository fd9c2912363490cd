"""Small filesystem primitives that publish atomically (temp + rename) and clean up safely.

I/O module. Temp names start with ``.mtc-tmp-`` so the workload's scanner and ours both
ignore them, and start-up cleanup can find ours without touching anyone else's.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

TMP_PREFIX = ".mtc-tmp-"


def tmp_name(final: Path) -> Path:
    return final.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{final.name}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(
    path: Path, data: bytes, *, durable: bool = False, mode: int | None = None
) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one.

    ``durable`` adds fsyncs, for disks that survive a power loss (tmpfs does not); ``mode``
    is set before a byte is written (a private key is never readable by others).
    """
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line with a single write, so concurrent readers see whole lines."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a file, symlink or directory tree; a missing path is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def discard_tree(path: Path, trash: Path) -> None:
    """Make ``path`` vanish in one rename, then delete it at leisure.

    A crash during the slow delete leaves only garbage in ``trash``, never a half item.
    """
    trash.mkdir(parents=True, exist_ok=True)
    target = trash / uuid.uuid4().hex
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return
    remove_tree(target)
