"""Restore pins: an operator's "the next restore of job J uses step S", read by the daemon.

``mtc backups pin`` writes a pin; the coordinator's round reads it through ``StorePins``
and removes it once the round used it. A pin is hostile input (anyone with bucket access may
have written it): ``RestorePin`` parses it strictly, a pin is believed only when an operator
signed it (``core.signed``, kind ``restore-pin``; ``transport.operator_signing`` says who is
an operator), and it is honoured only while the COMMIT it names is byte for byte the one
pinned (``resolve_restore_pin``), once (its used record, ``core.pin_use``) and before its
expiry, if it has one. I/O through an ``ObjectStore`` only.

The pin lives at ``_control/<job>/restore-pin.json``, the used records of a job's pins at
``_control/<job>/used-pins/<pin digest>.json``. ``_control`` can never be a job's
prefix (job names start with a letter or digit, as for ``_registry``), and backup listings
are per ``<job>/`` prefix, so the daemon never mistakes it for a step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.jsonobj import NotAnObject, load_object
from mtc_replicator.core.manifest import ManifestError
from mtc_replicator.core.pin_use import (
    MAX_USED_BYTES,
    MalformedUsedRecord,
    UsedPin,
    good_expiry,
    pin_refusal,
)
from mtc_replicator.core.signed import (
    OPEN,
    PIN_KIND,
    USED_PIN_KIND,
    RecordRefused,
    RecordTrust,
    Seal,
)
from mtc_replicator.local.usedpins import UsedPins
from mtc_replicator.storage.backup_audit import read_commit_raw
from mtc_replicator.storage.objectstore import (
    ObjectNotFound,
    ObjectStore,
    ObjectStoreError,
    PreconditionFailed,
)

log = logging.getLogger(__name__)

CONTROL_PREFIX = "_control/"
PIN_NAME = "restore-pin.json"
USED_DIR = "used-pins"
"""Under ``_control/<job>/``: one create-only, node-signed record per pin honoured."""
PIN_FORMAT_VERSION = 1
MAX_PIN_BYTES = 24 * 1024
"""A pin is about 200 bytes, 1-3 KiB signed; anything larger is not one of ours and is not
read further."""
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class PinError(ValueError):
    """A restore pin cannot be used; the message says why and what to do."""


class MalformedPin(PinError):
    """The pin object breaks a rule (anyone with bucket access may have written it)."""


class RefusedPin(PinError):
    """The pin is well formed but not signed by an operator (anyone with write access to the
    bucket may have written it)."""


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
    expires_at: float | None = None
    """Wall-clock seconds after which it is refused (None: never). Absent from the JSON when
    None, so pins made before expiries keep their bytes, signature and digest; a daemon
    from before expiries ignores the key and honours the pin."""

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
        if not good_expiry(self.expires_at):
            raise MalformedPin(f"bad expiry {self.expires_at!r:.40}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": PIN_FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "requested_at": self.requested_at,
            "commit_digest": self.commit_digest,
            "requested_by": self.requested_by,
        }
        if self.expires_at is not None:
            data["expires_at"] = self.expires_at
        return data

    def to_json(self) -> bytes:
        """The pin's canonical form, unsigned: what ``pin_digest`` identifies it by."""
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
            expires_at=data.get("expires_at"),
        )


def read_restore_pin(
    objects: ObjectStore, job: str, trust: RecordTrust | None = None
) -> RestorePin | None:
    """Job ``job``'s restore pin, None if there is none; ``MalformedPin`` if it is bad; with
    ``trust``, ``RefusedPin`` unless its signature is believed (an operator's)."""
    found = read_sealed_pin(objects, job, trust)
    return None if found is None else found[0]


def read_sealed_pin(
    objects: ObjectStore, job: str, trust: RecordTrust | None = None
) -> tuple[RestorePin, Seal | None] | None:
    """``read_restore_pin``, with what ``trust`` knows of its signature (None: not asked).

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
    if trust is None:
        return pin, None
    try:
        return pin, trust.check(PIN_KIND, raw, pin.requested_at)
    except RecordRefused as exc:
        raise RefusedPin(f"refused the restore pin {key} (step {pin.step}): {exc}") from None


def write_restore_pin(objects: ObjectStore, pin: RestorePin, trust: RecordTrust = OPEN) -> None:
    """Publish ``pin``, signed when ``trust`` can sign, replacing any older pin of its job
    (the newest request wins)."""
    objects.put_bytes(pin_key(pin.job), trust.seal(PIN_KIND, pin.to_dict()))
    log.info("restore pinned job=%s step=%d", pin.job, pin.step, extra={"job": pin.job})


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
    log.info("restore pin cleared job=%s", job, extra={"job": job})
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


PinFailed = Callable[[str, int, str], object]
"""Told ``(job, step, message)`` when a used pin could not be removed (from a thread)."""
PinRefused = Callable[[str, str | None], object]
"""Told ``(job, message)`` when a pin is not an operator's and is not honoured, and
``(job, None)`` once no refused pin stands any more (from a thread); at each change only."""


_SIGN_IT = (
    "If an operator meant it, pin again signed "
    "(`mtc backups pin --operator-cert --operator-key`, docs/cli.md)"
)
_PIN_AGAIN = (
    "To roll the job back again, an operator makes a new pin (`mtc backups pin`, docs/cli.md); "
    "`mtc backups pin --clear` removes this one"
)


def pin_digest(pin: RestorePin) -> str:
    """A pin's identity: the sha256 of its canonical form (a new pin has a new request
    time, so the same step pinned again is another pin)."""
    return hashlib.sha256(pin.to_json()).hexdigest()


def used_key(job: str, digest: str) -> str:
    """Where the coordinator records that it honoured the pin ``digest`` of ``job``."""
    if not _DIGEST_RE.fullmatch(digest):
        raise MalformedPin(f"bad pin digest {digest!r:.80}")
    pin_key(job)  # checks the job name
    return f"{CONTROL_PREFIX}{job}/{USED_DIR}/{digest}.json"


def read_used_record(
    objects: ObjectStore, job: str, digest: str, trust: RecordTrust = OPEN
) -> UsedPin | None:
    """The used record of the pin ``digest`` of ``job`` if one is there and ``trust``
    believes it (a node's signature); None if none is there. One read of at most one chunk
    past ``MAX_USED_BYTES``. A record not believed or malformed is logged and counts as
    none: it cannot be told from a bucket writer's, and a writer can delete the pin anyway.
    """
    key = used_key(job, digest)
    raw = b""
    try:
        for chunk in objects.read_chunks(key):
            raw += chunk
            if len(raw) > MAX_USED_BYTES:
                break
        used = UsedPin.from_json(raw)
        trust.check(USED_PIN_KIND, raw, used.used_at)
    except ObjectNotFound:
        return None
    except (MalformedUsedRecord, RecordRefused) as exc:
        log.warning("ignoring the used-pin record %s: %s", key, exc, extra={"job": job})
        return None
    return used


def write_used_record(objects: ObjectStore, used: UsedPin, trust: RecordTrust = OPEN) -> None:
    """Record in the bucket that a pin was honoured: create-only, signed when ``trust`` can
    sign. A record already there that ``trust`` believes stays (a retry, or another
    coordinator of the job); one it does not believe (a bucket writer's), or one of another pin
    moved here, is replaced."""
    key = used_key(used.job, used.pin_digest)
    sealed = trust.seal(USED_PIN_KIND, used.to_dict())
    try:
        objects.put_bytes(key, sealed, if_absent=True)
    except PreconditionFailed:
        there = read_used_record(objects, used.job, used.pin_digest, trust)
        if there is not None and (there.job, there.pin_digest) == (used.job, used.pin_digest):
            return
        # Not believed, or another pin's record moved here: it says nothing of this pin.
        objects.put_bytes(key, sealed)
    log.info(
        "restore pin of job %s (step %d) recorded as used at %s",
        used.job,
        used.step,
        key,
        extra={"job": used.job},
    )


class StorePins:
    """The restore pins in a backup store, as the coordinator consumes them.

    A pin that is malformed or names a step no longer committed as pinned is logged and
    ignored: the round then restores the last-known-good step, and the operator sees why.
    A pin ``pin_trust`` refuses (not signed by an operator) is ignored the same way and
    ``on_refused`` hears of it, once while it stays (and when it is gone). A pin is honoured
    once: before it is deleted, a create-only used record signed by ``trust`` goes into the
    bucket (``write_used_record``) and, with ``used``, its digest into the node's store; a
    pin whose used record is believed, or whose expiry passed, is refused like an unsigned
    one, so a copy put back never rolls the job back again, even once every store is lost.
    One whose digest this node recorded is ignored quietly (its delete was refused:
    ``on_failure`` heard of that).
    """

    def __init__(
        self,
        objects: ObjectStore,
        trust: RecordTrust = OPEN,
        *,
        pin_trust: RecordTrust = OPEN,
        used: UsedPins | None = None,
        on_failure: PinFailed | None = None,
        on_refused: PinRefused | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.objects = objects
        self.clock = clock
        """Wall-clock seconds: a pin's expiry, a used record's time."""
        self.trust = trust
        """Which COMMITs are believed (a pin names one)."""
        self.pin_trust = pin_trust
        """Which pins are believed: an operator's signature."""
        self.used = used
        self.on_failure = on_failure
        self.on_refused = on_refused
        self._offered: dict[str, RestorePin] = {}
        """Per job, the pin ``pinned_step`` last answered with: the one a round used."""
        self._refused: dict[str, str] = {}
        """Per job, the refusal last reported (a pin is read at every round's listing)."""

    def pinned_step(self, job: str) -> int | None:
        """The step of the job's pin, if it is to be honoured. With no pin: one read; with
        one not used on this node: one more, its used record in the bucket."""
        try:
            pin = read_restore_pin(self.objects, job, self.pin_trust)
            if pin is None:
                self._stands(job)
                return None
            digest = pin_digest(pin)
            if self.used is not None and self.used.used(job, digest):
                self._stands(job)
                self._retry_delete(job, pin)
                return None
            used = read_used_record(self.objects, job, digest, self.trust)
            refusal = pin_refusal(job, digest, pin.expires_at, self.clock(), used)
            if refusal is not None:
                self._refuse(
                    job,
                    f"refused the restore pin {pin_key(job)} (step {pin.step}): {refusal}",
                    _PIN_AGAIN,
                )
                return None
            self._stands(job)
            resolve_restore_pin(self.objects, pin, self.trust)
        except RefusedPin as exc:
            self._refuse(job, str(exc), _SIGN_IT)
            return None
        except (PinError, ObjectStoreError) as exc:
            log.warning("ignoring the restore pin of job %s: %s", job, exc, extra={"job": job})
            return None
        self._offered[job] = pin
        return pin.step

    def _stands(self, job: str) -> None:
        """No refused pin of ``job`` stands (any more)."""
        if self._refused.pop(job, None) is not None and self.on_refused is not None:
            self.on_refused(job, None)

    def _refuse(self, job: str, reason: str, advice: str) -> None:
        message = (
            f"{reason}; not honoured: the job restores its newest good step, and nothing is "
            f"rolled back or dropped. {advice}"
        )
        if self._refused.get(job) == message:
            log.debug(
                "still ignoring the restore pin of job %s: %s", job, reason, extra={"job": job}
            )
            return
        self._refused[job] = message
        log.error("job %s: %s", job, message, extra={"job": job})
        if self.on_refused is not None:
            self.on_refused(job, message)

    def _record_used(self, job: str, pin: RestorePin) -> None:
        used = UsedPin(job, pin.step, pin_digest(pin), self.clock())
        try:
            write_used_record(self.objects, used, self.trust)
        except ObjectStoreError as exc:
            log.error(
                "cannot record the used restore pin of job %s in the bucket (%s): once every "
                "node's store is lost, a copy of it put back would be honoured again",
                job,
                exc,
                extra={"job": job},
            )

    def _retry_delete(self, job: str, pin: RestorePin) -> None:
        """A used pin is still there: never honoured again; one more try to remove it."""
        log.info(
            "restore pin of job %s (step %d) was used already; not honoured again",
            job,
            pin.step,
            extra={"job": job},
        )
        try:
            clear_restore_pin(self.objects, job, expected=pin)
        except ObjectStoreError as exc:
            log.debug(
                "cannot remove the used restore pin of job %s: %s", job, exc, extra={"job": job}
            )

    def consumed(self, job: str, step: int) -> None:
        pin = self._offered.pop(job, None)
        recorded = False
        try:
            if pin is None or pin.step != step:
                pin = read_restore_pin(self.objects, job)
            if pin is None or pin.step != step:
                return
            # First, in the bucket: a copy of the pin put back after every store was lost
            # must not roll the job back again.
            self._record_used(job, pin)
            if self.used is not None:
                # First: should the delete fail, the pin is still used up.
                try:
                    self.used.record(job, pin_digest(pin))
                    recorded = True
                except OSError as exc:
                    log.error(
                        "cannot record the used restore pin of job %s: %s",
                        job,
                        exc,
                        extra={"job": job},
                    )
            clear_restore_pin(self.objects, job, expected=pin)
        except (PinError, ObjectStoreError) as exc:
            message = (
                f"cannot remove the used restore pin {pin_key(job)} (step {step}): {exc}; "
                + (
                    "it is recorded as used on this node and not honoured again here; "
                    if recorded
                    else ""
                )
                + "delete it (mtc backups pin URL --job JOB --clear) or let the daemon "
                "delete it (docs/permissions.md)"
            )
            log.warning("%s", message)
            if self.on_failure is not None:
                self.on_failure(job, step, message)
