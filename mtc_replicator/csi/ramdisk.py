"""The node's RAM disk: a size-limited tmpfs at a host path, mounted once and then reused.

``plan_ram_disk`` decides from the mount table alone (pure); ``ensure_ram_disk`` acts through
a ``Mounter``. An existing tmpfs at the path is kept, files and all, so checkpoints survive a
plugin restart or upgrade. When its size limit differs from the configured one we resize it
in place (``remount,size=``): growing always works and keeps the files; shrinking below what
is in use fails, and then we keep the mount as it is and say so in the log.
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.csi.errors import MountError, RamDiskError
from mtc_replicator.csi.mounter import Mounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at, tmpfs_size
from mtc_replicator.csi.quantity import format_size

log = logging.getLogger(__name__)

RAM_DISK_MODE = 0o1770
"""Pods never see the root (they get its CHECKPOINT_DIR subdirectory); the daemon, another
uid in the RAM disk's group (``--fs-group``), creates its store here, and no other user of
the node may enter. The sticky bit keeps the daemon from renaming or replacing what the
plugin owns here: CHECKPOINT_DIR and ``owner.json``."""


class Action(enum.Enum):
    MOUNT = "mount"
    REUSE = "reuse"
    RESIZE = "resize"


@dataclass(frozen=True)
class RamDiskPlan:
    action: Action
    current_bytes: int | None = None
    """The existing tmpfs's limit (REUSE, RESIZE); None when it shows none."""


def page_rounded(size_bytes: int, page_size: int = mmap.PAGESIZE) -> int:
    """The limit the kernel actually sets for ``size=size_bytes``."""
    return -(-size_bytes // page_size) * page_size


def plan_ram_disk(
    mounts: Sequence[MountInfo], path: Path, size_bytes: int, page_size: int = mmap.PAGESIZE
) -> RamDiskPlan:
    """What to do so that a tmpfs of ``size_bytes`` is mounted at ``path``."""
    existing = mount_at(mounts, str(path))
    if existing is None:
        return RamDiskPlan(Action.MOUNT)
    if existing.fs_type != "tmpfs":
        raise RamDiskError(
            f"{path} is already a {existing.fs_type} mount of {existing.source}, not a tmpfs: "
            "refusing to hide it; unmount it or choose another --ram-dir"
        )
    current = tmpfs_size(existing)
    if current == page_rounded(size_bytes, page_size):
        return RamDiskPlan(Action.REUSE, current)
    return RamDiskPlan(Action.RESIZE, current)


def ensure_ram_disk(
    mounter: Mounter, path: Path, size_bytes: int, group: int | None = None
) -> MountInfo:
    """Mount (or reuse, or resize) the RAM disk at ``path``, root ours and ``group``'s (None:
    our own group); the mount it ends up with."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RamDiskError(f"cannot create the RAM disk directory {path}: {exc}") from None
    try:
        plan = plan_ram_disk(mounter.mounts(), path, size_bytes)
        wanted = format_size(size_bytes)
        current = "unlimited" if plan.current_bytes is None else format_size(plan.current_bytes)
        if plan.action is Action.MOUNT:
            mounter.mount_tmpfs(path, size_bytes, RAM_DISK_MODE)
            log.info("RAM disk mounted: %s (tmpfs, %s)", path, wanted)
        elif plan.action is Action.REUSE:
            log.info("RAM disk reused: %s (tmpfs, %s), its files kept", path, current)
        else:
            try:
                mounter.resize_tmpfs(path, size_bytes)
                log.info("RAM disk reused and resized: %s from %s to %s", path, current, wanted)
            except MountError as exc:
                log.warning(
                    "RAM disk reused at its old size: %s is %s, configured %s; "
                    "resizing failed (%s)",
                    path,
                    current,
                    wanted,
                    exc,
                )
    except MountError as exc:
        raise RamDiskError(f"cannot set up the RAM disk at {path}: {exc}") from None
    mounted = mount_at(mounter.mounts(), str(path))
    if mounted is None or mounted.fs_type != "tmpfs":
        raise RamDiskError(f"the RAM disk at {path} is not mounted after setting it up")
    _set_root_mode(path, os.getegid() if group is None else group)
    return mounted


def _set_root_mode(path: Path, group: int) -> None:
    """A RAM disk mounted by an older plugin (mode 0777 or 1777, our group) gets ours."""
    try:
        info = path.stat()
        if (info.st_uid, info.st_gid) != (os.geteuid(), group):
            os.chown(path, os.geteuid(), group)
            log.info("RAM disk %s: group set to %d", path, group)
        # After the chown: it may clear mode bits.
        if stat.S_IMODE(path.stat().st_mode) != RAM_DISK_MODE:
            os.chmod(path, RAM_DISK_MODE)
            log.info("RAM disk %s: mode set to %04o", path, RAM_DISK_MODE)
    except OSError as exc:
        raise RamDiskError(f"cannot set the mode of the RAM disk at {path}: {exc}") from None
