"""``mtc backups prune``: arguments, text and JSON output and exit codes over the retention
policy (``core.prune``) and its deletions (``storage.backup_prune``).

A dry run unless ``--apply``; a restore pin that cannot be read stops the job's prune (the
pinned step might be deleted). I/O through the ``ObjectStore`` interface only.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from mtc_replicator.core import argtypes
from mtc_replicator.core import prune as retention
from mtc_replicator.core.attestation import OPEN_MANIFESTS
from mtc_replicator.core.humanize import count, human_age, human_bytes
from mtc_replicator.storage import backup_audit as audit
from mtc_replicator.storage import backup_prune
from mtc_replicator.storage import restore_pins as pins
from mtc_replicator.storage.objectstore import ObjectStore
from mtc_replicator.tools import progress_bars
from mtc_replicator.tools.backup_views import (
    fail,
    pin_json,
    print_json,
    print_verdict,
    table,
    verdict_json,
)


def add_arguments(prune: argparse.ArgumentParser) -> None:
    """The retention policy's options, ``--verify-newest``, ``--apply`` and ``--json``."""
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


def run(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    """``mtc backups prune`` on ``--job`` or ``--all-jobs``; the exit code."""
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
            print_json(body)
        return rc
    jobs = audit.list_jobs(objects)
    if not jobs:
        return fail(f"no backups in {objects.url}")
    results = [_prune_job(args, objects, now, job, policy, required=False) for job in jobs]
    if args.json:
        bodies = [b for _, b in results if b is not None]
        print_json({"url": objects.url, "apply": args.apply, "jobs": bodies})
    return max(rc for rc, _ in results)


@dataclass(frozen=True)
class _JobPrune:
    """One job's prune as decided (and, with ``--apply``, done): what the output shows."""

    job: str
    policy: retention.RetentionPolicy
    pin: pins.RestorePin | None
    verdicts: list[audit.StepVerdict]
    decisions: list[retention.StepDecision]
    deletions: list[backup_prune.Deletion]
    sizes: dict[int, audit.StepListing]


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
        msg = f"job {job}: {exc}; fix it or remove it (mtc backups pin --clear) before pruning"
        return fail(msg), None
    if required and not listing.steps and not listing.stray and pin is None:
        return fail(f"no backups of job {job} in {objects.url}"), None
    newest_verified, verdicts = (
        _verify_newest(args, objects, job, listing) if args.verify_newest else (None, [])
    )
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
    done = _JobPrune(
        job, policy, pin, verdicts, decisions, deletions, {s.step: s for s in listing.steps}
    )
    result = _prune_json(done, objects.url, apply=args.apply, ca=args.ca_label)
    if not args.json:
        _print_prune(done, objects.url, now, apply=args.apply, ca=args.ca_label)
    return 0, result


def _verify_newest(
    args: argparse.Namespace, objects: ObjectStore, job: str, listing: audit.JobListing
) -> tuple[int | None, list[audit.StepVerdict]]:
    """``--verify-newest``: the newest committed step that verifies, and the verdicts read."""
    committed = [s.step for s in listing.steps if s.commit is not None]
    bars: list[progress_bars.Bar] = []

    def bar_for(plan: audit.VerifyPlan) -> audit.Progress:
        bars.append(progress_bars.bar(args, plan.total_bytes, f"verify {job} step {plan.step}"))
        return bars[-1]

    try:
        # Attestations too, as a restore checks them (args.attested: --tls-ca).
        attested = getattr(args, "attested", OPEN_MANIFESTS)
        return audit.find_newest_verified(
            objects, job, committed, bar_for, trust=args.trust, attested=attested
        )
    finally:
        for b in bars:
            b.close()


def _prune_json(p: _JobPrune, url: str, *, apply: bool, ca: str | None) -> dict[str, Any]:
    return {
        "url": url,
        "job": p.job,
        "apply": apply,
        "policy": {
            "keep_last": p.policy.keep_last,
            "keep_hourly": p.policy.keep_hourly,
            "keep_daily": p.policy.keep_daily,
            "keep_weekly": p.policy.keep_weekly,
            "min_age_seconds": p.policy.min_age_seconds,
        },
        "restore_pin": pin_json(p.pin),
        "verified": [verdict_json(v, ca) for v in p.verdicts],
        "steps": [
            {
                "step": d.step,
                "state": d.state.value,
                "action": d.action.value,
                "reasons": list(d.reasons),
                "objects": p.sizes[d.step].objects,
                "bytes": p.sizes[d.step].bytes,
            }
            for d in p.decisions
        ],
        "deleted": [
            {"step": x.step, "objects": x.objects, "bytes": x.bytes}
            for x in p.deletions
            if x.skipped is None
        ],
        "skipped": [{"step": x.step, "reason": x.skipped} for x in p.deletions if x.skipped],
    }


def _print_prune(p: _JobPrune, url: str, now: float, *, apply: bool, ca: str | None) -> None:
    mode = "deleting" if apply else "dry run: nothing is deleted, add --apply to delete"
    print(f"job {p.job} in {url}: prune ({mode})")
    for v in p.verdicts:
        print_verdict(v, ca)
    if not p.decisions:
        print("  no backups")
        return
    rows = []
    for d in p.decisions:
        s = p.sizes[d.step]
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
    table(["STEP", "STATE", "ACTION", "SIZE", "AGE", "WHY"], rows)
    if not apply:
        doomed = [d for d in p.decisions if d.action is retention.Action.DELETE]
        objects = sum(p.sizes[d.step].objects for d in doomed)
        size = human_bytes(sum(p.sizes[d.step].bytes for d in doomed))
        print(f"would delete {count(len(doomed), 'step')}: {count(objects, 'object')}, {size}")
        return
    done = [x for x in p.deletions if x.skipped is None]
    size = human_bytes(sum(x.bytes for x in done))
    objects = sum(x.objects for x in done)
    print(f"deleted {count(len(done), 'step')}: {count(objects, 'object')}, {size}")
    for x in p.deletions:
        if x.skipped:
            print(f"  left step {x.step}: {x.skipped}")
