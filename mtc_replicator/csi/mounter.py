"""The one interface to mounts, with the real implementation and an in-memory one.

``SystemMounter`` does I/O: it runs util-linux ``mount``/``umount`` with argument lists
(never a shell) and reads ``/proc/self/mountinfo``. ``MemoryMounter`` keeps the same mount
table in memory with the kernel's semantics that matter to us (bind mounts share the device,
stacked mounts, read-only binds), so the plugin's logic is tested without root.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from mtc_replicator.csi.errors import MountError
from mtc_replicator.csi.mountinfo import MountInfo, mount_at, parse_mountinfo

log = logging.getLogger(__name__)

RAM_DISK_SOURCE = "mtc-ramdisk"
"""The tmpfs's source name: what ``df`` and mountinfo show for our RAM disk."""


class Mounter(Protocol):
    """Mount operations on absolute paths; each raises ``MountError`` when it fails."""

    def mounts(self) -> list[MountInfo]:
        """The mount table now."""
        ...

    def mount_tmpfs(self, target: Path, size_bytes: int, mode: int) -> None: ...

    def resize_tmpfs(self, target: Path, size_bytes: int) -> None:
        """Change a mounted tmpfs's size limit in place; its files stay."""
        ...

    def bind(self, source: Path, target: Path) -> None: ...

    def bind_readonly(self, source: Path, target: Path) -> None:
        """A bind mount that is read-only from the moment it appears at ``target``, so the
        copies mount propagation makes (kubelet's, with Bidirectional) are read-only too."""
        ...

    def unmount(self, target: Path) -> None:
        """Unmount the topmost mount at ``target``."""
        ...


class SystemMounter:
    """The host's mounts, through util-linux. Needs CAP_SYS_ADMIN in the host's namespace."""

    def __init__(
        self,
        mountinfo: Path = Path("/proc/self/mountinfo"),
        timeout: float = 60.0,
    ) -> None:
        self.mountinfo = mountinfo
        self.timeout = timeout
        """A mount of a local tmpfs takes milliseconds; kubelet gives a call 2 minutes."""

    def mounts(self) -> list[MountInfo]:
        # surrogateescape (fsdecode's choice): non-UTF-8 path bytes round-trip to os calls.
        return parse_mountinfo(self.mountinfo.read_bytes().decode("utf-8", "surrogateescape"))

    def mount_tmpfs(self, target: Path, size_bytes: int, mode: int) -> None:
        options = f"size={size_bytes},mode={mode:04o}"
        self._run(["mount", "-t", "tmpfs", "-o", options, RAM_DISK_SOURCE, _arg(target)])

    def resize_tmpfs(self, target: Path, size_bytes: int) -> None:
        self._run(["mount", "-o", f"remount,size={size_bytes}", _arg(target)])

    def bind(self, source: Path, target: Path) -> None:
        self._run(["mount", "--bind", _arg(source), _arg(target)])

    def bind_readonly(self, source: Path, target: Path) -> None:
        # Not bind + remount,ro: a remount changes one mount's flags and never propagates,
        # so the copy in kubelet's namespace (the one the pod gets) would stay writable.
        # The new mount API clones the tree detached, makes it read-only, then attaches it.
        _bind_readonly_detached(_arg(source), _arg(target))
        log.debug("bound %s read-only at %s", source, target)

    def unmount(self, target: Path) -> None:
        self._run(["umount", _arg(target)])

    def _run(self, args: Sequence[str]) -> None:
        try:
            proc = subprocess.run(
                list(args), capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise MountError(f"{' '.join(args)}: {exc}") from None
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip() or f"exit code {proc.returncode}"
            raise MountError(f"{' '.join(args)}: {detail}")
        log.debug("ran %s", " ".join(args))


_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
"""The same numbers on every architecture but alpha (the new mount API, Linux 5.12+)."""
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 1
_MOUNT_ATTR_RDONLY = 0x1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _bind_readonly_detached(source: str, target: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def check(result: int, what: str) -> int:
        if result < 0:
            code = ctypes.get_errno()
            hint = " (needs Linux 5.12 or later)" if code == errno.ENOSYS else ""
            raise MountError(f"{what}: {os.strerror(code)}{hint}")
        return result

    fd = check(
        libc.syscall(
            _SYS_OPEN_TREE,
            ctypes.c_int(_AT_FDCWD),
            os.fsencode(source),
            ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC),
        ),
        f"open_tree {source}",
    )
    try:
        attr = _MountAttr(attr_set=_MOUNT_ATTR_RDONLY)
        check(
            libc.syscall(
                _SYS_MOUNT_SETATTR,
                ctypes.c_int(fd),
                b"",
                ctypes.c_uint(_AT_EMPTY_PATH),
                ctypes.byref(attr),
                ctypes.c_size_t(ctypes.sizeof(attr)),
            ),
            f"mount_setattr {source} read-only",
        )
        check(
            libc.syscall(
                _SYS_MOVE_MOUNT,
                ctypes.c_int(fd),
                b"",
                ctypes.c_int(_AT_FDCWD),
                os.fsencode(target),
                ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
            ),
            f"move_mount {source} onto {target}",
        )
    finally:
        os.close(fd)  # a tree never attached is freed here


def _arg(path: Path) -> str:
    """An absolute path can never be taken for an option by mount(8)."""
    if not path.is_absolute():
        raise MountError(f"refusing a relative path: {path}")
    return str(path)


class MemoryMounter:
    """A mount table in memory, for tests of everything above the mount syscalls.

    ``before(operation, target)`` runs at the start of every mutating call: tests use it to
    hold a call in flight or to make one fail. The table starts with a root filesystem.
    """

    def __init__(self, before: Callable[[str, Path], None] | None = None) -> None:
        self.before = before
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._next_id = 2
        self._next_device = 100
        self._table: list[MountInfo] = [
            MountInfo(1, 0, "8:1", "/", "/", frozenset({"rw"}), "ext4", "/dev/sda1", ("rw",))
        ]

    def mounts(self) -> list[MountInfo]:
        with self._lock:
            return list(self._table)

    def mount_tmpfs(self, target: Path, size_bytes: int, mode: int) -> None:
        self._enter("mount_tmpfs", target)
        with self._lock:
            device = f"0:{self._next_device}"
            self._next_device += 1
            super_options = ("rw", _size_option(size_bytes), f"mode={mode:o}")
            self._add(
                target,
                device=device,
                root="/",
                fs_type="tmpfs",
                source=RAM_DISK_SOURCE,
                super_options=super_options,
            )

    def resize_tmpfs(self, target: Path, size_bytes: int) -> None:
        self._enter("resize_tmpfs", target)
        with self._lock:
            top = self._top(target)
            if top.fs_type != "tmpfs":
                raise MountError(f"{target}: not a tmpfs")
            size = _size_option(size_bytes)
            resized = tuple(size if o.startswith("size=") else o for o in top.super_options)
            self._table = [
                replace(m, super_options=resized) if m.device == top.device else m
                for m in self._table
            ]

    def bind(self, source: Path, target: Path) -> None:
        self._enter("bind", target)
        self._bind(source, target, frozenset({"rw"}))

    def bind_readonly(self, source: Path, target: Path) -> None:
        self._enter("bind_readonly", target)
        self._bind(source, target, frozenset({"ro"}))

    def _bind(self, source: Path, target: Path, options: frozenset[str]) -> None:
        with self._lock:
            holder = self._holder(source)
            rel = source.relative_to(holder.mount_point).as_posix()
            root = holder.root if rel == "." else str(Path(holder.root) / rel)
            self._add(
                target,
                device=holder.device,
                root=root,
                fs_type=holder.fs_type,
                source=holder.source,
                super_options=holder.super_options,
                options=options,
            )

    def unmount(self, target: Path) -> None:
        self._enter("unmount", target)
        with self._lock:
            top = self._top(target)
            if any(m.parent_id == top.mount_id for m in self._table):
                raise MountError(f"umount {target}: target is busy")
            self._table.remove(top)

    # --- helpers -----------------------------------------------------------------------------

    def _enter(self, operation: str, target: Path) -> None:
        self.calls.append((operation, str(target)))
        if self.before is not None:
            self.before(operation, target)

    def _holder(self, path: Path) -> MountInfo:
        """The visible mount that ``path`` lies on (a new mount at ``path`` stacks on it)."""
        points = {
            Path(m.mount_point)
            for m in self._table
            if path == Path(m.mount_point) or Path(m.mount_point) in path.parents
        }
        top = mount_at(self._table, str(max(points, key=lambda p: len(p.parts))))
        assert top is not None
        return top

    def _top(self, target: Path) -> MountInfo:
        top = mount_at(self._table, str(target))
        if top is None:
            raise MountError(f"{target}: not mounted")
        return top

    def _add(
        self,
        target: Path,
        *,
        device: str,
        root: str,
        fs_type: str,
        source: str,
        super_options: tuple[str, ...],
        options: frozenset[str] = frozenset({"rw"}),
    ) -> None:
        parent = self._holder(target)
        entry = MountInfo(
            mount_id=self._next_id,
            parent_id=parent.mount_id,
            device=device,
            root=root,
            mount_point=str(target),
            options=options,
            fs_type=fs_type,
            source=source,
            super_options=super_options,
        )
        self._next_id += 1
        self._table.append(entry)


def _size_option(size_bytes: int) -> str:
    """What the kernel shows: the limit rounded up to whole 4 KiB pages, in KiB."""
    return f"size={-(-size_bytes // 4096) * 4}k"
