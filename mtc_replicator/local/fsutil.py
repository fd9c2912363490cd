"""Small filesystem primitives: atomic publishing (temp + rename), safe cleanup, and opens
that a pod's symlinks and FIFOs cannot redirect or block.

I/O module. Temp names start with ``.mtc-tmp-`` so the workload's scanner and ours both
ignore them, and start-up cleanup can find ours without touching anyone else's.

Training pods write CHECKPOINT_DIR, and a pod that kept a descriptor of its step directory
can still change it after the daemon took it into the store. So every open inside the
store goes through ``open_beneath`` (no symlink at any component, no ``..``), and every
contract file a pod can replace is opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only
when ``fstat`` says it is a regular file (``read_regular``, ``append_line``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil
import stat
import uuid
from pathlib import Path, PurePath

TMP_PREFIX = ".mtc-tmp-"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# --- opening beneath a directory, never through a symlink ---------------------------------------

_SYS_OPENAT2 = 437 if platform.machine() in ("x86_64", "aarch64", "arm64") else None
"""openat2(2) (Linux 5.6+) has the same number on both; other machines use the walk."""
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _Openat2:
    works = _SYS_OPENAT2 is not None and platform.system() == "Linux"
    """Cleared the first time the kernel (or a seccomp filter) says it has no openat2."""


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def _libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype = ctypes.c_long
    return lib


_LIBC = _libc() if _Openat2.works else None


def _components(rel: str | PurePath) -> tuple[str, ...]:
    """``rel``'s names; an absolute path or a ``..`` anywhere is refused outright."""
    text = str(rel)
    if text.startswith("/"):
        raise OSError(errno.EXDEV, f"absolute path {text!r} where a relative one is expected")
    parts = tuple(p for p in text.split("/") if p not in ("", "."))
    if ".." in parts:
        raise OSError(errno.EXDEV, f"{text!r} climbs out with '..'")
    return parts


def open_beneath_openat2(dir_fd: int, rel: str | PurePath, flags: int, mode: int = 0o644) -> int:
    """``open_beneath`` by openat2(2) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS: the kernel
    refuses a symlink at any component (ELOOP). ENOSYS where the kernel lacks it."""
    if _LIBC is None or _SYS_OPENAT2 is None:
        raise OSError(errno.ENOSYS, "openat2 is not available here")
    path = "/".join(_components(rel)) or "."
    how = _OpenHow(
        flags | os.O_NOFOLLOW | os.O_CLOEXEC,
        mode if flags & os.O_CREAT else 0,
        _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS,
    )
    encoded = os.fsencode(path)
    for _ in range(16):
        fd = _LIBC.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(encoded),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        # EAGAIN: a rename raced the lookup (RESOLVE_BENEATH is strict about it); try again.
        if err not in (errno.EINTR, errno.EAGAIN):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def open_beneath_walk(dir_fd: int, rel: str | PurePath, flags: int, mode: int = 0o644) -> int:
    """``open_beneath`` without openat2: one ``O_NOFOLLOW`` open per component, each relative
    to the descriptor of the one before, so no component can be a symlink (ELOOP)."""
    parts = _components(rel) or (".",)
    fd = dir_fd
    try:
        for part in parts[:-1]:
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except NotADirectoryError:
                if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), part) from None
                raise
            if fd != dir_fd:
                os.close(fd)
            fd = sub
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_beneath(root: Path | int, rel: str | PurePath, flags: int, mode: int = 0o644) -> int:
    """Open ``rel`` below ``root`` (a path the operator gave, or a directory descriptor) with
    ``flags``, refusing a symlink at every component of ``rel`` and any ``..`` (OSError,
    ELOOP or EXDEV). openat2(2) where the kernel offers it, else a descriptor walk."""
    root_fd = (
        root
        if isinstance(root, int)
        else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    )
    try:
        if _Openat2.works:
            try:
                return open_beneath_openat2(root_fd, rel, flags, mode)
            except OSError as exc:
                # ENOSYS: an old kernel; EPERM: a seccomp filter that predates openat2.
                if exc.errno not in (errno.ENOSYS, errno.EPERM):
                    raise
                _Openat2.works = False
        return open_beneath_walk(root_fd, rel, flags, mode)
    finally:
        if root_fd is not root:
            os.close(root_fd)


def open_dir_beneath(root: Path | int, rel: str | PurePath) -> int:
    """A directory descriptor of ``rel`` below ``root``, reached through no symlink."""
    return open_beneath(root, rel, os.O_RDONLY | os.O_DIRECTORY)


def open_file_beneath(root: Path | int, rel: str | PurePath) -> int:
    """A read descriptor of a regular file ``rel`` below ``root``, reached through no symlink;
    a FIFO or device is refused without blocking on it."""
    fd = open_beneath(root, rel, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _require_regular(fd, str(rel))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


# --- contract files a pod can replace ----------------------------------------------------------


_KINDS = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


class NotRegularFile(OSError):
    """A name that must be a regular file is something else (a pod's symlink or FIFO)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{path} is {kind}, not a regular file")
        self.kind = kind


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _require_regular(fd: int, name: str) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(name, _kind(mode))


def read_regular(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of a file a pod writes, only if it is a regular file.

    ``O_NOFOLLOW`` refuses a symlink (it could name any file the daemon can read) and
    ``O_NONBLOCK`` a FIFO (opening one would wait for a writer forever): both raise
    ``NotRegularFile``. ``FileNotFoundError`` when there is no such name.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(str(path), "a symlink") from None
        raise
    try:
        _require_regular(fd, str(path))
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def lkind(path: Path) -> str | None:
    """What ``path`` is, without following it (``"a symlink"``, ...); None when missing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)


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
        # O_EXCL | O_NOFOLLOW: the temp name is ours alone, never a planted link.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as f:
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
    """Append one line with a single write, so concurrent readers see whole lines.

    ``path`` is a name in CHECKPOINT_DIR that pods may replace: a symlink there is never
    followed (the line would land in whatever file it names) and a FIFO never blocks; such
    a name is replaced, atomically, by a regular file holding the line.
    """
    data = (line.rstrip("\n") + "\n").encode()
    for _ in range(_APPEND_TRIES):
        if _append_once(path, data):
            return
    atomic_write_bytes(path, data)


_APPEND_TRIES = 3
"""A reader claims the file by renaming it away, reads it, deletes it; a line written to the
claimed file after that read is lost, so it is written again (at worst twice) to a new one."""


def _append_once(path: Path, data: bytes) -> bool:
    """True: ``data`` was appended to the file that is still at ``path``."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        # ELOOP: a symlink; ENXIO: a FIFO nobody reads; EISDIR and the like fail below too.
        if exc.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        atomic_write_bytes(path, data)
        return True
    try:
        written = os.fstat(fd)
        if not stat.S_ISREG(written.st_mode):
            atomic_write_bytes(path, data)
            return True
        os.write(fd, data)
    finally:
        os.close(fd)
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (written.st_dev, written.st_ino)


def remove_tree(path: Path) -> None:
    """Remove a file, symlink or directory tree; a missing path is fine."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` in one step (renameat2 RENAME_EXCHANGE): whoever looks
    sees one or the other at each name, never neither. OSError (ENOSYS, EINVAL) where the
    kernel or filesystem cannot."""
    if _LIBC is None or not hasattr(_LIBC, "renameat2"):
        raise OSError(errno.ENOSYS, "renameat2 is not available here")
    at_fdcwd = -100
    if _LIBC.renameat2(
        ctypes.c_int(at_fdcwd),
        ctypes.c_char_p(os.fsencode(a)),
        ctypes.c_int(at_fdcwd),
        ctypes.c_char_p(os.fsencode(b)),
        ctypes.c_uint(_RENAME_EXCHANGE),
    ):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a))


def replace_tree(src: Path, final: Path, trash: Path, *, swap: bool) -> None:
    """``src`` put at ``final``, where a tree may be. With ``swap`` the two are exchanged in
    one step and the old one discarded from ``src``, so a kill leaves one or the other;
    without (or where the kernel cannot), the old one goes first, then the rename."""
    if swap and final.exists():
        try:
            exchange(src, final)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
        else:
            discard_tree(src, trash)
            return
    if final.exists():
        discard_tree(final, trash)
    os.rename(src, final)


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
