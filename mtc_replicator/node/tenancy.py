"""The job directories one node serves: CHECKPOINT_DIR's root, and ``jobs/<job>/`` below it.
I/O (the directories, through descriptors).

The root keeps the one-job contract Orbax, MaxText and the PyTorch reference client use. A
further job on the node (a Ray Tune trial beside others) hands its ``replicator.yaml`` and
its steps to ``CHECKPOINT_DIR/jobs/<job>/``, a directory named after the job with the root's
whole file contract (docs/protocol.md, "Job directories"). Each directory has its own
``Supervisor``: its handshake, incarnation, restore round, markers and errors, over the
node's one store, peer plane, coordinators and backups. A job runs in one directory of a
node at a time.

A pod may replace ``jobs/<job>`` by a symlink at any moment, and the daemon runs as root: it
reaches a job directory only through a descriptor opened without following links, by its
``/proc/self/fd/N`` path, kept while the directory is served, so nothing it writes, moves or
removes there lands anywhere else. File events come from a watch made through that
descriptor too, so a link swapped in later redirects nothing; they are hints only (every
supervisor rescans on its own timer), so a watch that cannot be made (the daemon's one
inotify instance out of watches, ``local.watcher``) leaves the directory served at each
rescan.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.core.contract import JOB_DIRS, JobConfig
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.local.watcher import DirectoryWatcher, OnEvent
from mtc_replicator.node.agent import Incarnation
from mtc_replicator.node.supervisor import Neighbours, Supervisor

log = logging.getLogger(__name__)

MAX_JOB_DIRS = 256
"""Job directories served at once; more are left alone (said once) until some go."""

MakeSupervisor = Callable[[str, Path, Neighbours], Supervisor]
"""``(job, directory, neighbours)``: the supervisor of a job directory, reached at
``directory`` (a descriptor's path)."""
Rules = Callable[[JobConfig], tuple[str, str] | None]
"""The node's own rules for any handshake (a rank grant required): the refusal and remedy."""


def _fd_path(fd: int) -> Path:
    """The path that reaches what descriptor ``fd`` holds, whatever its name is now."""
    return Path(f"/proc/self/fd/{fd}")


@dataclass
class JobDir:
    """One ``jobs/<job>/`` served: its descriptor, supervisor and watch."""

    name: str
    fd: int
    supervisor: Supervisor
    watcher: DirectoryWatcher | None = None

    @property
    def path(self) -> Path:
        return _fd_path(self.fd)

    def watch(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Start the directory's file events; False (said) when no watch can be made."""
        assert self.watcher is not None
        try:
            self.watcher.start(loop)
        except OSError as exc:
            log.warning(
                "no file events from %s/%s (%s): its files are seen at each rescan",
                JOB_DIRS,
                self.name,
                exc,
                extra={"job": self.name},
            )
            return False
        return True


class _Beside:
    """The ``Neighbours`` of one directory (None: the root), read from the tenancy live."""

    def __init__(self, tenancy: Tenancy, name: str | None) -> None:
        self.tenancy = tenancy
        self.name = name

    def _others(self) -> list[Incarnation]:
        return [
            s.incarnation
            for key, s in self.tenancy.by_key()
            if key != self.name and s.incarnation is not None
        ]

    def refusal(self, config: JobConfig) -> tuple[str, str] | None:
        job = config.job_name
        if self.name is not None and job != self.name:
            return (
                f"the replicator.yaml in {JOB_DIRS}/{self.name}/ names job {job!r}: a job "
                "directory serves the job it is named after",
                f"Hand job {job!r}'s handshake to {JOB_DIRS}/{job}/ (or name the job "
                f"{self.name!r})",
            )
        if job in {i.config.job_name for i in self._others()}:
            where = next(k for k, s in self.tenancy.by_key() if _runs(s, job))
            place = "CHECKPOINT_DIR's root" if where is None else f"{JOB_DIRS}/{where}/"
            return (
                f"job {job!r} already runs on this node, in {place}: a job runs in one "
                "directory of a node at a time",
                "End it there first (an empty replicator.yaml, client.finish_job), or give "
                "this one another job name",
            )
        return self.tenancy.rules(config)

    def views(self) -> Collection[str]:
        return {i.id for i in self._others()}

    def jobs(self) -> Collection[str]:
        return {i.config.job_name for i in self._others()}

    async def end(self) -> None:
        for key, supervisor in self.tenancy.by_key():
            if key != self.name:
                await supervisor.end_incarnation()


def _runs(supervisor: Supervisor, job: str) -> bool:
    running = supervisor.incarnation
    return running is not None and running.config.job_name == job


class Tenancy:
    """The root's supervisor and the job directories' (``jobs/<job>/``)."""

    def __init__(self, checkpoint_dir: Path, rules: Rules) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.rules = rules
        self.root: Supervisor | None = None
        """The root's supervisor, set once built with ``beside(None)``."""
        self.dirs: dict[str, JobDir] = {}
        self._too_many_said = False

    def beside(self, name: str | None) -> Neighbours:
        """The neighbours of the root (None) or of ``jobs/<name>/``."""
        return _Beside(self, name)

    def by_key(self) -> list[tuple[str | None, Supervisor]]:
        """Every supervisor, the root's (None) first."""
        root = [] if self.root is None else [(None, self.root)]
        return [*root, *((name, d.supervisor) for name, d in sorted(self.dirs.items()))]

    def supervisors(self) -> list[Supervisor]:
        return [s for _, s in self.by_key()]

    def incarnations(self) -> list[Incarnation]:
        return [s.incarnation for s in self.supervisors() if s.incarnation is not None]

    def running_jobs(self) -> frozenset[str]:
        return frozenset(i.config.job_name for i in self.incarnations())

    def incarnation_of(self, job: str) -> Incarnation | None:
        return next((i for i in self.incarnations() if i.config.job_name == job), None)

    def next_check_in(self) -> float:
        return min(s.next_check_in() for s in self.supervisors())

    # --- the job directories ----------------------------------------------------------------

    def scan(self, make: MakeSupervisor, on_event: Callable[[JobDir], OnEvent]) -> list[JobDir]:
        """Serve every job directory found that is not served yet (each a real directory,
        named as a job may be); forget those gone that run nothing. Returns the new ones."""
        found = _job_dir_names(self.checkpoint_dir)
        if found is None:
            return []  # not listed this time: the next scan sees
        for name in self._gone(found):
            if self.dirs[name].supervisor.incarnation is None:
                self._forget(name)
        new = []
        for name in sorted(found.keys() - self.dirs.keys()):
            if len(self.dirs) >= MAX_JOB_DIRS:
                if not self._too_many_said:
                    log.warning(
                        "%d job directories are served already: %s/%s and any further one "
                        "wait until some go",
                        MAX_JOB_DIRS,
                        JOB_DIRS,
                        name,
                    )
                    self._too_many_said = True
                break
            fd = _open_job_dir(self.checkpoint_dir, name)
            if fd is None:
                continue
            job_dir = JobDir(name, fd, make(name, _fd_path(fd), self.beside(name)))
            job_dir.watcher = DirectoryWatcher(job_dir.path, on_event(job_dir))
            self.dirs[name] = job_dir
            new.append(job_dir)
            log.info("serving the job directory %s/%s", JOB_DIRS, name, extra={"job": name})
        return new

    def orphans(self) -> list[tuple[str, Supervisor]]:
        """The served directories removed (or renamed away, or made again under their name)
        while their job runs: nobody can hand that job a step or a handshake there any
        more, and until it ends the name is not served again."""
        if all(d.supervisor.incarnation is None for d in self.dirs.values()):
            return []  # no listing: the daemon's loop asks at every wake
        found = _job_dir_names(self.checkpoint_dir)
        if found is None:
            return []
        gone = self._gone(found)
        return [
            (name, self.dirs[name].supervisor)
            for name in gone
            if self.dirs[name].supervisor.incarnation is not None
        ]

    def _gone(self, found: dict[str, tuple[int, int]]) -> list[str]:
        """The served names whose directory is no longer the one ``found`` under them: a
        directory removed and made again between two scans is another one, and the
        descriptor kept of the first reaches nothing a pod can write."""
        return [n for n, d in self.dirs.items() if found.get(n) != _identity(d.fd)]

    def _forget(self, name: str) -> None:
        self._close(self.dirs.pop(name))
        self._too_many_said = False
        log.info("the job directory %s/%s is gone", JOB_DIRS, name, extra={"job": name})

    def close(self) -> None:
        """The daemon stops: every watch and descriptor."""
        for name in list(self.dirs):
            self._close(self.dirs.pop(name))

    @staticmethod
    def _close(job_dir: JobDir) -> None:
        if job_dir.watcher is not None:
            job_dir.watcher.stop()
        os.close(job_dir.fd)


def _identity(fd: int) -> tuple[int, int] | None:
    """Which directory descriptor ``fd`` holds (device, inode)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _job_dir_names(checkpoint_dir: Path) -> dict[str, tuple[int, int]] | None:
    """The names under ``jobs/`` that are real directories named as a job may be, with
    the directory each names (device, inode); None when ``jobs/`` could not be listed for
    another reason than its absence (descriptors or memory ran out): nothing is known, and
    no served directory may pass for gone (its job would be ended)."""
    try:
        parent = os.open(checkpoint_dir / JOB_DIRS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return {}  # none (or ``jobs`` is not a real directory: nothing served from it)
        return None
    try:
        names = {}
        for name in os.listdir(parent):
            if not is_job_name(name):
                continue
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                names[name] = (st.st_dev, st.st_ino)
    except OSError:
        return None
    finally:
        os.close(parent)
    return names


def _open_job_dir(checkpoint_dir: Path, name: str) -> int | None:
    """A descriptor of ``jobs/<name>``, neither step a symlink; None when it is not one."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        parent = os.open(checkpoint_dir / JOB_DIRS, flags)
    except OSError:
        return None
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
