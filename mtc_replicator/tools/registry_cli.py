"""``mtc registry show|release``: what is registered for a job, and freeing its name.

A registry entry that is malformed, or not signed by a node, names no owner anyone can
check: no rank 0 registers over it, the job's own included (``cluster.registry``,
``BlockedName``), until an operator looks at it and releases the name here. ``release``
shows what is there first, deletes only those very bytes, and refuses a valid entry (one a
running job may own) unless ``--force``. Signatures are checked against ``--tls-ca`` as the
daemons check them. Exit codes: 0 done, 1 refused or failed, 2 bad usage. I/O through the
registry's ``ObjectStore``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from mtc_replicator.cluster.registry import (
    EntryState,
    Registry,
    inspect,
    open_registry,
    release,
)
from mtc_replicator.core import argtypes
from mtc_replicator.core.signed import OPEN, RecordTrust
from mtc_replicator.storage.objectstore import ObjectStoreError
from mtc_replicator.tools.backup_views import fail, print_json
from mtc_replicator.tools.bucket_options import add_bucket_options
from mtc_replicator.transport.signing import CaVerifier
from mtc_replicator.transport.tls import TlsError


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``registry`` and its commands on the ``mtc`` parser."""
    about = "show a job's coordinator registration, or release a job name blocked by a bad one"
    p = subparsers.add_parser("registry", help=about, description=about)
    sub = p.add_subparsers(dest="registry_command", required=True)
    show = _command(sub, "show", "show a job's registry entry and whether daemons believe it")
    show.add_argument("--json", action="store_true", help="one JSON document on stdout")
    rel = _command(
        sub,
        "release",
        "delete a job's malformed or unsigned registry entry, so its rank 0 can register",
    )
    rel.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    rel.add_argument(
        "--force",
        action="store_true",
        help="release a valid entry too (a running job's: any namespace may then take the name)",
    )


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, about: str
) -> argparse.ArgumentParser:
    c = sub.add_parser(name, help=about, description=about)
    c.add_argument("url", help="the registry location (the daemons' --registry, or --backup)")
    c.add_argument("--job", type=argtypes.job, required=True, help="the job's name")
    add_bucket_options(
        c,
        checks="check the entry's signature as daemons do",
        unsigned="believe an unsigned entry, as daemons with this flag do",
    )
    return c


def _trust(args: argparse.Namespace) -> RecordTrust:
    if not args.tls_ca:
        return OPEN
    verifier = CaVerifier.from_file(Path(args.tls_ca), args.tls_server_name)
    return RecordTrust(verifier=verifier, accept_unsigned=args.accept_unsigned_records)


def _describe(state: EntryState, checked: bool) -> dict[str, Any]:
    entry = state.entry
    if state.raw is None:
        verdict = "absent"
    elif entry is None:
        verdict = "blocked"
    else:
        verdict = "valid" if checked else "valid (signature not checked: no --tls-ca)"
    return {
        "key": state.key,
        "state": verdict,
        "problem": state.problem,
        "owner": None if entry is None else entry.owner,
        "address": None if entry is None else entry.address,
        "coordinator_id": None if entry is None else entry.coordinator_id,
        "registered_at": None if entry is None else entry.registered_at,
        "bytes": None if state.raw is None else len(state.raw),
    }


def _print(job: str, info: dict[str, Any]) -> None:
    print(f"job {job}: {info['key']}: {info['state']}")
    if info["problem"]:
        print(f"  problem: {info['problem']}")
        print("  no rank 0 registers over it until it is released (mtc registry release)")
    if info["address"]:
        at = dt.datetime.fromtimestamp(info["registered_at"], dt.UTC)
        print(
            f"  owner {info['owner'] or '(unowned)'}, coordinator {info['address']} "
            f"(id {info['coordinator_id']}), registered {at:%Y-%m-%dT%H:%M:%SZ}"
        )


def run(args: argparse.Namespace) -> int:
    try:
        trust = _trust(args)
        registry = open_registry(args.url, trust, timeout=args.storage_timeout)
    except (ValueError, TlsError) as exc:
        return fail(str(exc), 2)
    except ObjectStoreError as exc:
        return fail(str(exc))
    try:
        state = inspect(registry, args.job)
        info = _describe(state, trust is not OPEN)
        if args.registry_command == "show":
            if args.json:
                print_json({"url": registry.url, "job": args.job, **info})
            else:
                _print(args.job, info)
            return 0
        return _release(args, registry, state, info)
    except ObjectStoreError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("interrupted", 130)


def _release(
    args: argparse.Namespace, registry: Registry, state: EntryState, info: dict[str, Any]
) -> int:
    job = args.job
    _print(job, info)
    if state.raw is None:
        print(f"job {job} has no registry entry: its name is free")
        return 0
    if not state.blocked and not args.force:
        return fail(
            f"job {job}'s entry is valid: a running job of owner {info['owner'] or '(unowned)'} "
            "may hold the name, and releasing it lets any namespace's rank 0 take it; "
            "--force releases it anyway"
            + ("" if args.tls_ca else " (give --tls-ca to check its signature first)")
        )
    if not args.yes:
        if not sys.stdin.isatty():
            return fail("confirm with --yes (stdin is not a terminal)", 2)
        answer = input(f"Release job name {job} (delete {state.key})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing released")
            return 1
    if not release(registry, state):
        return fail(f"{state.key} changed since it was read: nothing released; run this again")
    print(
        f"job {job}: released ({state.key} deleted); the first rank 0 to register takes the "
        "name: restart the job now"
    )
    return 0
