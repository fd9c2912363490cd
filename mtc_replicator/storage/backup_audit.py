"""What the backups in a store are, and whether a step is intact: list and verify. Reads only.

Everything reads through an ``ObjectStore``, so every backend (``file://``, ``gs://``,
``s3://``) lists and verifies the same way; nothing here writes. ``scan_job`` lists a job's
steps with their COMMITs (for ``mtc backups list`` and prune); ``plan_verify`` and
``run_verify`` stream every data object of a committed step against its manifest (for
``mtc backups verify``, prune's ``--verify`` and ``mtc backups pin``'s check).

Keys outside job prefixes (``_registry``, ``_control`` for restore pins) are never listed as
jobs: job names start with a letter or digit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import google_crc32c

from mtc_replicator.core.attestation import OPEN_MANIFESTS, Attested, ManifestTrust, Unattested
from mtc_replicator.core.backup_layout import (
    COMMIT,
    CommitRecord,
    commit_key,
    item_prefix,
    manifest_item_key,
    step_prefix,
)
from mtc_replicator.core.contract import STEP_DIR_RE
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import (
    MAX_MANIFEST_BYTES,
    CorruptItem,
    FileEntry,
    ItemId,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.core.prune import DEFAULT_MIN_AGE_SECONDS, StepState
from mtc_replicator.core.signed import OPEN, RecordRefused, RecordTrust, Seal
from mtc_replicator.local.digests import FileCheck, crc_checked
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectInfo, ObjectNotFound, ObjectStore

Progress = Callable[[int], None]
"""Told how many more bytes were read, so a caller can draw a progress bar."""


def _no_progress(_: int) -> None:
    pass


# --- listing -------------------------------------------------------------------------------


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
    UNATTESTED_MANIFEST = "unattested_manifest"
    """Not signed by the node that produced it, for the owner the COMMIT names."""
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
    seal: Seal | None = None
    """What is known of the COMMIT's signature, when it was read and believed."""
    attested: tuple[Attested, ...] = ()
    """What is known of each believed manifest's attestation (its producer's signature)."""

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
    seal: Seal | None = None
    """The COMMIT's signature: ``verified`` by the CA, ``unsigned`` (taken under the
    migration flag), ``unchecked`` (no CA given); None: the COMMIT was not believed."""
    attested: tuple[Attested, ...] = ()
    """The same of each manifest believed, in the COMMIT's order."""

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_verify(
    objects: ObjectStore,
    job: str,
    step: int,
    trust: RecordTrust = OPEN,
    attested: ManifestTrust = OPEN_MANIFESTS,
) -> VerifyPlan:
    """Read the step's COMMIT and every manifest it pins, each attested as ``attested``
    wants for the COMMIT's owner; list the data objects to check."""
    listed = {i.key: i for i in objects.list(step_prefix(job, step))}
    problems: list[Problem] = []
    checks: list[tuple[str, str, FileEntry]] = []
    ckey = commit_key(job, step)
    expected = {ckey}
    bad_items: list[str] = []
    """Prefixes of items with a bad manifest: their objects are not news."""
    attestations: list[Attested] = []
    seal: Seal | None = None

    def plan(committed: bool, items: int = 0) -> VerifyPlan:
        unexpected = tuple(
            k
            for k in sorted(set(listed) - expected)
            if committed and not k.startswith(tuple(bad_items))
        )
        return VerifyPlan(
            job,
            step,
            committed,
            items,
            tuple(checks),
            tuple(problems),
            listed,
            unexpected,
            seal,
            tuple(attestations),
        )

    info = listed.get(ckey)
    try:
        if info is not None and info.size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"COMMIT of {info.size} bytes is too large")
        found = BackupStore(objects, trust).read_commit_sealed(job, step)
    except RecordRefused as exc:
        problems.append(Problem(ProblemKind.UNTRUSTED_COMMIT, str(exc), key=ckey))
        return plan(True)
    except ManifestError as exc:
        problems.append(Problem(ProblemKind.INVALID_COMMIT, str(exc), key=ckey))
        return plan(True)
    if found is None:
        return plan(False)
    record, seal = found[0], found[2]
    for key, digest in sorted(record.items.items()):
        rank, _, worker = key.partition("-")
        item = ItemId(job, step, int(rank), int(worker))
        mkey = record.manifest_key(item)
        expected.add(mkey)
        try:
            manifest, seen = _read_pinned(
                objects,
                mkey,
                listed.get(mkey),
                digest=digest,
                item=item,
                attested=attested,
                owner=record.owner or UNOWNED,
            )
        except _BadManifest as bad:
            problems.append(Problem(bad.kind, bad.detail, key, mkey))
            bad_items.append(f"{item_prefix(item, record.layout)}/")
            continue
        attestations.append(seen)
        for entry in manifest.files:
            dkey = record.data_key(item, entry.path)
            expected.add(dkey)
            checks.append((key, dkey, entry))
    return plan(True, len(record.items))


class _BadManifest(Exception):
    def __init__(self, kind: ProblemKind, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _read_pinned(
    objects: ObjectStore,
    key: str,
    info: ObjectInfo | None,
    *,
    digest: str,
    item: ItemId,
    attested: ManifestTrust,
    owner: str,
) -> tuple[Manifest, Attested]:
    """The manifest at ``key`` that a COMMIT pins by ``digest``, for ``item``, and what is
    known of its attestation; ``_BadManifest`` with the problem otherwise."""
    try:
        if info is not None and info.size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {info.size} bytes is too large")
        manifest = Manifest.from_json(objects.get_bytes(key))
    except ObjectNotFound:
        raise _BadManifest(
            ProblemKind.MISSING_MANIFEST, "the COMMIT names it; it is missing"
        ) from None
    except ManifestError as exc:
        raise _BadManifest(ProblemKind.INVALID_MANIFEST, str(exc)) from None
    if manifest.digest != digest:
        raise _BadManifest(
            ProblemKind.MANIFEST_DIGEST_MISMATCH,
            f"manifest digest {manifest.digest[:16]} differs from the COMMIT's "
            f"{digest[:16]}: modified after the commit",
        )
    if manifest.item != item:
        raise _BadManifest(ProblemKind.INVALID_MANIFEST, f"manifest describes {manifest.item}")
    try:
        return manifest, attested.check(manifest, owner)
    except Unattested as exc:
        raise _BadManifest(ProblemKind.UNATTESTED_MANIFEST, str(exc)) from None


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
    content = FileCheck(entry)
    with_crc = crc_checked(entry)  # as a restore decides: the digest alone, where there is one
    try:
        for chunk in objects.read_chunks(key):
            size += len(chunk)
            if size > entry.size:
                # Changed since listed; reading a hostile giant to the end helps no one.
                progress(entry.size - (size - len(chunk)))
                return size, ProblemKind.SIZE_MISMATCH, f"over {entry.size} bytes read"
            if with_crc:
                crc = google_crc32c.extend(crc, chunk)
            content.update(chunk)
            progress(len(chunk))
    except ObjectNotFound:
        return size, ProblemKind.MISSING_OBJECT, "object is missing"
    if size != entry.size:
        return size, ProblemKind.SIZE_MISMATCH, f"{size} bytes read, manifest says {entry.size}"
    if with_crc and crc != entry.crc32c:
        detail = f"crc32c {crc:08x}, manifest says {entry.crc32c:08x}"
        return size, ProblemKind.CHECKSUM_MISMATCH, detail
    try:
        content.check(key)
    except CorruptItem as exc:
        return size, ProblemKind.CHECKSUM_MISMATCH, str(exc)
    return size, None, ""


def run_verify(
    objects: ObjectStore, plan: VerifyPlan, progress: Progress = _no_progress
) -> StepVerdict:
    """Stream every data object of ``plan`` and compare size and digest (crc32c where a file
    has none, as a restore does); nothing is written.

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
        plan.seal,
        plan.attested,
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
    *,
    trust: RecordTrust = OPEN,
    attested: ManifestTrust = OPEN_MANIFESTS,
) -> tuple[int | None, list[StepVerdict]]:
    """Verify ``steps`` from the highest down until one is OK: (that step, the verdicts)."""
    verdicts: list[StepVerdict] = []
    for step in sorted(steps, reverse=True):
        plan = plan_verify(objects, job, step, trust, attested)
        if not plan.committed:
            continue
        verdict = run_verify(objects, plan, progress(plan))
        verdicts.append(verdict)
        if verdict.ok:
            return step, verdicts
    return None, verdicts
