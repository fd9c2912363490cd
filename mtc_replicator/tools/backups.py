"""``mtc backups list|verify|pin|prune|download``: the operator's view of a backup location.

The command group and its shared options; ``list``, ``verify`` and ``pin`` (also known by its
first name, ``restore``) here, ``prune``
in ``prune_cli`` and ``download`` in ``download_cli``, their text and JSON in ``backup_views``.
Every decision is in ``storage.backup_audit`` (list, verify), ``storage.restore_pins``,
``core.prune`` and ``storage.backup_prune``. Exit codes: 0 done (and everything verified),
1 corruption found, something asked for not found, or the operation refused or failed, 2 bad
usage. Works on any URL ``open_object_store`` takes, through the ``ObjectStore`` interface
only.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cryptography import x509

from mtc_replicator.core import argtypes
from mtc_replicator.core.attestation import OPEN_MANIFESTS, ManifestTrust
from mtc_replicator.core.humanize import count
from mtc_replicator.core.identity import IdentityRule
from mtc_replicator.core.manifest import ManifestError
from mtc_replicator.core.pin_use import pin_refusal, utc
from mtc_replicator.core.signed import OPEN, RecordTrust
from mtc_replicator.storage import backup_audit as audit
from mtc_replicator.storage import restore_pins as pins
from mtc_replicator.storage.objectstore import ObjectStore, ObjectStoreError
from mtc_replicator.storage.stores import open_object_store
from mtc_replicator.tools import download_cli, progress_bars, prune_cli
from mtc_replicator.tools.backup_views import (
    fail,
    pin_json,
    print_job,
    print_json,
    print_verdict,
    step_json,
    verdict_json,
)
from mtc_replicator.tools.bucket_options import add_bucket_options
from mtc_replicator.transport.attesting import ProducerVerifier
from mtc_replicator.transport.operator_signing import OperatorSigner, OperatorVerifier
from mtc_replicator.transport.signing import CaVerifier
from mtc_replicator.transport.tls import TlsError

# --- argument wiring -----------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``backups`` and its commands on the ``mtc`` parser."""
    p = subparsers.add_parser(
        "backups",
        help="list, verify, pin a restore from, or prune a backup location",
        description="Operate on backups: file:///abs/path, gs://bucket/prefix, s3://bucket/prefix",
    )
    sub = p.add_subparsers(dest="backups_command", required=True)

    ls = _command(sub, "list", "jobs and steps: state, items, size, age", jobs="any")
    ls.add_argument("--json", action="store_true", help="one JSON document on stdout")

    verify = _command(sub, "verify", "re-read committed steps and check every byte", jobs="all")
    verify.add_argument(
        "--step", type=argtypes.count, help="only this step, with --job (default: every one)"
    )
    verify.add_argument("--json", action="store_true", help="one JSON document on stdout")

    restore = _command(
        sub,
        "pin",
        "sign and write a restore pin: the job's next restore round uses one committed step "
        "('restore' is the same command by its first name, same flags)",
        aliases=("restore",),
    )
    which = restore.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=argtypes.count, help="the committed step to restore")
    which.add_argument("--clear", action="store_true", help="remove the job's restore pin")
    restore.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    restore.add_argument(
        "--no-verify", action="store_true", help="pin without re-reading the step first"
    )
    restore.add_argument(
        "--expires-in",
        type=argtypes.seconds,
        metavar="SECONDS",
        help="daemons refuse the pin once this many seconds have passed, used or not "
        "(daemons from before pin expiries ignore it) (default: no expiry)",
    )
    restore.add_argument(
        "--operator-cert",
        default=os.environ.get("MTC_OPERATOR_CERT") or None,
        help="sign the pin with this operator certificate (from 'mtc certs operator'); "
        "daemons with TLS refuse unsigned pins [MTC_OPERATOR_CERT] (default: none, unsigned)",
    )
    restore.add_argument(
        "--operator-key",
        default=os.environ.get("MTC_OPERATOR_KEY") or None,
        help="the operator certificate's private key [MTC_OPERATOR_KEY] (default: none)",
    )

    prune = _command(
        sub, "prune", "delete old steps by a retention policy (dry run unless --apply)", jobs="all"
    )
    prune_cli.add_arguments(prune)

    dl = _command(
        sub, "download", "download a committed step into a directory, every byte verified"
    )
    download_cli.add_arguments(dl)

    for c in (verify, prune, dl):
        progress_bars.add_option(c)
    progress_bars.add_option(restore, has_json=False)


def _command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_text: str,
    *,
    jobs: str = "one",
    aliases: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """One command with the options all share: the URL, the job, trust and the timeout.
    ``jobs``: "one" (--job required), "any" (--job optional), "all" (--job or --all-jobs,
    one of them). ``aliases``: other names of the same command."""
    c = sub.add_parser(name, help=help_text, description=help_text, aliases=list(aliases))
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
    add_bucket_options(
        c,
        checks="check that each COMMIT is signed by a node",
        unsigned="take unsigned COMMITs (written before records were signed)",
    )
    return c


def run(args: argparse.Namespace) -> int:
    """Run one ``mtc backups`` command; the exit code."""
    commands: dict[str, Callable[[argparse.Namespace, ObjectStore, float], int]] = {
        "list": _list,
        "verify": _verify,
        "pin": _pin,
        "restore": _pin,  # the command's first name, kept working
        "prune": prune_cli.run,
        "download": download_cli.run,
    }
    try:
        args.trust, args.attested = _trusts(args)
        args.ca_label = _ca_label(args)
        args.signer = _operator(args)
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


def _trusts(args: argparse.Namespace) -> tuple[RecordTrust, ManifestTrust]:
    """Check COMMIT signatures and items' attestations against ``--tls-ca``, as the daemons
    do (an attestation signed by a node of the CA that names the producer,
    ``core.attestation``); without it, neither. The CA file is read once."""
    if not args.tls_ca:
        return OPEN, OPEN_MANIFESTS
    records = CaVerifier.from_file(Path(args.tls_ca), args.tls_server_name)
    # Any node's name, or the shared certificate of a cluster still on one.
    producers = ProducerVerifier(records, IdentityRule(shared_name=args.tls_server_name))
    unsigned = args.accept_unsigned_records
    return (
        RecordTrust(verifier=records, accept_unsigned=unsigned),
        ManifestTrust(verifier=producers, accept_unsigned=unsigned),
    )


def _ca_label(args: argparse.Namespace) -> str | None:
    """How a verdict names the CA signatures are checked against: the ``--tls-ca`` file
    and its first certificate's subject; None without one."""
    if not args.tls_ca:
        return None
    try:
        first = x509.load_pem_x509_certificates(Path(args.tls_ca).read_bytes())[0]
    except (OSError, ValueError) as exc:
        raise TlsError(f"the TLS CA {args.tls_ca} is not usable: {exc}") from None
    return f"{args.tls_ca} ({first.subject.rfc4514_string()})"


def _pin_trust(args: argparse.Namespace) -> RecordTrust:
    """Check a pin's signature against ``--tls-ca`` as the daemons do: an operator's."""
    if not args.tls_ca:
        return OPEN
    verifier = OperatorVerifier.from_file(Path(args.tls_ca))
    return RecordTrust(verifier=verifier, accept_unsigned=args.accept_unsigned_records)


def _operator(args: argparse.Namespace) -> OperatorSigner | None:
    """``pin``'s operator identity, checked against ``--tls-ca`` when given."""
    cert, key = getattr(args, "operator_cert", None), getattr(args, "operator_key", None)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("--operator-cert and --operator-key go together")
    signer = OperatorSigner(Path(cert), Path(key))
    if args.tls_ca:
        signer.check(Path(args.tls_ca), dt.datetime.now(dt.UTC))
    return signer


# --- list ----------------------------------------------------------------------------------


def _pin_spent(
    objects: ObjectStore, pin: pins.RestorePin, trust: RecordTrust, now: float
) -> str | None:
    """Why daemons will not honour ``pin`` any more (used already, expired), as they judge."""
    digest = pins.pin_digest(pin)
    used = pins.read_used_record(objects, pin.job, digest, trust)
    why = pin_refusal(pin.job, digest, pin.expires_at, now, used)
    return None if why is None else f"daemons will not honour it: {why}"


def _list(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    jobs = [args.job] if args.job else audit.list_jobs(objects)
    out: list[dict[str, Any]] = []
    pin_trust = _pin_trust(args)
    for job in jobs:
        listing = audit.scan_job(objects, job, args.trust)
        seal: str | None = None
        try:
            pin, pin_error = pins.read_restore_pin(objects, job), None
            if pin is not None:
                found = pins.read_sealed_pin(objects, job, pin_trust)
                seal = found[1].value if found is not None and found[1] is not None else None
                pin_error = _pin_spent(objects, pin, args.trust, now)
        except pins.RefusedPin as exc:
            pin_error, seal = str(exc), "refused"
        except pins.MalformedPin as exc:
            pin, pin_error = None, str(exc)
        out.append(
            {
                "job": job,
                "steps": [step_json(s, now) for s in listing.steps],
                "restore_pin": pin_json(pin),
                "restore_pin_error": pin_error,
                "restore_pin_signature": seal,
                "stray_objects": list(listing.stray),
            }
        )
    if args.job and _nothing(out[0]):
        return fail(f"no backups of job {args.job} in {objects.url}")
    if args.json:
        print_json({"url": objects.url, "jobs": out})
        return 0
    print(objects.url)
    if not out:
        print("no backups")
    for job in out:
        print_job(job, now)
    return 0


def _nothing(job: dict[str, Any]) -> bool:
    """Whether the location holds nothing at all of this job."""
    return not (
        job["steps"] or job["stray_objects"] or job["restore_pin"] or job["restore_pin_error"]
    )


# --- verify --------------------------------------------------------------------------------


def _verify_steps(
    args: argparse.Namespace, objects: ObjectStore, job: str, steps: Sequence[int]
) -> list[audit.StepVerdict] | None:
    """Verify ``steps`` under one progress bar; None if one of them has no COMMIT."""
    plans = [audit.plan_verify(objects, job, s, args.trust, args.attested) for s in steps]
    if any(not p.committed for p in plans):
        return None
    bar = progress_bars.bar(args, sum(p.total_bytes for p in plans), f"verify {job}")
    try:
        return [audit.run_verify(objects, p, bar) for p in plans]
    finally:
        bar.close()


def _verify_job(
    args: argparse.Namespace, objects: ObjectStore, job: str, *, required: bool
) -> tuple[bool, dict[str, Any] | None]:
    """Verify one job's committed steps (or ``--step``); whether all are good, and the JSON.
    A job with nothing committed fails when it was asked for by name (``required``): then,
    as for a ``--step`` not committed, no JSON (not found: nothing on stdout)."""
    if args.step is not None:
        steps = [args.step]
    else:
        listing = audit.scan_job(objects, job, args.trust)
        steps = [s.step for s in listing.steps if s.commit or s.commit_error]
    verdicts = _verify_steps(args, objects, job, steps)
    if verdicts is None:
        fail(f"step {args.step} of job {job} is not committed in {objects.url}")
        return False, None
    ok = all(v.ok for v in verdicts) and (bool(verdicts) or not required)
    if not verdicts:
        message = f"job {job} has no committed backups in {objects.url}"
        if required:
            fail(message)
            return False, None
        if not args.json:
            print(message)
    elif not args.json:
        for v in verdicts:
            print_verdict(v, args.ca_label)
        bad = sum(1 for v in verdicts if not v.ok)
        print(f"{count(len(verdicts), 'step')} verified: {len(verdicts) - bad} OK, {bad} CORRUPT")
    return ok, {"job": job, "ok": ok, "steps": [verdict_json(v, args.ca_label) for v in verdicts]}


def _verify(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    if not args.all_jobs:
        ok, body = _verify_job(args, objects, args.job, required=True)
        if args.json and body is not None:
            print_json({"url": objects.url, **body})
        return 0 if ok else 1
    if args.step is not None:
        return fail("--step goes with --job, not with --all-jobs", 2)
    jobs = audit.list_jobs(objects)
    if not jobs:
        return fail(f"no backups in {objects.url}")
    results = [_verify_job(args, objects, job, required=False)[1] for job in jobs]
    bodies = [b for b in results if b is not None]
    ok = all(b["ok"] for b in bodies)
    if args.json:
        print_json({"url": objects.url, "ok": ok, "jobs": bodies})
    else:
        bad = [b["job"] for b in bodies if not b["ok"]]
        print(f"{len(jobs)} job(s) verified: " + (f"CORRUPT: {', '.join(bad)}" if bad else "OK"))
    return 0 if ok else 1


# --- pin (restore) -------------------------------------------------------------------------


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    who = f"{user}@{socket.gethostname()}"
    return who if who.isprintable() else "?"


def _pin(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
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
            print_verdict(verdicts[0], args.ca_label)
            return fail(f"step {step} of job {job} is corrupt: nothing pinned")
    signer: OperatorSigner | None = args.signer
    by = _whoami() if signer is None else f"{signer.name()} ({_whoami()})"
    expires = None if args.expires_in is None else now + args.expires_in
    pin = pins.RestorePin(job, step, now, pins.commit_digest(found[1]), by[:256], expires)
    pins.write_restore_pin(objects, pin, RecordTrust(signer=signer))
    checked = "unverified" if args.no_verify else "verified"
    signed = "unsigned" if signer is None else f"signed by operator {signer.name()}"
    until = "" if expires is None else f", expires {utc(expires)}"
    print(
        f"job {job}: the next restore round will use backup step {step} ({checked}, "
        f"{signed}{until}){replaces}; pin at {pins.pin_key(job)}"
    )
    if signer is None:
        print(
            "mtc backups: the pin is unsigned: daemons with TLS refuse it unless they run "
            "--accept-unsigned-records; sign pins with --operator-cert and --operator-key "
            "(an operator certificate from 'mtc certs operator')",
            file=sys.stderr,
        )
    return 0
