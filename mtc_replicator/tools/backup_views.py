"""Text and JSON views of a backup location for ``mtc backups``: listings, verdicts, pins.

Shared by the ``mtc backups`` commands (``backups``, ``prune_cli``) so a step, a verdict or a
pin reads the same in every one of them; writes to stdout and stderr only.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from mtc_replicator.core.humanize import count, human_age, human_bytes
from mtc_replicator.core.pin_use import utc
from mtc_replicator.storage import backup_audit as audit
from mtc_replicator.storage import restore_pins as pins

PROG = "mtc backups"


def fail(message: str, code: int = 1) -> int:
    """Say what went wrong on stderr; the exit code."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def print_json(body: object) -> None:
    print(json.dumps(body, indent=2, sort_keys=True))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> None:
    """Columns padded to their widest cell; the last column is left ragged."""
    widths = [max(len(r[i]) for r in (headers, *rows)) for i in range(len(headers) - 1)]
    for row in (headers, *rows):
        cells = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print(indent + "  ".join([*cells, row[-1]]).rstrip())


# --- listings ------------------------------------------------------------------------------


def pin_json(pin: pins.RestorePin | None) -> dict[str, Any] | None:
    return None if pin is None else pin.to_dict()


def _number(x: float | None) -> float | None:
    """JSON has no NaN or Infinity (a hostile COMMIT's time can be either)."""
    return x if x is not None and math.isfinite(x) else None


def step_json(s: audit.StepListing, now: float) -> dict[str, Any]:
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


def print_job(job: dict[str, Any], now: float) -> None:
    """One job of ``mtc backups list`` (its JSON body) as text."""
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
        signed = job.get("restore_pin_signature")
        seal = f", signature {signed}" if signed else ""
        until = f", expires {utc(pin['expires_at'])}" if pin.get("expires_at") else ""
        print(
            f"  next restore pinned to step {pin['step']} (requested {age} ago{who}{seal}{until})"
        )
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
        table(["STEP", "STATE", "ITEMS", "OBJECTS", "SIZE", "SIGNATURE", "AGE"], rows)


# --- verdicts ------------------------------------------------------------------------------


def signatures_json(v: audit.StepVerdict, ca: str | None) -> dict[str, Any]:
    """Whether the step's signatures were checked, against which CA (``ca``: None when no
    ``--tls-ca`` was given), and what was found: the COMMIT's seal (``refused`` when the
    CA did not believe it) and each believed manifest's attestation, counted by kind."""
    refused = any(p.kind is audit.ProblemKind.UNTRUSTED_COMMIT for p in v.problems)
    manifests: dict[str, int] = {}
    for a in v.attested:
        manifests[a.value] = manifests.get(a.value, 0) + 1
    unattested = sum(1 for p in v.problems if p.kind is audit.ProblemKind.UNATTESTED_MANIFEST)
    if unattested:
        manifests["refused"] = unattested
    return {
        "checked": ca is not None,
        "ca": ca,
        "commit": "refused" if refused else v.seal.value if v.seal is not None else None,
        "manifests": manifests,
    }


def signatures_line(v: audit.StepVerdict, ca: str | None) -> str:
    """One line: were this step's signatures checked, by which CA, and with what outcome."""
    if ca is None:
        return "signatures: not checked (no --tls-ca): only the bytes were checked"
    body = signatures_json(v, ca)
    found = [f"COMMIT {body['commit'] or 'unreadable'}"]
    found += [f"{count(n, 'manifest')} {kind}" for kind, n in sorted(body["manifests"].items())]
    return f"signatures: checked against the CA {ca}: {', '.join(found)}"


def verdict_json(v: audit.StepVerdict, ca: str | None = None) -> dict[str, Any]:
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
        "signatures": signatures_json(v, ca),
    }


def print_verdict(v: audit.StepVerdict, ca: str | None = None) -> None:
    """A step's verdict, its problems and whether its signatures were checked (``ca``: the
    CA they were checked against, None when no ``--tls-ca`` was given)."""
    status = "OK" if v.ok else "CORRUPT"
    size = human_bytes(v.bytes_checked)
    counts = f"{count(v.items, 'item')}, {count(v.objects_checked, 'object')}, {size}"
    print(f"job {v.job} step {v.step}: {status} ({counts})")
    for p in v.problems:
        where = " ".join(x for x in (f"item {p.item}" if p.item else "", p.key or "") if x)
        print(f"  {p.kind.value.replace('_', ' ')}: {where}: {p.detail}")
    print(f"  {signatures_line(v, ca)}")
    if v.unexpected:
        n, first = len(v.unexpected), v.unexpected[0]
        print(f"  note: {n} object(s) the COMMIT does not name, e.g. {first}")
