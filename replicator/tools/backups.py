"""``mtc backups list|verify|restore|prune|download``: the operator's view of a backup location.

Argument wiring, text and JSON output, progress bars and exit codes; every decision is in
``storage.backup_audit`` (list, verify), ``storage.restore_pins``, ``core.prune`` and
``storage.backup_prune``. Exit codes: 0 done (and everything verified), 1 corruption
found, something asked for not found, or the operation refused or failed, 2 bad usage. Works
on any URL ``open_object_store`` takes, through the ``ObjectStore`` interface only.
"""

from __future__ import annotations

import argparse
import getpass
import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from replicator.core import argtypes
from replicator.core import prune as retention
from replicator.core.humanize import human_age, human_bytes
from replicator.core.manifest import ManifestError
from replicator.core.retry import DEFAULT_STORAGE_TIMEOUT
from replicator.core.signed import OPEN, RecordTrust
from replicator.storage import backup_audit as audit
from replicator.storage import backup_prune
from replicator.storage import restore_pins as pins
from replicator.storage.objectstore import ObjectStore, ObjectStoreError
from replicator.storage.stores import open_object_store
from replicator.tools import download_cli, progress_bars
from replicator.transport.signing import CaVerifier
from replicator.transport.tls import DEFAULT_SERVER_NAME, TlsError

PROG = "mtc backups"


# --- argument wiring -----------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``backups`` and its four commands on the ``mtc`` parser."""
    p = subparsers.add_parser(
        "backups",
        help="list, verify, pin a restore from, or prune a backup location",
        description="Operate on backups: file:///abs/path, gs://bucket/prefix, s3://bucket/prefix",
    )
    sub = p.add_subparsers(dest="backups_command", required=True)

    def command(name: str, help_text: str, *, jobs: str = "one") -> argparse.ArgumentParser:
        """``jobs``: "one" (--job required), "any" (--job optional), "all" (--job or
        --all-jobs, one of them)."""
        c = sub.add_parser(name, help=help_text, description=help_text)
        c.add_argument("url", help="backup location (the daemon's --backup)")
        if jobs == "all":
            which = c.add_mutually_exclusive_group(required=True)
            which.add_argument("--job", type=argtypes.job, help="the job's name")
            which.add_argument("--all-jobs", action="store_true", help="every job in the location")
        else:
            c.add_argument(
                "--job",
                type=argtypes.job,
                required=jobs == "one",
                help="the job's name" + (" (default: every job)" if jobs == "any" else ""),
            )
        c.add_argument(
            "--tls-ca",
            default=os.environ.get("MTC_TLS_CA") or None,
            help="the nodes' CA (PEM): check that each COMMIT is signed by a node [MTC_TLS_CA] "
            "(default: none, signatures are not checked)",
        )
        c.add_argument(
            "--tls-server-name",
            default=os.environ.get("MTC_TLS_SERVER_NAME", DEFAULT_SERVER_NAME),
            help="the DNS name in node certificates [MTC_TLS_SERVER_NAME] (default: %(default)s)",
        )
        c.add_argument(
            "--accept-unsigned-records",
            action="store_true",
            help="with --tls-ca: take unsigned COMMITs (written before records were signed)",
        )
        c.add_argument(
            "--storage-timeout",
            type=argtypes.storage_timeout,
            default=os.environ.get("MTC_STORAGE_TIMEOUT", str(DEFAULT_STORAGE_TIMEOUT)),
            metavar="SECONDS",
            help="the most seconds one request to the bucket may take, its retries included "
            "(default: %(default)s) [MTC_STORAGE_TIMEOUT]",
        )
        return c

    ls = command("list", "jobs and steps: state, items, size, age", jobs="any")
    ls.add_argument("--json", action="store_true", help="one JSON document on stdout")

    verify = command("verify", "re-read committed steps and check every byte", jobs="all")
    verify.add_argument(
        "--step", type=argtypes.count, help="only this step, with --job (default: every one)"
    )
    verify.add_argument("--json", action="store_true", help="one JSON document on stdout")

    restore = command("restore", "make the job's next restore round use one committed step")
    which = restore.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=argtypes.count, help="the committed step to restore")
    which.add_argument("--clear", action="store_true", help="remove the job's restore pin")
    restore.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    restore.add_argument(
        "--no-verify", action="store_true", help="pin without re-reading the step first"
    )

    prune = command(
        "prune", "delete old steps by a retention policy (dry run unless --apply)", jobs="all"
    )
    prune.add_argument(
        "--keep-last",
        type=argtypes.count,
        default=0,
        metavar="N",
        help="the N newest committed steps (default: %(default)s)",
    )
    for period, unit in (("hourly", "hours"), ("daily", "days (UTC)"), ("weekly", "ISO weeks")):
        prune.add_argument(
            f"--keep-{period}",
            type=argtypes.count,
            default=0,
            metavar="N",
            help=f"the newest step of each of the N newest {unit} that have one "
            "(default: %(default)s)",
        )
    prune.add_argument(
        "--min-age-minutes",
        type=argtypes.non_negative,
        default=retention.DEFAULT_MIN_AGE_SECONDS / 60,
        metavar="M",
        help="a step without COMMIT written to within M minutes is kept as uploading "
        "(default: %(default)g)",
    )
    prune.add_argument(
        "--verify-newest",
        action="store_true",
        help="verify from the newest step down; keep the newest that verifies",
    )
    prune.add_argument("--apply", action="store_true", help="delete (default: only show)")
    prune.add_argument("--json", action="store_true", help="one JSON document on stdout")

    dl = command("download", "download a committed step into a directory, every byte verified")
    download_cli.add_arguments(dl)

    for c in (verify, restore, prune, dl):
        progress_bars.add_option(c)


def run(args: argparse.Namespace) -> int:
    """Run one ``mtc backups`` command; the exit code."""
    commands: dict[str, Callable[[argparse.Namespace, ObjectStore, float], int]] = {
        "list": _list,
        "verify": _verify,
        "restore": _restore,
        "prune": _prune,
        "download": download_cli.run,
    }
    try:
        args.trust = _trust(args)
        objects = open_object_store(args.url, create=False, timeout=args.storage_timeout)
    except (ValueError, TlsError) as exc:
        return fail(str(exc), 2)
    except ObjectStoreError as exc:
        return fail(str(exc))
    try:
        return commands[args.backups_command](args, objects, time.time())
    except (ObjectStoreError, pins.PinError, ManifestError, download_cli.DownloadError) as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:
        # Output piped into `head`: stop quietly, and keep the exit-time flush from failing too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _trust(args: argparse.Namespace) -> RecordTrust:
    """Check COMMIT signatures against ``--tls-ca``, as the daemons do; without it, not."""
    if not args.tls_ca:
        return OPEN
    verifier = CaVerifier.from_file(Path(args.tls_ca), args.tls_server_name)
    return RecordTrust(verifier=verifier, accept_unsigned=args.accept_unsigned_records)


def fail(message: str, code: int = 1) -> int:
    """Say what went wrong on stderr; the exit code."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _print_json(body: object) -> None:
    print(json.dumps(body, indent=2, sort_keys=True))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    """Columns padded to their widest cell; the last column is left ragged."""
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers) - 1)]
    for row in (headers, *rows):
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print(indent + "  ".join([*cells, row[-1]]).rstrip())


# --- list ----------------------------------------------------------------------------------


def _pin_json(pin: pins.RestorePin | None) -> dict[str, Any] | None:
    return None if pin is None else pin.to_dict()


def _number(x: float | None) -> float | None:
    """JSON has no NaN or Infinity (a hostile COMMIT's time can be either)."""
    return x if x is not None and math.isfinite(x) else None


def _step_json(s: audit.StepListing, now: float) -> dict[str, Any]:
    at = s.commit.created if s.commit is not None else s.newest_object_at
    return {
        "step": s.step,
        "state": s.state(now).value,
        "items": s.items,
        "objects": s.objects,
        "bytes": s.bytes,
        "committed_at": _number(s.commit.created) if s.commit is not None else None,
        "newest_object_at": s.newest_object_at,
        "age_seconds": _number(now - at),
        "commit_error": s.commit_error,
        "signature": "refused" if s.commit_refused else s.seal.value if s.seal else None,
    }


def _list(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    jobs = [args.job] if args.job else audit.list_jobs(objects)
    out: list[dict[str, Any]] = []
    for job in jobs:
        listing = audit.scan_job(objects, job, args.trust)
        try:
            pin, pin_error = pins.read_restore_pin(objects, job), None
        except pins.MalformedPin as exc:
            pin, pin_error = None, str(exc)
        out.append(
            {
                "job": job,
                "steps": [_step_json(s, now) for s in listing.steps],
                "restore_pin": _pin_json(pin),
                "restore_pin_error": pin_error,
                "stray_objects": list(listing.stray),
            }
        )
    if args.job and _nothing(out[0]):
        return fail(f"no backups of job {args.job} in {objects.url}")
    if args.json:
        _print_json({"url": objects.url, "jobs": out})
        return 0
    print(objects.url)
    if not out:
        print("no backups")
    for job in out:
        _print_job(job, now)
    return 0


def _nothing(job: dict[str, Any]) -> bool:
    """Whether the location holds nothing at all of this job."""
    return not (
        job["steps"] or job["stray_objects"] or job["restore_pin"] or job["restore_pin_error"]
    )


def _print_job(job: dict[str, Any], now: float) -> None:
    steps = job["steps"]
    states: dict[str, int] = {}
    for s in steps:
        states[s["state"]] = states.get(s["state"], 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in states.items()) or "no backups"
    total = human_bytes(sum(s["bytes"] for s in steps))
    print(f"job {job['job']}: {summary} ({total})")
    pin = job["restore_pin"]
    if pin is not None:
        age = human_age(now - pin["requested_at"])
        who = f" by {pin['requested_by']}" if pin["requested_by"] else ""
        print(f"  next restore pinned to step {pin['step']} (requested {age} ago{who})")
    if job["restore_pin_error"]:
        print(f"  restore pin unusable: {job['restore_pin_error']}")
    if job["stray_objects"]:
        stray = job["stray_objects"]
        print(f"  {len(stray)} object(s) outside any step, e.g. {stray[0]}")
    if steps:
        rows = [
            [
                str(s["step"]),
                s["state"],
                str(s["items"]),
                str(s["objects"]),
                human_bytes(s["bytes"]),
                s["signature"] or "-",
                human_age(math.nan if s["age_seconds"] is None else s["age_seconds"]),
            ]
            for s in steps
        ]
        _table(["STEP", "STATE", "ITEMS", "OBJECTS", "SIZE", "SIGNATURE", "AGE"], rows)


# --- verify --------------------------------------------------------------------------------


def _verdict_json(v: audit.StepVerdict) -> dict[str, Any]:
    return {
        "job": v.job,
        "step": v.step,
        "status": "OK" if v.ok else "CORRUPT",
        "items": v.items,
        "objects_checked": v.objects_checked,
        "bytes_checked": v.bytes_checked,
        "problems": [
            {"kind": p.kind.value, "item": p.item, "key": p.key, "detail": p.detail}
            for p in v.problems
        ],
        "unexpected_objects": list(v.unexpected),
    }


def _print_verdict(v: audit.StepVerdict) -> None:
    status = "OK" if v.ok else "CORRUPT"
    size = human_bytes(v.bytes_checked)
    counts = f"{v.items} items, {v.objects_checked} objects, {size}"
    print(f"job {v.job} step {v.step}: {status} ({counts})")
    for p in v.problems:
        where = " ".join(x for x in (f"item {p.item}" if p.item else "", p.key or "") if x)
        print(f"  {p.kind.value.replace('_', ' ')}: {where}: {p.detail}")
    if v.unexpected:
        n, first = len(v.unexpected), v.unexpected[0]
        print(f"  note: {n} object(s) the COMMIT does not name, e.g. {first}")


def _verify_steps(
    args: argparse.Namespace, objects: ObjectStore, job: str, steps: Sequence[int]
) -> list[audit.StepVerdict] | None:
    """Verify ``steps`` under one progress bar; None if one of them has no COMMIT."""
    plans = [audit.plan_verify(objects, job, s, args.trust) for s in steps]
    if any(not p.committed for p in plans):
        return None
    bar = progress_bars.bar(args, sum(p.total_bytes for p in plans), f"verify {job}")
    try:
        return [audit.run_verify(objects, p, bar) for p in plans]
    finally:
        bar.close()


def _verify_job(
    args: argparse.Namespace, objects: ObjectStore, job: str, *, required: bool
) -> tuple[bool, dict[str, Any]]:
    """Verify one job's committed steps (or ``--step``); whether all are good, and the JSON.
    A job with nothing committed fails when it was asked for by name (``required``)."""
    if args.step is not None:
        steps = [args.step]
    else:
        listing = audit.scan_job(objects, job, args.trust)
        steps = [s.step for s in listing.steps if s.commit or s.commit_error]
    verdicts = _verify_steps(args, objects, job, steps)
    if verdicts is None:
        fail(f"step {args.step} of job {job} is not committed in {objects.url}")
        return False, {"job": job, "ok": False, "steps": []}
    ok = all(v.ok for v in verdicts) and (bool(verdicts) or not required)
    if not verdicts:
        message = f"job {job} has no committed backups in {objects.url}"
        if required:
            fail(message)
        elif not args.json:
            print(message)
    elif not args.json:
        for v in verdicts:
            _print_verdict(v)
        bad = sum(1 for v in verdicts if not v.ok)
        print(f"{len(verdicts)} step(s) verified: {len(verdicts) - bad} OK, {bad} CORRUPT")
    return ok, {"job": job, "ok": ok, "steps": [_verdict_json(v) for v in verdicts]}


def _verify(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    if not args.all_jobs:
        ok, body = _verify_job(args, objects, args.job, required=True)
        if args.json:
            _print_json({"url": objects.url, **body})
        return 0 if ok else 1
    if args.step is not None:
        return fail("--step goes with --job, not with --all-jobs", 2)
    jobs = audit.list_jobs(objects)
    if not jobs:
        return fail(f"no backups in {objects.url}")
    bodies = [_verify_job(args, objects, job, required=False)[1] for job in jobs]
    ok = all(b["ok"] for b in bodies)
    if args.json:
        _print_json({"url": objects.url, "ok": ok, "jobs": bodies})
    else:
        bad = [b["job"] for b in bodies if not b["ok"]]
        print(f"{len(jobs)} job(s) verified: " + (f"CORRUPT: {', '.join(bad)}" if bad else "OK"))
    return 0 if ok else 1


# --- restore -------------------------------------------------------------------------------


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    who = f"{user}@{socket.gethostname()}"
    return who if who.isprintable() else "?"


def _restore(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    job = args.job
    if args.clear:
        if pins.clear_restore_pin(objects, job):
            print(f"job {job}: restore pin removed; the next restore takes the newest step")
        else:
            print(f"job {job} had no restore pin")
        return 0
    step = args.step
    found = audit.read_commit_raw(objects, job, step, args.trust)
    if found is None:
        return fail(
            f"step {step} of job {job} is not committed; `mtc backups list` shows which are"
        )
    try:
        old = pins.read_restore_pin(objects, job)
        replaces = f" (replacing the pin of step {old.step})" if old is not None else ""
    except pins.MalformedPin:
        replaces = " (replacing a malformed pin)"
    if not args.yes:
        if not sys.stdin.isatty():
            return fail("confirm with --yes (stdin is not a terminal)", 2)
        answer = input(f"Pin job {job}'s next restore to backup step {step}{replaces}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing pinned")
            return 1
    if not args.no_verify:
        verdicts = _verify_steps(args, objects, job, [step])
        if verdicts is None:
            return fail(f"step {step} of job {job} is not committed any more")
        if not verdicts[0].ok:
            _print_verdict(verdicts[0])
            return fail(f"step {step} of job {job} is corrupt: nothing pinned")
    pin = pins.RestorePin(job, step, now, pins.commit_digest(found[1]), _whoami()[:256])
    pins.write_restore_pin(objects, pin)
    checked = "unverified" if args.no_verify else "verified"
    print(
        f"job {job}: the next restore round will use backup step {step} ({checked}){replaces}; "
        f"pin at {pins.pin_key(job)}"
    )
    return 0


# --- prune ---------------------------------------------------------------------------------


def _prune(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    policy = retention.RetentionPolicy(
        args.keep_last,
        args.keep_hourly,
        args.keep_daily,
        args.keep_weekly,
        args.min_age_minutes * 60,
    )
    if not (policy.keep_last or policy.keep_hourly or policy.keep_daily or policy.keep_weekly):
        return fail(
            "give a retention policy: at least one of --keep-last/-hourly/-daily/-weekly", 2
        )
    if not args.all_jobs:
        rc, body = _prune_job(args, objects, now, args.job, policy, required=True)
        if args.json and body is not None:
            _print_json(body)
        return rc
    jobs = audit.list_jobs(objects)
    if not jobs:
        return fail(f"no backups in {objects.url}")
    results = [_prune_job(args, objects, now, job, policy, required=False) for job in jobs]
    if args.json:
        bodies = [b for _, b in results if b is not None]
        _print_json({"url": objects.url, "apply": args.apply, "jobs": bodies})
    return max(rc for rc, _ in results)


def _prune_job(
    args: argparse.Namespace,
    objects: ObjectStore,
    now: float,
    job: str,
    policy: retention.RetentionPolicy,
    *,
    required: bool,
) -> tuple[int, dict[str, Any] | None]:
    """Plan (and with ``--apply``, do) one job's prune; the exit code and the JSON body.
    Text goes out as it is decided; a job with nothing stored fails when ``required``."""
    listing = audit.scan_job(objects, job, args.trust)
    try:
        pin = pins.read_restore_pin(objects, job)
    except pins.MalformedPin as exc:
        msg = f"job {job}: {exc}; fix it or remove it (mtc backups restore --clear) before pruning"
        return fail(msg), None
    if required and not listing.steps and not listing.stray and pin is None:
        return fail(f"no backups of job {job} in {objects.url}"), None
    verdicts: list[audit.StepVerdict] = []
    newest_verified: int | None = None
    if args.verify_newest:
        committed = [s.step for s in listing.steps if s.commit is not None]
        bars: list[progress_bars.Bar] = []

        def bar_for(plan: audit.VerifyPlan) -> audit.Progress:
            bars.append(progress_bars.bar(args, plan.total_bytes, f"verify {job} step {plan.step}"))
            return bars[-1]

        try:
            newest_verified, verdicts = audit.find_newest_verified(
                objects, job, committed, bar_for, args.trust
            )
        finally:
            for b in bars:
                b.close()
    facts = backup_prune.prune_facts(
        listing,
        pinned=pin.step if pin is not None else None,
        verify_requested=args.verify_newest,
        newest_verified=newest_verified,
    )
    decisions = retention.plan_prune(policy, facts, now)
    deletions = (
        backup_prune.apply_prune(
            objects, job, decisions, min_age_seconds=policy.min_age_seconds, now=time.time()
        )
        if args.apply
        else []
    )
    sizes = {s.step: s for s in listing.steps}
    doomed = [d for d in decisions if d.action is retention.Action.DELETE]
    result = {
        "url": objects.url,
        "job": job,
        "apply": args.apply,
        "policy": {
            "keep_last": policy.keep_last,
            "keep_hourly": policy.keep_hourly,
            "keep_daily": policy.keep_daily,
            "keep_weekly": policy.keep_weekly,
            "min_age_seconds": policy.min_age_seconds,
        },
        "restore_pin": _pin_json(pin),
        "verified": [_verdict_json(v) for v in verdicts],
        "steps": [
            {
                "step": d.step,
                "state": d.state.value,
                "action": d.action.value,
                "reasons": list(d.reasons),
                "objects": sizes[d.step].objects,
                "bytes": sizes[d.step].bytes,
            }
            for d in decisions
        ],
        "deleted": [
            {"step": x.step, "objects": x.objects, "bytes": x.bytes}
            for x in deletions
            if x.skipped is None
        ],
        "skipped": [{"step": x.step, "reason": x.skipped} for x in deletions if x.skipped],
    }
    if args.json:
        return 0, result
    mode = "deleting" if args.apply else "dry run: nothing is deleted, add --apply to delete"
    print(f"job {job} in {objects.url}: prune ({mode})")
    for v in verdicts:
        _print_verdict(v)
    if not decisions:
        print("  no backups")
        return 0, result
    rows = []
    for d in decisions:
        s = sizes[d.step]
        at = s.commit.created if s.commit is not None else s.newest_object_at
        rows.append(
            [
                str(d.step),
                d.state.value,
                d.action.value,
                human_bytes(s.bytes),
                human_age(now - at),
                ", ".join(d.reasons),
            ]
        )
    _table(["STEP", "STATE", "ACTION", "SIZE", "AGE", "WHY"], rows)
    if not args.apply:
        count = sum(sizes[d.step].objects for d in doomed)
        size = human_bytes(sum(sizes[d.step].bytes for d in doomed))
        print(f"would delete {len(doomed)} step(s): {count} objects, {size}")
        return 0, result
    done = [x for x in deletions if x.skipped is None]
    size = human_bytes(sum(x.bytes for x in done))
    print(f"deleted {len(done)} step(s): {sum(x.objects for x in done)} objects, {size}")
    for x in deletions:
        if x.skipped:
            print(f"  left step {x.step}: {x.skipped}")
    return 0, result
