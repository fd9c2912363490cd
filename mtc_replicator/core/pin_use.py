"""When a restore pin is no longer to be honoured: used already, or expired. Pure.

A pin is honoured once. The node's store keeps a record of the pins it used
(``local.usedpins``), but a store lives on a RAM disk: once every node lost it, a replayed
pin (a bucket writer copying the same signed bytes back) would roll the job back again.
So the coordinator also writes a **used record** into the bucket, create-only, beside the
pin (``_control/<job>/used-pins/<pin digest>.json``), signed by its node like a ``COMMIT``
(kind ``used-restore-pin``). A pin whose used record is there and believed is refused,
whatever the stores hold. An operator may also give a pin an expiry (``expires_at``); an
expired pin is refused the same way.

This module is the record's format and the rule (``pin_refusal``); reading and writing it
is ``storage.restore_pins``.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.jsonobj import NotAnObject, load_object

USED_FORMAT_VERSION = 1
MAX_USED_BYTES = 24 * 1024
"""A used record is about 250 bytes, 1-3 KiB signed."""
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class MalformedUsedRecord(ValueError):
    """A used record breaks a rule (anyone with bucket access may have written it)."""


def _good_time(at: object) -> bool:
    if not isinstance(at, int | float) or isinstance(at, bool):
        return False
    try:
        return math.isfinite(at) and at >= 0
    except OverflowError:  # an int beyond any float
        return False


@dataclass(frozen=True)
class UsedPin:
    """The pin ``pin_digest`` of ``job`` (step ``step``) was honoured at ``used_at``."""

    job: str
    step: int
    pin_digest: str
    used_at: float
    """Wall-clock seconds when the coordinator recorded it; the signature is checked then."""

    def __post_init__(self) -> None:
        if not is_job_name(self.job):
            raise MalformedUsedRecord(f"bad job name {self.job!r:.80}")
        if type(self.step) is not int or self.step < 0:
            raise MalformedUsedRecord(f"bad step {self.step!r:.40}")
        if not isinstance(self.pin_digest, str) or not _DIGEST_RE.fullmatch(self.pin_digest):
            raise MalformedUsedRecord(f"bad pin digest {self.pin_digest!r:.80}")
        if not _good_time(self.used_at):
            raise MalformedUsedRecord(f"bad time {self.used_at!r:.40}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": USED_FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "pin_digest": self.pin_digest,
            "used_at": self.used_at,
        }

    @classmethod
    def from_json(cls, raw: bytes) -> UsedPin:
        """Parse a used record (its signature is the reader's to check)."""
        try:
            data = load_object(raw, MAX_USED_BYTES)
        except NotAnObject as exc:
            raise MalformedUsedRecord(str(exc)) from None
        version = data.get("version")
        if type(version) is not int or version != USED_FORMAT_VERSION:
            raise MalformedUsedRecord(f"unsupported version {version!r:.40}")
        missing = [k for k in ("job", "step", "pin_digest", "used_at") if k not in data]
        if missing:
            raise MalformedUsedRecord(f"missing {', '.join(missing)}")
        return cls(data["job"], data["step"], data["pin_digest"], data["used_at"])


def good_expiry(expires_at: object) -> bool:
    """Whether ``expires_at`` can be a pin's expiry (None: the pin has none)."""
    return expires_at is None or _good_time(expires_at)


def utc(at: float) -> str:
    """``at`` (wall-clock seconds) as an ISO 8601 UTC time, for messages."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    except (OverflowError, OSError, ValueError):
        return f"{at:.0f} s after the epoch"


def pin_refusal(
    job: str,
    digest: str,
    expires_at: float | None,
    now: float,
    used: UsedPin | None,
) -> str | None:
    """Why the pin ``digest`` of ``job`` is not honoured (None: it may be).

    ``used`` is the believed used record found at the pin's digest, if any: one that names
    another job or pin (moved there from another pin's key) says nothing of this one.
    """
    if used is not None and used.job == job and used.pin_digest == digest:
        return (
            f"it was used already (honoured at {utc(used.used_at)}, step {used.step}), and a "
            "pin is honoured once: a copy put back rolls nothing back"
        )
    if expires_at is not None and now >= expires_at:
        return f"it expired at {utc(expires_at)}"
    return None
