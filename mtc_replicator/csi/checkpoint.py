"""CHECKPOINT_DIR on the RAM disk and the owner record beside it. Does I/O.

The RAM disk holds three things: ``<subdir>/`` (CHECKPOINT_DIR, the only part pods see),
the daemon's store (a sibling it makes itself) and ``owner.json`` (ours). The RAM disk's
root is root-owned with the sticky bit, and CHECKPOINT_DIR and ``owner.json`` are owned by
the plugin: so once checked, neither the daemon's uid nor a pod can swap them for a symlink
between the check and the bind mount. Both directories belong to the configured group (the
replicator's and the training pods') and are closed to every other user of the node.

Every step works on descriptors opened with ``O_NOFOLLOW``: a symlink planted where
CHECKPOINT_DIR should be is refused, and one inside it is removed, never followed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from mtc_replicator.csi.errors import CheckpointDirError
from mtc_replicator.csi.owner import (
    RANK_FILE,
    RANK_FILES,
    PodInfo,
    owner_record,
    rank_file_pod,
    rank_files_stale,
    recorded_namespace,
    recorded_pod_uid,
)

log = logging.getLogger(__name__)

DEFAULT_SUBDIR = "checkpoint"
OWNER_FILE = "owner.json"
CHECKPOINT_MODE = 0o2770
"""Owner (the plugin, root) and the configured group (``--fs-group``: the replicator's gid,
which training pods get through their ``fsGroup`` or ``runAsGroup``) may write; nobody else
may even list it. Setgid: what the pod and the daemon create inside stays in that group."""
OWNER_MODE = 0o644
"""The daemon (another uid) reads it; only the plugin writes it."""
MAX_OWNER_BYTES = 64 * 1024


def check_subdir_name(name: str) -> str:
    """CHECKPOINT_DIR's name in the RAM disk: one plain path component, not ours."""
    if name in ("", ".", "..", OWNER_FILE) or "/" in name or "\0" in name:
        raise ValueError(f"the checkpoint subdirectory must be one plain name, got {name!r}")
    return name


class CheckpointDir:
    """``ram_dir/subdir``, the directory pods get, and ``ram_dir/owner.json``."""

    def __init__(
        self, ram_dir: Path, subdir: str = DEFAULT_SUBDIR, group: int | None = None
    ) -> None:
        self.ram_dir = ram_dir
        self.group = os.getegid() if group is None else group
        """CHECKPOINT_DIR's group: the one the daemon and the training pods share."""
        self.name = check_subdir_name(subdir)
        self.path = ram_dir / self.name
        self.owner_path = ram_dir / OWNER_FILE

    def prepare(self) -> None:
        """Make CHECKPOINT_DIR a real directory owned by us and our group, mode 2770,
        creating it when absent (or migrating an older 0777 one); refuse a symlink or
        anything else in its place."""
        try:
            self.path.mkdir(mode=CHECKPOINT_MODE)
            log.info("created the checkpoint directory %s", self.path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise CheckpointDirError(f"cannot create {self.path}: {exc}") from None
        with self._open() as fd:
            info = os.fstat(fd)
            try:
                if (info.st_uid, info.st_gid) != (os.geteuid(), self.group):
                    # Made by someone else (the daemon, an older layout): take it, so that
                    # only we can rename or replace it in the sticky RAM disk root.
                    os.fchown(fd, os.geteuid(), self.group)
                    log.warning(
                        "took ownership of %s (was uid %d gid %d, now gid %d)",
                        self.path,
                        info.st_uid,
                        info.st_gid,
                        self.group,
                    )
                # After the chown, which may clear the setgid bit.
                if stat.S_IMODE(os.fstat(fd).st_mode) != CHECKPOINT_MODE:
                    os.fchmod(fd, CHECKPOINT_MODE)
                    log.info("%s: mode set to %04o", self.path, CHECKPOINT_MODE)
            except OSError as exc:
                raise CheckpointDirError(f"cannot set up {self.path}: {exc}") from None

    def clear(self) -> int:
        """Remove everything in CHECKPOINT_DIR (symlinks unlinked, never followed); how many
        entries were removed. Entries that vanish meanwhile (the daemon takes steps away
        by rename) are fine."""
        removed = 0
        with self._open() as fd:
            try:
                names = os.listdir(fd)
                for name in names:
                    try:
                        if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                            shutil.rmtree(name, dir_fd=fd, onerror=_ignore_vanished)
                        else:
                            os.unlink(name, dir_fd=fd)
                    except FileNotFoundError:
                        continue
                    removed += 1
            except OSError as exc:
                raise CheckpointDirError(f"cannot empty {self.path}: {exc}") from None
        return removed

    def recorded_owner(self) -> str | None:
        """The namespace ``owner.json`` names; None when there is none we can trust."""
        data = self._owner_bytes()
        if data is None:
            return None
        namespace = recorded_namespace(data)
        if namespace is None:
            log.warning("ignoring %s: not an owner record", self.owner_path)
        return namespace

    def _owner_bytes(self, quiet: bool = False) -> bytes | None:
        try:
            fd = os.open(self.owner_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if not quiet:
                log.warning("ignoring %s: %s", self.owner_path, exc)
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                if not quiet:
                    log.warning("ignoring %s: not a regular file of ours", self.owner_path)
                return None
            data = os.read(fd, MAX_OWNER_BYTES + 1)
        finally:
            os.close(fd)
        return data if len(data) <= MAX_OWNER_BYTES else None

    def drop_stale_rank_files(self, pod_uid: str) -> list[str]:
        """Before pod ``pod_uid`` sees CHECKPOINT_DIR: remove a rank assigned to another pod
        (``jax-init-info.txt``, ``mtc-rank.json``; ``owner.rank_files_stale``), so that it
        never starts from a previous pod's rank. The names removed."""
        owner = self._owner_bytes(quiet=True)
        removed: list[str] = []
        with self._open() as fd:
            written_for = rank_file_pod(_read_quietly(fd, RANK_FILE))
            owner_uid = recorded_pod_uid(owner) if owner is not None else None
            if not rank_files_stale(written_for, owner_uid, pod_uid):
                return removed
            for name in RANK_FILES:
                try:
                    os.unlink(name, dir_fd=fd)  # never follows: a pod's symlink goes itself
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise CheckpointDirError(f"cannot remove {self.path / name}: {exc}") from None
                removed.append(name)
        if removed:
            log.info(
                "removed %s from %s: written for pod %s, not %s",
                ", ".join(removed),
                self.path,
                written_for or owner_uid or "(unknown)",
                pod_uid,
            )
        return removed

    def record_owner(self, pod: PodInfo, published_at: float) -> None:
        """Write ``owner.json`` by temp + rename: the daemon never reads half a record."""
        try:
            fd, temp = tempfile.mkstemp(prefix=".owner.json.", suffix=".tmp", dir=self.ram_dir)
        except OSError as exc:
            raise CheckpointDirError(f"cannot write {self.owner_path}: {exc}") from None
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), OWNER_MODE)
                f.write(owner_record(pod, published_at))
            os.replace(temp, self.owner_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise CheckpointDirError(f"cannot write {self.owner_path}: {exc}") from None

    @contextlib.contextmanager
    def _open(self) -> Iterator[int]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP or self.path.is_symlink():
                raise CheckpointDirError(
                    f"{self.path} is a symlink; refusing to publish it "
                    "(remove it: the plugin creates the directory)"
                ) from None
            raise CheckpointDirError(f"cannot open {self.path}: {exc}") from None
        try:
            yield fd
        finally:
            os.close(fd)


def _read_quietly(dir_fd: int, name: str, limit: int = 4096) -> bytes:
    """A small regular file in the directory, or b"" (missing, a symlink, a FIFO...)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return b""
    try:
        return os.read(fd, limit + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def _ignore_vanished(function: Callable[..., Any], path: str, exc_info: Any) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]
