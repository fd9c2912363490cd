"""Wait until no save of our client is in flight in CHECKPOINT_DIR: a pod's preStop hook.

Where the trainer is not the process Kubernetes signals (a Ray worker under ``ray start``,
a launcher that kills its children), ``AsyncSaver.finish_on_sigterm`` never runs: the
save in flight dies with the process. Kubernetes runs a container's preStop hook before it
sends SIGTERM, with training still going, so the hook can wait for the step being written
to be published (renamed into place, where the daemon takes it) and then let the
termination go on::

    lifecycle:
      preStop:
        exec:
          command: [python, -m, mtc_replicator.client.wait_saves, --timeout, "20"]

A save in flight is a temporary of our client (``step=<N>-unfinished/`` or a
``*.save.tmp`` file, ``core.contract.is_client_temp_name``); the wait ends once none has
been seen for two polls in a row (a save that starts meanwhile is waited for too).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from mtc_replicator.core.contract import JOB_DIRS, is_client_temp_name

CHECKPOINT_DIR_VARIABLES = ("MTC_CHECKPOINT_DIR", "CHECKPOINT_DIR")
"""Where the directory comes from when ``--dir`` is not given (our examples set the first)."""
DEFAULT_TIMEOUT = 20.0
"""Seconds: within Kubernetes' default 30 s grace period, which the preStop hook shares."""


def saves_in_flight(directory: Path) -> list[str]:
    """The names of our client's temporaries in ``directory`` and in its job directories
    (``jobs/<job>/``, as ``jobs/<job>/<name>``; links are not followed), sorted."""
    found = _temporaries(directory, "")
    jobs = directory / JOB_DIRS
    if jobs.is_dir() and not jobs.is_symlink():
        try:
            with os.scandir(jobs) as entries:
                job_dirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            job_dirs = []
        for job in job_dirs:
            found += _temporaries(jobs / job, f"{JOB_DIRS}/{job}/")
    return sorted(found)


def _temporaries(directory: Path, prefix: str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return [
                prefix + e.name
                for e in entries
                if is_client_temp_name(e.name, is_dir=e.is_dir(follow_symlinks=False))
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []


def wait_for_saves(
    directory: Path,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """Wait until no save is in flight in ``directory`` for two polls in a row, or
    ``timeout`` seconds; the saves still in flight ([] when none)."""
    deadline = clock() + timeout
    quiet = 0
    while True:
        pending = saves_in_flight(directory)
        quiet = 0 if pending else quiet + 1
        if quiet >= 2 or clock() >= deadline:
            return pending
        sleep(poll)


def main(argv: Sequence[str] | None = None) -> int:
    """0: nothing in flight; 1: saves still in flight at the timeout; 2: usage."""
    p = argparse.ArgumentParser(
        prog="python -m mtc_replicator.client.wait_saves",
        description="Wait until no save of this pod's trainer is in flight in CHECKPOINT_DIR "
        "(for a preStop hook).",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=next((os.environ[v] for v in CHECKPOINT_DIR_VARIABLES if os.environ.get(v)), None),
        help="the checkpoint directory (default: $MTC_CHECKPOINT_DIR, else $CHECKPOINT_DIR)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds to wait at most (default: {DEFAULT_TIMEOUT:.0f})",
    )
    args = p.parse_args(argv)
    if args.dir is None:
        p.error("--dir, MTC_CHECKPOINT_DIR or CHECKPOINT_DIR is required")
    if args.timeout < 0:
        p.error("--timeout must be 0 or more")
    started = time.monotonic()
    pending = wait_for_saves(args.dir, args.timeout)
    took = time.monotonic() - started
    if pending:
        print(f"saves still in flight after {took:.1f}s: {', '.join(pending)}", file=sys.stderr)
        return 1
    print(f"no save in flight in {args.dir} (waited {took:.1f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
