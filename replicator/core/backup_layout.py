"""Where backups live in a bucket, and the COMMIT record that makes a step restorable. Pure.

Layout below the backup URL (docs/architecture.md, "Backups")::

    <job>/<step>/<rank>-<worker>/<files...>        item data (``data`` for a file item)
    <job>/<step>/<rank>-<worker>.manifest.json     written after the item's files
    <job>/<step>/COMMIT                            written last, create-only

Only a step with a ``COMMIT`` is restorable; the COMMIT pins each item's manifest digest,
so an object changed after the commit is detected.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass

from replicator.core.contract import JOB_NAME_RE
from replicator.core.manifest import ItemId, ManifestError

COMMIT = "COMMIT"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_ITEM_KEY_RE = re.compile(r"[0-9]+-[0-9]+")


def step_prefix(job: str, step: int) -> str:
    return f"{job}/{step}/"


def manifest_key(item: ItemId) -> str:
    return f"{step_prefix(item.job, item.step)}{item.key}.manifest.json"


def data_key(item: ItemId, path: str) -> str:
    return f"{step_prefix(item.job, item.step)}{item.key}/{path or 'data'}"


def commit_key(job: str, step: int) -> str:
    return f"{step_prefix(job, step)}{COMMIT}"


@dataclass(frozen=True)
class CommitRecord:
    """A committed backup step: the manifest digest of every item, and when it was made."""

    job: str
    step: int
    items: dict[str, str]
    created: float

    def body(self) -> dict[str, object]:
        """The record's fields, as stored (and signed: ``core.signed``)."""
        return {"job": self.job, "step": self.step, "items": self.items, "created": self.created}

    def to_json(self) -> bytes:
        return json.dumps(self.body(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> CommitRecord:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"COMMIT is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ManifestError("COMMIT must be a JSON object")
        job, step, items, created = (data.get(k) for k in ("job", "step", "items", "created"))
        if not isinstance(job, str) or not JOB_NAME_RE.fullmatch(job):
            raise ManifestError(f"COMMIT has a bad job {job!r:.80}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ManifestError(f"COMMIT has a bad step {step!r:.40}")
        when = math.nan
        if isinstance(created, int | float) and not isinstance(created, bool):
            with contextlib.suppress(OverflowError):  # an int past any float
                when = float(created)
        if not math.isfinite(when):  # NaN and infinities parse as JSON numbers too
            raise ManifestError(f"COMMIT has a bad timestamp {created!r:.40}")
        if not isinstance(items, dict) or not all(
            isinstance(k, str)
            and _ITEM_KEY_RE.fullmatch(k)
            and isinstance(v, str)
            and _DIGEST_RE.fullmatch(v)
            for k, v in items.items()
        ):
            raise ManifestError("COMMIT has a malformed item list")
        return cls(job, step, dict(items), when)

    def has(self, item: ItemId) -> bool:
        return item.job == self.job and item.step == self.step and item.key in self.items
