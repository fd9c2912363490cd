"""Publish CHECKPOINT_DIR into pods and take it back: the Node service's logic.

A pod's volume is the RAM disk's CHECKPOINT_DIR subdirectory, never the RAM disk itself:
the daemon's store and ``owner.json`` live beside it. ``decide_publish``,
``published_targets`` and ``check_target`` are pure: they read the mount table and say what
to do; ``mtc_replicator.csi.owner`` decides who may have the directory. ``NodeVolumes`` acts through
a ``Mounter`` and the filesystem, one call per target path at a time. Its state is the mount
table (which targets are published) and ``owner.json`` (whose they are), so a restarted
plugin answers repeated calls exactly like the one that made the mounts.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath

from mtc_replicator.csi.checkpoint import DEFAULT_SUBDIR, CheckpointDir
from mtc_replicator.csi.errors import (
    InvalidRequest,
    MountDenied,
    MountError,
    OperationPending,
    OwnerBusy,
    PublishConflict,
    RamDiskMissing,
    TargetCleanupError,
)
from mtc_replicator.csi.mounter import Mounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at
from mtc_replicator.csi.owner import OwnerDecision, decide_owner
from mtc_replicator.csi.tenancy import OPEN_POLICY, MountPolicy
from mtc_replicator.csi.validation import Publish, Unpublish

log = logging.getLogger(__name__)

MAX_STACKED_MOUNTS = 16
"""Unpublish peels mounts stacked on a target (left by a crash mid-publish) up to this many."""
OWNER_LOCK_SECONDS = 60.0
"""How long a publish waits for another one's owner decision (emptying a big directory)
before it answers "retry"; kubelet gives a call 2 minutes."""


class Decision(enum.Enum):
    MOUNT = "mount"
    ALREADY_PUBLISHED = "already published"


def _mode(readonly: bool) -> str:
    return "read-only" if readonly else "read-write"


def resolved_target(target: Path) -> Path:
    """``target`` with symlinks in its parents resolved: the path the kernel lists a mount at
    it under, and the one ``check_target`` must judge. The last component stays as sent."""
    return Path(os.path.realpath(target.parent)) / target.name


def check_target(target: Path, ram_dir: Path) -> None:
    """A target must never be the RAM disk, inside it, or above it: unpublishing such a path
    would unmount or hide every checkpoint on the node."""
    if target == ram_dir or ram_dir in target.parents or target in ram_dir.parents:
        raise InvalidRequest(f"target_path {target} overlaps the RAM disk at {ram_dir}")


def ram_disk(mounts: Sequence[MountInfo], ram_dir: Path) -> MountInfo:
    ram = mount_at(mounts, str(ram_dir))
    if ram is None or ram.fs_type != "tmpfs":
        raise RamDiskMissing(f"the RAM disk at {ram_dir} is not mounted; restart the plugin")
    return ram


def decide_publish(
    mounts: Sequence[MountInfo],
    ram_dir: Path,
    target: Path,
    readonly: bool,
    subdir: str = DEFAULT_SUBDIR,
) -> Decision:
    """Whether ``target`` needs a bind of CHECKPOINT_DIR, or already has the one asked for."""
    ram = ram_disk(mounts, ram_dir)
    existing = mount_at(mounts, str(target))
    if existing is None:
        return Decision.MOUNT
    # A bind of a subdirectory shows that directory as its root (mountinfo's 4th field).
    if existing.device != ram.device or existing.root != str(PurePosixPath(ram.root) / subdir):
        raise PublishConflict(
            f"{target} is already a mount of {existing.fs_type} {existing.source} "
            f"{existing.root}, not of the checkpoint directory"
        )
    if existing.readonly != readonly:
        raise PublishConflict(
            f"{target} is already published {_mode(existing.readonly)}, asked for {_mode(readonly)}"
        )
    return Decision.ALREADY_PUBLISHED


def published_targets(mounts: Sequence[MountInfo], ram_dir: Path) -> list[MountInfo]:
    """Every pod target that shows the RAM disk: any mount of its filesystem but the RAM
    disk itself (binds of its root from older plugins count: whose they are is unknown)."""
    ram = ram_disk(mounts, ram_dir)
    return [
        m
        for m in mounts
        if m.device == ram.device
        and m.mount_point != str(ram_dir)
        and not Path(m.mount_point).is_relative_to(ram_dir)
    ]


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
    """Bind mounts of CHECKPOINT_DIR (``ram_dir/subdir``) onto the targets kubelet names."""

    def __init__(
        self,
        mounter: Mounter,
        ram_dir: Path,
        *,
        locks: TargetLocks | None = None,
        subdir: str = DEFAULT_SUBDIR,
        clock: Callable[[], float] = time.time,
        policy: MountPolicy | None = None,
        group: int | None = None,
    ) -> None:
        self.mounter = mounter
        self.ram_dir = ram_dir
        self.locks = locks or TargetLocks()
        self.checkpoint = CheckpointDir(ram_dir, subdir, group)
        self.policy = policy or OPEN_POLICY
        """Who may mount; open (any namespace) unless configured."""
        self.clock = clock
        self._owner_lock = threading.Lock()
        """One owner decision at a time, across all targets, from reading the mount table
        to the bind: two namespaces must never both see "nothing published"."""

    def ram_disk_mounted(self) -> bool:
        ram = mount_at(self.mounter.mounts(), str(self.ram_dir))
        return ram is not None and ram.fs_type == "tmpfs"

    def publish(self, request: Publish) -> bool:
        """Make CHECKPOINT_DIR appear at the target; False when it already did (idempotent).

        A pod of another namespace than the owner's waits (``OwnerBusy``) while any target
        is published; once none is, it gets the directory emptied. A pod the policy does
        not allow is refused (``MountDenied``) before anything is created or mounted."""
        try:
            self.policy.check(request.pod)
        except MountDenied:
            pod = request.pod
            log.warning(
                "refused publish for pod %s/%s (service account %s): not in the allow-list",
                pod.namespace,
                pod.pod,
                pod.service_account,
            )
            raise
        target = resolved_target(request.target)
        check_target(target, self.ram_dir)
        with self.locks.hold(target), self._owner_decision():
            mounts = self.mounter.mounts()
            decision = decide_publish(
                mounts, self.ram_dir, target, request.readonly, self.checkpoint.name
            )
            if decision is Decision.ALREADY_PUBLISHED:
                return False
            self._take(request, len(published_targets(mounts, self.ram_dir)))
            created = _make_target(target)
            try:
                # Read-only from the start, in one step: never a writable bind first (a
                # crash would leave it), and never a remount, which does not propagate to
                # kubelet's copy of the mount (the one the pod gets).
                if request.readonly:
                    self.mounter.bind_readonly(self.checkpoint.path, target)
                else:
                    self.mounter.bind(self.checkpoint.path, target)
            except MountError:
                if created:
                    with contextlib.suppress(OSError):
                        target.rmdir()
                raise
            return True

    def _take(self, request: Publish, published: int) -> None:
        """Settle who owns CHECKPOINT_DIR before ``request``'s pod sees it, and record it."""
        pod = request.pod
        recorded = self.checkpoint.recorded_owner()
        decision = decide_owner(recorded, pod.namespace, published)
        if decision is OwnerDecision.WAIT:
            log.info(
                "publish for %s/%s waits: %d target(s) of namespace %s still published",
                pod.namespace,
                pod.pod,
                published,
                recorded or "(unknown)",
            )
            # Not naming the other namespace: this message lands in the pod's events.
            raise OwnerBusy(
                "the node's checkpoint directory is in use by a pod of another namespace; "
                "retrying until that pod's volume is unpublished"
            )
        self.checkpoint.prepare()
        if decision is OwnerDecision.TAKE_OVER:
            # Emptied before the new owner is recorded: a crash in between leaves the old
            # owner recorded, and the retry empties again.
            removed = self.checkpoint.clear()
            log.info(
                "checkpoint directory passes from namespace %s to %s: removed %d entries",
                recorded or "(unknown)",
                pod.namespace,
                removed,
            )
        else:
            self.checkpoint.drop_stale_rank_files(pod.pod_uid)
        self.checkpoint.record_owner(pod, self.clock())

    @contextlib.contextmanager
    def _owner_decision(self) -> Iterator[None]:
        if not self._owner_lock.acquire(timeout=OWNER_LOCK_SECONDS):
            raise OperationPending("another publish is still deciding who owns the directory")
        try:
            yield
        finally:
            self._owner_lock.release()

    def unpublish(self, request: Unpublish) -> bool:
        """Unmount the target and remove its directory; False when there was nothing to undo."""
        target = resolved_target(request.target)
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
