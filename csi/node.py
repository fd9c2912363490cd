"""Publish the RAM disk into pods and take it back: the Node service's logic.

``decide_publish`` and ``check_target`` are pure: they read the mount table and say what to
do. ``NodeVolumes`` acts through a ``Mounter`` and the filesystem, one call per target path at
a time. It keeps no state of its own: the mount table is the truth, so a restarted plugin
answers repeated calls exactly like the one that made the mounts.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from csi.errors import (
    InvalidRequest,
    MountError,
    OperationPending,
    PublishConflict,
    RamDiskMissing,
    TargetCleanupError,
)
from csi.mounter import Mounter
from csi.mountinfo import MountInfo, mount_at
from csi.validation import Publish, Unpublish

log = logging.getLogger(__name__)

MAX_STACKED_MOUNTS = 16
"""Unpublish peels mounts stacked on a target (left by a crash mid-publish) up to this many."""


class Decision(enum.Enum):
    MOUNT = "mount"
    ALREADY_PUBLISHED = "already published"


def _mode(readonly: bool) -> str:
    return "read-only" if readonly else "read-write"


def check_target(target: Path, ram_dir: Path) -> None:
    """A target must never be the RAM disk, inside it, or above it: unpublishing such a path
    would unmount or hide every checkpoint on the node."""
    if target == ram_dir or ram_dir in target.parents or target in ram_dir.parents:
        raise InvalidRequest(f"target_path {target} overlaps the RAM disk at {ram_dir}")


def decide_publish(
    mounts: Sequence[MountInfo], ram_dir: Path, target: Path, readonly: bool
) -> Decision:
    """Whether ``target`` needs a bind of the RAM disk, or already has the one asked for."""
    ram = mount_at(mounts, str(ram_dir))
    if ram is None or ram.fs_type != "tmpfs":
        raise RamDiskMissing(f"the RAM disk at {ram_dir} is not mounted; restart the plugin")
    existing = mount_at(mounts, str(target))
    if existing is None:
        return Decision.MOUNT
    if existing.device != ram.device or existing.root != ram.root:
        raise PublishConflict(
            f"{target} is already a mount of {existing.fs_type} {existing.source}, "
            "not of the RAM disk"
        )
    if existing.readonly != readonly:
        raise PublishConflict(
            f"{target} is already published {_mode(existing.readonly)}, asked for {_mode(readonly)}"
        )
    return Decision.ALREADY_PUBLISHED


class TargetLocks:
    """At most one call per target path; a second one fails at once instead of queueing
    (kubelet retries, and a queued duplicate would only repeat the first one's work)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[Path] = set()

    @contextlib.contextmanager
    def hold(self, target: Path) -> Iterator[None]:
        with self._lock:
            if target in self._busy:
                raise OperationPending(f"an operation on {target} is already in progress")
            self._busy.add(target)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(target)


class NodeVolumes:
    """Bind mounts of the RAM disk at ``ram_dir`` onto the targets kubelet names."""

    def __init__(self, mounter: Mounter, ram_dir: Path, locks: TargetLocks | None = None) -> None:
        self.mounter = mounter
        self.ram_dir = ram_dir
        self.locks = locks or TargetLocks()

    def ram_disk_mounted(self) -> bool:
        ram = mount_at(self.mounter.mounts(), str(self.ram_dir))
        return ram is not None and ram.fs_type == "tmpfs"

    def publish(self, request: Publish) -> bool:
        """Make the RAM disk appear at the target; False when it already did (idempotent)."""
        target = request.target
        check_target(target, self.ram_dir)
        with self.locks.hold(target):
            decision = decide_publish(self.mounter.mounts(), self.ram_dir, target, request.readonly)
            if decision is Decision.ALREADY_PUBLISHED:
                return False
            created = _make_target(target)
            bound = False
            try:
                self.mounter.bind(self.ram_dir, target)
                bound = True
                if request.readonly:
                    self.mounter.remount_readonly(target)
            except MountError:
                # Never leave a half-done publish behind: a writable bind where a read-only
                # one was asked for would be worse than none.
                if bound:
                    self._unmount_quietly(target)
                if created:
                    with contextlib.suppress(OSError):
                        target.rmdir()
                raise
            return True

    def unpublish(self, request: Unpublish) -> bool:
        """Unmount the target and remove its directory; False when there was nothing to undo."""
        target = request.target
        check_target(target, self.ram_dir)
        with self.locks.hold(target):
            unmounted = 0
            while mount_at(self.mounter.mounts(), str(target)) is not None:
                if unmounted == MAX_STACKED_MOUNTS:
                    raise MountError(f"{target} is still mounted after {unmounted} unmounts")
                self.mounter.unmount(target)
                unmounted += 1
            try:
                target.rmdir()
            except FileNotFoundError:
                return unmounted > 0
            except OSError as exc:
                raise TargetCleanupError(f"cannot remove {target}: {exc}") from None
            return True

    def _unmount_quietly(self, target: Path) -> None:
        try:
            self.mounter.unmount(target)
        except MountError as exc:
            log.error("could not undo the bind mount at %s: %s", target, exc)


def _make_target(target: Path) -> bool:
    """Create the target directory (its parent is kubelet's); True when we created it."""
    try:
        target.mkdir(mode=0o750)
    except FileExistsError:
        if not target.is_dir():
            raise PublishConflict(f"{target} exists and is not a directory") from None
        return False
    except OSError as exc:
        raise TargetCleanupError(f"cannot create {target}: {exc}") from None
    return True
