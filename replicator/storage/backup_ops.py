"""Operator work on backups: list, verify, pin the next restore, prune. Pure policy, thin I/O.

``plan_prune``, the restore pin's parsing and the formatting helpers are pure; the rest
reads and deletes through an ``ObjectStore`` only, so every backend (``file://``, ``gs://``,
``s3://``) gets the same behaviour. Nothing here writes below a job's prefix: the daemon
owns uploads, and the only writes are the restore pin and the deletions ``mtc backups
prune --apply`` asked for (COMMIT first, so a half-deleted step is never restorable).

The restore pin lives at ``_control/<job>/restore-pin.json``. ``_control`` can never be a
job's prefix (job names start with a letter or digit, as for ``_registry``), and backup
listings are per ``<job>/`` prefix, so the daemon never mistakes it for a step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import google_crc32c

from replicator.core.backup_layout import (
    COMMIT,
    CommitRecord,
    commit_key,
    item_prefix,
    manifest_item_key,
    step_prefix,
)
from replicator.core.contract import STEP_DIR_RE
from replicator.core.jobname import is_job_name
from replicator.core.jsonobj import NotAnObject, load_object
from replicator.core.manifest import MAX_MANIFEST_BYTES, FileEntry, ItemId, Manifest, ManifestError
from replicator.core.signed import OPEN, RecordRefused, RecordTrust, Seal
from replicator.local.usedpins import UsedPins
from replicator.storage.backup import BackupStore
from replicator.storage.objectstore import ObjectInfo, ObjectNotFound, ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

CONTROL_PREFIX = "_control/"
PIN_NAME = "restore-pin.json"
PIN_FORMAT_VERSION = 1
MAX_PIN_BYTES = 4096
"""A pin is about 200 bytes; anything larger is not one of ours and is not read further."""
DEFAULT_MIN_AGE_SECONDS = 3600.0
"""A step without COMMIT whose newest object is younger than this is taken as uploading."""
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")

Progress = Callable[[int], None]
"""Told how many more bytes were read, so a caller can draw a progress bar."""


def _no_progress(_: int) -> None:
    pass


# --- formatting (pure) ---------------------------------------------------------------------


def human_bytes(n: int) -> str:
    """``1.5 GiB``: binary units, one decimal, as operators compare them with ``du -h``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} PiB"


def human_age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h12m``, ``2d4h``: two units at most, enough to judge a backup."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 0:
        # Clocks of the writer and of this machine differ a little; more is worth showing.
        return "0s" if seconds > -60 else f"{human_age(-seconds)} ahead"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


# --- listing -------------------------------------------------------------------------------


class StepState(StrEnum):
    COMMITTED = "committed"
    UPLOADING = "uploading"
    """No COMMIT yet and objects younger than the minimum age: probably still being written."""
    PARTIAL = "partial"
    """No COMMIT and nothing written for a while: an abandoned or half-deleted upload."""
    INVALID = "invalid"
    """A COMMIT that does not parse: not restorable, and left for a person to look at."""


@dataclass(frozen=True)
class StepListing:
    """One step of a job as the store lists it."""

    job: str
    step: int
    objects: int
    bytes: int
    newest_object_at: float
    manifests: int
    """Item manifests present: the items uploaded so far."""
    commit: CommitRecord | None
    commit_error: str | None = None
    """Why a COMMIT object that exists could not be read, or was refused."""
    seal: Seal | None = None
    """What is known of the COMMIT's signature, when it was read and believed."""
    commit_refused: bool = False
    """The COMMIT is well formed but not believed (unsigned, or a bad signature)."""

    @property
    def items(self) -> int:
        return len(self.commit.items) if self.commit is not None else self.manifests

    def state(self, now: float, min_age_seconds: float = DEFAULT_MIN_AGE_SECONDS) -> StepState:
        if self.commit is not None:
            return StepState.COMMITTED
        if self.commit_error is not None:
            return StepState.INVALID
        if now - self.newest_object_at < min_age_seconds:
            return StepState.UPLOADING
        return StepState.PARTIAL


@dataclass(frozen=True)
class JobListing:
    job: str
    steps: tuple[StepListing, ...]
    """Newest (highest) step first."""
    stray: tuple[str, ...] = ()
    """Keys below the job's prefix that belong to no step (never written by us)."""


def group_steps(
    job: str, infos: Iterable[ObjectInfo]
) -> tuple[dict[int, list[ObjectInfo]], list[str]]:
    """Objects below ``<job>/`` by step, and the keys that fit no step."""
    steps: dict[int, list[ObjectInfo]] = {}
    stray: list[str] = []
    base = f"{job}/"
    for info in infos:
        if not info.key.startswith(base):
            continue
        step, sep, rest = info.key[len(base) :].partition("/")
        if sep and rest and STEP_DIR_RE.fullmatch(step):
            steps.setdefault(int(step), []).append(info)
        else:
            stray.append(info.key)
    return steps, stray


def list_jobs(objects: ObjectStore) -> list[str]:
    """Job prefixes in the store; ``_registry``, ``_control`` and foreign keys are skipped."""
    jobs: set[str] = set()
    for info in objects.list(""):
        top, sep, _ = info.key.partition("/")
        if sep and is_job_name(top):
            jobs.add(top)
    return sorted(jobs)


def read_commit_raw(
    objects: ObjectStore, job: str, step: int, trust: RecordTrust = OPEN
) -> tuple[CommitRecord, bytes] | None:
    """The step's COMMIT and its exact bytes (which a restore pin identifies it by).

    Raises ``RecordRefused`` (a ``ManifestError``) when ``trust`` does not believe it.
    """
    return BackupStore(objects, trust).read_commit_raw(job, step)


def scan_job(objects: ObjectStore, job: str, trust: RecordTrust = OPEN) -> JobListing:
    """Every step of ``job`` with its size, items and COMMIT (one listing, one read per COMMIT)."""
    grouped, stray = group_steps(job, objects.list(f"{job}/"))
    steps: list[StepListing] = []
    for step, infos in sorted(grouped.items(), reverse=True):
        names = {i.key[len(step_prefix(job, step)) :] for i in infos}
        commit: CommitRecord | None = None
        error: str | None = None
        seal: Seal | None = None
        refused = False
        if COMMIT in names:
            try:
                found = BackupStore(objects, trust).read_commit_sealed(job, step)
            except ManifestError as exc:
                error, refused = str(exc), isinstance(exc, RecordRefused)
            else:
                commit, seal = (found[0], found[2]) if found else (None, None)
        steps.append(
            StepListing(
                job=job,
                step=step,
                objects=len(infos),
                bytes=sum(i.size for i in infos),
                newest_object_at=max(i.mtime for i in infos),
                manifests=sum(1 for n in names if manifest_item_key(n) is not None),
                commit=commit,
                commit_error=error,
                seal=seal,
                commit_refused=refused,
            )
        )
    return JobListing(job, tuple(steps), tuple(stray))


# --- verification --------------------------------------------------------------------------


class ProblemKind(StrEnum):
    INVALID_COMMIT = "invalid_commit"
    UNTRUSTED_COMMIT = "untrusted_commit"
    """Unsigned where a signature is required, or the signature does not hold."""
    MISSING_MANIFEST = "missing_manifest"
    INVALID_MANIFEST = "invalid_manifest"
    MANIFEST_DIGEST_MISMATCH = "manifest_digest_mismatch"
    MISSING_OBJECT = "missing_object"
    SIZE_MISMATCH = "size_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"


@dataclass(frozen=True)
class Problem:
    kind: ProblemKind
    detail: str
    item: str | None = None
    """The item's key (``<rank>-<worker>``), when the problem is one item's."""
    key: str | None = None
    """The object concerned."""


@dataclass(frozen=True)
class VerifyPlan:
    """What verifying one step will read: known after the COMMIT and manifests are read."""

    job: str
    step: int
    committed: bool
    items: int
    checks: tuple[tuple[str, str, FileEntry], ...]
    """(item key, object key, what the manifest says about it) per data object."""
    problems: tuple[Problem, ...]
    listed: Mapping[str, ObjectInfo]
    unexpected: tuple[str, ...]
    """Objects below the step that nothing committed names: not harmful, worth a note."""

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for _, _, entry in self.checks)


@dataclass(frozen=True)
class StepVerdict:
    job: str
    step: int
    items: int
    objects_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]
    unexpected: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_verify(objects: ObjectStore, job: str, step: int, trust: RecordTrust = OPEN) -> VerifyPlan:
    """Read the step's COMMIT and every manifest it pins; list the data objects to check."""
    listed = {i.key: i for i in objects.list(step_prefix(job, step))}
    problems: list[Problem] = []
    checks: list[tuple[str, str, FileEntry]] = []
    ckey = commit_key(job, step)
    expected = {ckey}
    bad_items: list[str] = []
    """Prefixes of items with a bad manifest: their objects are not news."""

    def plan(committed: bool, items: int = 0) -> VerifyPlan:
        unexpected = tuple(
            k
            for k in sorted(set(listed) - expected)
            if committed and not k.startswith(tuple(bad_items))
        )
        return VerifyPlan(
            job, step, committed, items, tuple(checks), tuple(problems), listed, unexpected
        )

    info = listed.get(ckey)
    try:
        if info is not None and info.size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"COMMIT of {info.size} bytes is too large")
        found = read_commit_raw(objects, job, step, trust)
    except RecordRefused as exc:
        problems.append(Problem(ProblemKind.UNTRUSTED_COMMIT, str(exc), key=ckey))
        return plan(True)
    except ManifestError as exc:
        problems.append(Problem(ProblemKind.INVALID_COMMIT, str(exc), key=ckey))
        return plan(True)
    if found is None:
        return plan(False)
    record = found[0]
    for key, digest in sorted(record.items.items()):
        rank, _, worker = key.partition("-")
        item = ItemId(job, step, int(rank), int(worker))
        mkey = record.manifest_key(item)
        expected.add(mkey)
        info = listed.get(mkey)
        kind, detail = ProblemKind.INVALID_MANIFEST, ""
        try:
            if info is not None and info.size > MAX_MANIFEST_BYTES:
                raise ManifestError(f"manifest of {info.size} bytes is too large")
            manifest = Manifest.from_json(objects.get_bytes(mkey))
            if manifest.digest != digest:
                kind = ProblemKind.MANIFEST_DIGEST_MISMATCH
                detail = (
                    f"manifest digest {manifest.digest[:16]} differs from the COMMIT's "
                    f"{digest[:16]}: modified after the commit"
                )
            elif manifest.item != item:
                detail = f"manifest describes {manifest.item}"
        except ObjectNotFound:
            kind, detail = ProblemKind.MISSING_MANIFEST, "the COMMIT names it; it is missing"
        except ManifestError as exc:
            detail = str(exc)
        if detail:
            problems.append(Problem(kind, detail, key, mkey))
            bad_items.append(f"{item_prefix(item, record.layout)}/")
            continue
        for entry in manifest.files:
            dkey = record.data_key(item, entry.path)
            expected.add(dkey)
            checks.append((key, dkey, entry))
    return plan(True, len(record.items))


def _check_object(
    objects: ObjectStore, key: str, listed: ObjectInfo | None, entry: FileEntry, progress: Progress
) -> tuple[int, ProblemKind | None, str]:
    """Stream one object against its manifest entry: (bytes read, problem kind, detail).

    ``progress`` hears the bytes read, never more than ``entry.size``.
    """
    if listed is None:
        return 0, ProblemKind.MISSING_OBJECT, "object is missing"
    if listed.size != entry.size:
        return 0, ProblemKind.SIZE_MISMATCH, f"{listed.size} bytes, manifest says {entry.size}"
    crc, size = 0, 0
    try:
        for chunk in objects.read_chunks(key):
            size += len(chunk)
            if size > entry.size:
                # Changed since listed; reading a hostile giant to the end helps no one.
                progress(entry.size - (size - len(chunk)))
                return size, ProblemKind.SIZE_MISMATCH, f"over {entry.size} bytes read"
            crc = google_crc32c.extend(crc, chunk)
            progress(len(chunk))
    except ObjectNotFound:
        return size, ProblemKind.MISSING_OBJECT, "object is missing"
    if size != entry.size:
        return size, ProblemKind.SIZE_MISMATCH, f"{size} bytes read, manifest says {entry.size}"
    if crc != entry.crc32c:
        detail = f"crc32c {crc:08x}, manifest says {entry.crc32c:08x}"
        return size, ProblemKind.CHECKSUM_MISMATCH, detail
    return size, None, ""


def run_verify(
    objects: ObjectStore, plan: VerifyPlan, progress: Progress = _no_progress
) -> StepVerdict:
    """Stream every data object of ``plan`` and compare size and crc32c; nothing is written.

    Every problem is collected (not just the first), so one run tells an operator all that
    is wrong with a step. ``progress`` hears exactly ``plan.total_bytes`` in all.
    """
    problems = list(plan.problems)
    read_bytes = 0
    for item_key, key, entry in plan.checks:
        size, kind, detail = _check_object(objects, key, plan.listed.get(key), entry, progress)
        read_bytes += size
        if kind is not None:
            problems.append(Problem(kind, detail, item_key, key))
            # Progress heard only the good bytes of a bad object: make the total come out.
            progress(entry.size - min(size, entry.size))
    return StepVerdict(
        plan.job,
        plan.step,
        plan.items,
        len(plan.checks),
        read_bytes,
        tuple(problems),
        plan.unexpected,
    )


def verify_step(
    objects: ObjectStore,
    job: str,
    step: int,
    progress: Progress = _no_progress,
    trust: RecordTrust = OPEN,
) -> StepVerdict | None:
    """Verify one step end to end; None when it has no COMMIT at all."""
    plan = plan_verify(objects, job, step, trust)
    return run_verify(objects, plan, progress) if plan.committed else None


def find_newest_verified(
    objects: ObjectStore,
    job: str,
    steps: Iterable[int],
    progress: Callable[[VerifyPlan], Progress] = lambda _: _no_progress,
    trust: RecordTrust = OPEN,
) -> tuple[int | None, list[StepVerdict]]:
    """Verify ``steps`` from the highest down until one is OK: (that step, the verdicts)."""
    verdicts: list[StepVerdict] = []
    for step in sorted(steps, reverse=True):
        plan = plan_verify(objects, job, step, trust)
        if not plan.committed:
            continue
        verdict = run_verify(objects, plan, progress(plan))
        verdicts.append(verdict)
        if verdict.ok:
            return step, verdicts
    return None, verdicts


# --- the restore pin -----------------------------------------------------------------------


class PinError(ValueError):
    """A restore pin cannot be used; the message says why and what to do."""


class MalformedPin(PinError):
    """The pin object breaks a rule (anyone with bucket access may have written it)."""


class StalePin(PinError):
    """The pinned step is no longer committed as it was when the pin was made."""


def pin_key(job: str) -> str:
    if not is_job_name(job):
        raise MalformedPin(f"bad job name {job!r:.80}")
    return f"{CONTROL_PREFIX}{job}/{PIN_NAME}"


def commit_digest(raw: bytes) -> str:
    """What a pin identifies its COMMIT by: the sha256 of the COMMIT object's bytes."""
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class RestorePin:
    """Job ``job``'s next restore round must use committed backup step ``step``."""

    job: str
    step: int
    requested_at: float
    """Wall-clock seconds when an operator made the pin."""
    commit_digest: str
    """sha256 of the COMMIT's bytes: a step pruned and uploaded again is not the pinned one."""
    requested_by: str = ""
    """``user@host`` that made it, for the operator who finds it later."""

    def __post_init__(self) -> None:
        if not is_job_name(self.job):
            raise MalformedPin(f"bad job name {self.job!r:.80}")
        if type(self.step) is not int or self.step < 0:
            raise MalformedPin(f"bad step {self.step!r:.40}")
        at = self.requested_at
        try:
            good_time = type(at) in (int, float) and math.isfinite(at) and at >= 0
        except OverflowError:  # an int beyond any float
            good_time = False
        if not good_time:
            raise MalformedPin(f"bad request time {at!r:.40}")
        if not isinstance(self.commit_digest, str) or not _DIGEST_RE.fullmatch(self.commit_digest):
            raise MalformedPin(f"bad commit digest {self.commit_digest!r:.80}")
        by = self.requested_by
        if not isinstance(by, str) or len(by) > 256 or not by.isprintable():
            raise MalformedPin(f"bad requested_by {by!r:.80}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PIN_FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "requested_at": self.requested_at,
            "commit_digest": self.commit_digest,
            "requested_by": self.requested_by,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RestorePin:
        """Parse a pin from storage; every way it can be wrong is a ``MalformedPin``."""
        try:
            data = load_object(raw, MAX_PIN_BYTES)
        except NotAnObject as exc:
            raise MalformedPin(str(exc)) from None
        version = data.get("version")
        if type(version) is not int or version != PIN_FORMAT_VERSION:
            raise MalformedPin(f"unsupported version {version!r:.40}")
        missing = [k for k in ("job", "step", "requested_at", "commit_digest") if k not in data]
        if missing:
            raise MalformedPin(f"missing {', '.join(missing)}")
        return cls(
            job=data["job"],
            step=data["step"],
            requested_at=data["requested_at"],
            commit_digest=data["commit_digest"],
            requested_by=data.get("requested_by", ""),
        )


def read_restore_pin(objects: ObjectStore, job: str) -> RestorePin | None:
    """Job ``job``'s restore pin, None if there is none; ``MalformedPin`` if it is bad.

    Reads at most one chunk past ``MAX_PIN_BYTES`` whatever the object's size.
    """
    key = pin_key(job)
    raw = b""
    try:
        for chunk in objects.read_chunks(key):
            raw += chunk
            if len(raw) > MAX_PIN_BYTES:
                break
    except ObjectNotFound:
        return None
    try:
        pin = RestorePin.from_json(raw)
    except MalformedPin as exc:
        raise MalformedPin(f"restore pin {key}: {exc}") from None
    if pin.job != job:
        raise MalformedPin(f"restore pin {key} names job {pin.job!r:.80}")
    return pin


def write_restore_pin(objects: ObjectStore, pin: RestorePin) -> None:
    """Publish ``pin``, replacing any older pin of its job (the newest request wins)."""
    objects.put_bytes(pin_key(pin.job), pin.to_json())
    log.info("restore pinned job=%s step=%d", pin.job, pin.step)


def clear_restore_pin(objects: ObjectStore, job: str, expected: RestorePin | None = None) -> bool:
    """Remove ``job``'s pin; True if one was removed.

    With ``expected`` (the coordinator, after the pinned round is released), only that very
    pin goes: one an operator made meanwhile stays for the next round. Read-compare-delete
    is not atomic on object stores, so that is best effort, as for the registry.
    """
    key = pin_key(job)
    if expected is not None:
        try:
            current = read_restore_pin(objects, job)
        except MalformedPin:
            return False
        if current != expected:
            return False
    elif objects.head(key) is None:
        return False
    objects.delete(key)
    log.info("restore pin cleared job=%s", job)
    return True


def resolve_restore_pin(
    objects: ObjectStore, pin: RestorePin, trust: RecordTrust = OPEN
) -> CommitRecord:
    """The COMMIT a pin names, if it is still exactly the one pinned (and ``trust`` believes
    it); else ``StalePin``."""
    try:
        found = read_commit_raw(objects, pin.job, pin.step, trust)
    except ManifestError as exc:
        raise StalePin(f"pinned step {pin.step} of job {pin.job}: {exc}") from None
    if found is None:
        raise StalePin(f"pinned step {pin.step} of job {pin.job} is not committed any more")
    record, raw = found
    if commit_digest(raw) != pin.commit_digest:
        raise StalePin(f"pinned step {pin.step} of job {pin.job} was committed again since")
    return record


# --- retention -----------------------------------------------------------------------------


class Action(StrEnum):
    KEEP = "keep"
    DELETE = "delete"


@dataclass(frozen=True)
class RetentionPolicy:
    """How many committed steps to keep: the newest ``keep_last``, and the newest one of
    each of the newest ``keep_hourly`` hours (days, ISO weeks; UTC) that have one, as
    restic and borg count periods. ``min_age_seconds`` protects uploads in progress."""

    keep_last: int = 0
    keep_hourly: int = 0
    keep_daily: int = 0
    keep_weekly: int = 0
    min_age_seconds: float = DEFAULT_MIN_AGE_SECONDS

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_hourly", "keep_daily", "keep_weekly"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if not math.isfinite(self.min_age_seconds) or self.min_age_seconds < 0:
            raise ValueError(f"min_age_seconds must be at least 0, got {self.min_age_seconds}")


@dataclass(frozen=True)
class PruneFacts:
    """What prune decides on for one job."""

    committed: Mapping[int, float]
    """Committed step -> its commit time."""
    partial: Mapping[int, float] = field(default_factory=dict)
    """Step without COMMIT -> the time of its newest object."""
    invalid: Collection[int] = ()
    """Steps whose COMMIT exists but does not parse: never deleted by a policy."""
    pinned: int | None = None
    """The step a restore pin names."""
    verify_requested: bool = False
    newest_verified: int | None = None
    """With ``verify_requested``: the newest committed step that verified, None if none."""


@dataclass(frozen=True)
class StepDecision:
    step: int
    state: StepState
    action: Action
    reasons: tuple[str, ...]


def _period(name: str, t: float) -> str | None:
    """The UTC hour, day or ISO week ``t`` falls in, as a label that is also its bucket."""
    try:
        d = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return None  # a COMMIT time no calendar holds: only keep-last can keep that step
    day = f"{d.year:04d}-{d.month:02d}-{d.day:02d}"
    if name == "hourly":
        return f"{day}T{d.hour:02d}"
    if name == "daily":
        return day
    iso = d.isocalendar()
    return f"{iso.year:04d}-W{iso.week:02d}"


def plan_prune(policy: RetentionPolicy, facts: PruneFacts, now: float) -> list[StepDecision]:
    """Keep or delete each step of one job, with the reasons, newest step first.

    Never deleted: the newest committed step (what a restore would pick), the newest
    verified one when verification was asked for (every committed step when none
    verified), the pinned step, steps with an unreadable COMMIT, and steps without COMMIT
    whose newest object is younger than ``min_age_seconds``. "Newest" is the highest step.
    """
    partial = {s: t for s, t in dict(facts.partial).items() if s not in facts.committed}
    invalid = set(facts.invalid) - set(facts.committed) - set(partial)
    committed = sorted(facts.committed, reverse=True)
    reasons: dict[int, list[str]] = {s: [] for s in (*committed, *partial, *invalid)}
    if committed:
        reasons[committed[0]].append("newest committed")
    for s in committed[: policy.keep_last]:
        reasons[s].append(f"last {policy.keep_last}")
    periods = (
        ("hourly", policy.keep_hourly),
        ("daily", policy.keep_daily),
        ("weekly", policy.keep_weekly),
    )
    for name, count in periods:
        seen: set[str] = set()
        for s in committed:
            if len(seen) >= count:
                break
            bucket = _period(name, facts.committed[s])
            if bucket is not None and bucket not in seen:
                seen.add(bucket)
                reasons[s].append(f"{name} {bucket}")
    if facts.verify_requested:
        if facts.newest_verified is not None and facts.newest_verified in facts.committed:
            reasons[facts.newest_verified].append("newest verified")
        else:
            for s in committed:
                reasons[s].append("no committed step verified")
    if facts.pinned is not None and facts.pinned in reasons:
        reasons[facts.pinned].append("restore pin")
    decisions: list[StepDecision] = []
    for s in sorted(reasons, reverse=True):
        why = reasons[s]
        if s in facts.committed:
            state = StepState.COMMITTED
        elif s in invalid:
            state = StepState.INVALID
            why.append("COMMIT unreadable: left for inspection")
        else:
            age = now - partial[s]
            if not math.isfinite(age) or age < policy.min_age_seconds:
                state = StepState.UPLOADING
                why.append(f"may still be uploading (newest object {human_age(age)} old)")
            else:
                state = StepState.PARTIAL
        if why:
            decisions.append(StepDecision(s, state, Action.KEEP, tuple(why)))
        elif state is StepState.PARTIAL:
            reason = f"no COMMIT, newest object {human_age(now - partial[s])} old"
            decisions.append(StepDecision(s, state, Action.DELETE, (reason,)))
        else:
            decisions.append(StepDecision(s, state, Action.DELETE, ("no keep rule selects it",)))
    return decisions


def prune_facts(
    listing: JobListing,
    *,
    pinned: int | None = None,
    verify_requested: bool = False,
    newest_verified: int | None = None,
) -> PruneFacts:
    """The policy's input from a listing: commit times, and newest object times of the rest."""
    committed = {s.step: s.commit.created for s in listing.steps if s.commit is not None}
    invalid = [s.step for s in listing.steps if s.commit is None and s.commit_error is not None]
    partial = {
        s.step: s.newest_object_at
        for s in listing.steps
        if s.commit is None and s.commit_error is None
    }
    return PruneFacts(committed, partial, invalid, pinned, verify_requested, newest_verified)


@dataclass(frozen=True)
class Deletion:
    step: int
    objects: int
    bytes: int
    skipped: str | None = None
    """Why the step was left alone after all (it changed since the plan was made)."""


def delete_step(objects: ObjectStore, job: str, step: int) -> tuple[int, int]:
    """Delete one step: COMMIT first (it stops being restorable at once), then each item's
    manifest (the item stops existing), then the data. (objects, bytes) deleted.

    A prune that dies half-way leaves a step without COMMIT, which the next prune removes.
    """
    ckey = commit_key(job, step)
    count, size = 0, 0
    info = objects.head(ckey)
    if info is not None:
        objects.delete(ckey)
        count, size = 1, info.size
    prefix = step_prefix(job, step)
    rest = [i for i in objects.list(prefix) if i.key != ckey]
    rest.sort(key=lambda i: (manifest_item_key(i.key[len(prefix) :]) is None, i.key))
    for info in rest:
        objects.delete(info.key)
        count += 1
        size += info.size
    return count, size


def apply_prune(
    objects: ObjectStore,
    job: str,
    decisions: Iterable[StepDecision],
    *,
    min_age_seconds: float,
    now: float,
) -> list[Deletion]:
    """Delete the steps ``decisions`` marks DELETE, oldest first, re-checking each first.

    A pin made since the plan keeps its step; a step without COMMIT that got one, or got
    new objects, since it was listed is left alone: an uploader came back to it.
    """
    pin = read_restore_pin(objects, job)
    done: list[Deletion] = []
    for d in sorted(decisions, key=lambda d: d.step):
        if d.action is not Action.DELETE:
            continue
        if pin is not None and pin.step == d.step:
            done.append(Deletion(d.step, 0, 0, "a restore pin names it now"))
            continue
        if d.state is not StepState.COMMITTED:
            infos = list(objects.list(step_prefix(job, d.step)))
            if any(i.key == commit_key(job, d.step) for i in infos):
                done.append(Deletion(d.step, 0, 0, "it was committed since it was listed"))
                continue
            if any(now - i.mtime < min_age_seconds for i in infos):
                done.append(Deletion(d.step, 0, 0, "new objects arrived since it was listed"))
                continue
        count, size = delete_step(objects, job, d.step)
        log.info("pruned backup job=%s step=%d objects=%d bytes=%d", job, d.step, count, size)
        done.append(Deletion(d.step, count, size))
    return done


PinFailed = Callable[[str, int, str], object]
"""Told ``(job, step, message)`` when a used pin could not be removed (from a thread)."""


def pin_digest(pin: RestorePin) -> str:
    """A pin's identity: the sha256 of its canonical form (a new pin has a new request
    time, so the same step pinned again is another pin)."""
    return hashlib.sha256(pin.to_json()).hexdigest()


class StorePins:
    """The restore pins in a backup store, as the coordinator consumes them.

    A pin that is malformed or names a step no longer committed as pinned is logged and
    ignored: the round then restores the last-known-good step, and the operator sees why.
    With ``used`` (the node's record of used pins), a pin is honoured once: its digest is
    recorded before it is deleted, so a pin whose delete is refused never rolls the job
    back again; ``on_failure`` hears of that refusal.
    """

    def __init__(
        self,
        objects: ObjectStore,
        trust: RecordTrust = OPEN,
        *,
        used: UsedPins | None = None,
        on_failure: PinFailed | None = None,
    ) -> None:
        self.objects = objects
        self.trust = trust
        self.used = used
        self.on_failure = on_failure
        self._offered: dict[str, RestorePin] = {}
        """Per job, the pin ``pinned_step`` last answered with: the one a round used."""

    def pinned_step(self, job: str) -> int | None:
        try:
            pin = read_restore_pin(self.objects, job)
            if pin is None:
                return None
            if self.used is not None and self.used.used(job, pin_digest(pin)):
                self._retry_delete(job, pin)
                return None
            resolve_restore_pin(self.objects, pin, self.trust)
        except (PinError, ObjectStoreError) as exc:
            log.warning("ignoring the restore pin of job %s: %s", job, exc)
            return None
        self._offered[job] = pin
        return pin.step

    def _retry_delete(self, job: str, pin: RestorePin) -> None:
        """A used pin is still there: never honoured again; one more try to remove it."""
        log.info(
            "restore pin of job %s (step %d) was used already; not honoured again",
            job,
            pin.step,
        )
        try:
            clear_restore_pin(self.objects, job, expected=pin)
        except ObjectStoreError as exc:
            log.debug("cannot remove the used restore pin of job %s: %s", job, exc)

    def consumed(self, job: str, step: int) -> None:
        pin = self._offered.pop(job, None)
        recorded = False
        try:
            if pin is None or pin.step != step:
                pin = read_restore_pin(self.objects, job)
            if pin is None or pin.step != step:
                return
            if self.used is not None:
                # First: should the delete fail, the pin is still used up.
                try:
                    self.used.record(job, pin_digest(pin))
                    recorded = True
                except OSError as exc:
                    log.error("cannot record the used restore pin of job %s: %s", job, exc)
            clear_restore_pin(self.objects, job, expected=pin)
        except (PinError, ObjectStoreError) as exc:
            message = (
                f"cannot remove the used restore pin {pin_key(job)} (step {step}): {exc}; "
                + (
                    "it is recorded as used on this node and not honoured again here; "
                    if recorded
                    else ""
                )
                + "delete it (mtc backups restore URL --job JOB --clear) or let the daemon "
                "delete it (docs/permissions.md)"
            )
            log.warning("%s", message)
            if self.on_failure is not None:
                self.on_failure(job, step, message)
