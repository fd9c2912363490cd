"""The backup and registry locations, probed from the daemon's start until each is usable:
listed, read and written (``storage.probe``; ``core.bucketcheck`` decides what a result
means). Does I/O: each probe runs in a thread of
its own, so that an unreachable bucket never holds up the daemon's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from mtc_replicator.cluster.registry import Registry
from mtc_replicator.core.bucketcheck import BucketCheck, Verdict, may_heal, refused_reason
from mtc_replicator.core.contract import FAILED_FILE, JobConfig
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStore, ObjectStoreError, is_transient
from mtc_replicator.storage.probe import ProbeFailed
from mtc_replicator.storage.probe import probe as probe_store

log = logging.getLogger(__name__)
T = TypeVar("T")

FIRST_PROBE_WAIT = 10.0
"""How long a handshake waits for the first probe of the backup and registry."""


class BucketProbes:
    """Probes of the locations a job needs; a refused one refuses the job's handshake."""

    def __init__(self, backups: BackupStore | None, registry: Registry | None) -> None:
        self.checks = _bucket_checks(backups, registry)
        """The backup and registry locations, probed at start and until usable."""
        self.probed = asyncio.Event()
        """Set once each location was probed once."""

    async def run(self) -> None:
        """Probe each location until it is usable: an unreachable one with backoff, a
        refused one every few minutes (an operator may fix the policy); log each change."""
        due = {id(check): 0.0 for check, _ in self.checks}
        while True:
            for check, store in self.checks:
                if due[id(check)] > time.monotonic():
                    continue
                was = (check.verdict, check.reason)
                try:
                    await in_daemon_thread(probe_store, store, name="mtc-bucket-probe")
                except ProbeFailed as exc:
                    reason = refused_reason(
                        check.url,
                        exc.right,
                        str(exc),
                        denied=exc.denied,
                        no_credentials=exc.no_credentials,
                    )
                    heals = may_heal(exc.right, transient=exc.transient, denied=exc.denied)
                    wait = check.record(reason, transient=heals)
                except ObjectStoreError as exc:
                    wait = check.record(str(exc), transient=is_transient(exc))
                except Exception as exc:  # an SDK error no translation knows: may heal
                    wait = check.record(f"{type(exc).__name__}: {exc}", transient=True)
                else:
                    wait = check.record(None, transient=False)
                due[id(check)] = math.inf if wait is None else time.monotonic() + wait
                _log_bucket(check, was, wait)
            self.probed.set()
            soonest = min(due.values(), default=math.inf)
            if soonest == math.inf:
                return
            await asyncio.sleep(max(soonest - time.monotonic(), 0.0))

    def refusal(self, config: JobConfig) -> str | None:
        """Why ``config``'s job cannot run here until the configuration is fixed, if a
        location it needs was refused (``core.bucketcheck``): the backup for every job, a
        separate registry for cluster jobs only."""
        needed = [c for c, _ in self.checks if c.what == "backup" or config.nodes > 1]
        return next((r for c in needed if (r := c.refusal())), None)

    async def verdict(self, config: JobConfig) -> str | None:
        """A refused location's reason, after the first probe of each (a handshake that
        arrives during start-up waits for it, at most ``FIRST_PROBE_WAIT`` seconds)."""
        if self.checks and not self.probed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.probed.wait(), FIRST_PROBE_WAIT)
        return self.refusal(config)


def _bucket_checks(
    backups: BackupStore | None, registry: Registry | None
) -> list[tuple[BucketCheck, ObjectStore]]:
    """What to probe: the backup, and the registry when it is another location."""
    found = []
    if backups is not None:
        found.append((BucketCheck(backups.objects.url, "backup"), backups.objects))
    if registry is not None and (backups is None or registry.url != backups.objects.url):
        found.append((BucketCheck(registry.url, "registry"), registry.objects))
    return found


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "mtc-bucket") -> T:
    """``fn(*args)`` in a thread of its own that never holds up the process's exit: a call
    to an unreachable bucket may take the whole storage timeout, and the default executor
    (``asyncio.to_thread``) is joined at shutdown, so SIGTERM would wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(result)  # type: ignore[arg-type]
            else:
                done.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, not lost in the thread
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


def _log_bucket(check: BucketCheck, was: tuple[Verdict, str], wait: float | None) -> None:
    """Log a probe's outcome: usable or refused once per change (a refusal's reason too),
    each unreachable try with its wait (they back off)."""
    if check.verdict is Verdict.USABLE:
        if was[0] is not Verdict.USABLE:
            log.info(
                "%s %s: usable (listed, read and written under its prefix)",
                check.what,
                check.url,
            )
    elif check.verdict is Verdict.REFUSED:
        if was != (Verdict.REFUSED, check.reason):
            log.error(
                "%s %s refused: %s; jobs on this node get %s until it is fixed "
                "(docs/permissions.md); checking again in %.0fs",
                check.what,
                check.url,
                check.reason,
                FAILED_FILE,
                wait or 0.0,
            )
    else:
        log.warning(
            "%s %s unreachable: %s; retrying in %.1fs",
            check.what,
            check.url,
            check.reason,
            wait or 0.0,
        )
