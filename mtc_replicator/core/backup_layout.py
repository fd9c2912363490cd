"""Where backups live in a bucket, and the COMMIT record that makes a step restorable. Pure.

Layout v2 below the backup URL (docs/architecture.md, "Backups"), written since v2::

    <job>/<step>/<hh>/<rank>-<worker>/<files...>     item data (``data`` for a file item)
    <job>/<step>/<hh>/<rank>-<worker>.manifest.json  written after the item's files
    <job>/<step>/COMMIT                              written last, create-only

``hh`` is two hex digits of the sha256 of ``<rank>-<worker>``: the ranks of a step, which
upload and restore together, spread over 256 key ranges instead of one run of sequential
names, as S3's (per-prefix request rates) and GCS's (no sequential names; a hash early in
the name) request-rate guidance asks. Layout v1 (no ``<hh>/``) is what earlier versions
wrote; it is still read, listed, verified and pruned. The COMMIT names its step's layout
(``layout``, absent for v1) inside its signed body.

Only a step with a ``COMMIT`` is restorable; the COMMIT pins each item's manifest digest,
so an object changed after the commit is detected.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from dataclasses import dataclass

from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.manifest import ItemId, ManifestError

COMMIT = "COMMIT"
LAYOUT_V1 = 1
"""``<job>/<step>/<rank>-<worker>...``: every version before layouts had a number."""
LAYOUT_V2 = 2
"""``<job>/<step>/<hh>/<rank>-<worker>...``: items spread over 256 prefixes."""
LAYOUT = LAYOUT_V2
"""What new uploads write."""
LAYOUTS = (LAYOUT_V2, LAYOUT_V1)
"""Every layout this version reads, the one it writes first (the order a reader that
does not know a step's layout tries them in)."""
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_ITEM_KEY_RE = re.compile(r"[0-9]+-[0-9]+")
_MANIFEST_SUFFIX = ".manifest.json"
_MANIFEST_NAME_RE = re.compile(r"(?:([0-9a-f]{2})/)?([0-9]+-[0-9]+)\.manifest\.json")


def step_prefix(job: str, step: int) -> str:
    return f"{job}/{step}/"


def shard(item_key: str) -> str:
    """The two hex digits that spread ``<rank>-<worker>`` over 256 prefixes (layout v2).

    A hash, not ``rank % 256``: neighbouring ranks land far apart in key order, so no
    key range sees a run of sequential names. Stable across versions by definition.
    """
    return hashlib.sha256(item_key.encode()).hexdigest()[:2]


def item_prefix(item: ItemId, layout: int = LAYOUT) -> str:
    """Where the item's objects start: ``<job>/<step>/[<hh>/]<rank>-<worker>``."""
    base = step_prefix(item.job, item.step)
    if layout == LAYOUT_V1:
        return f"{base}{item.key}"
    if layout == LAYOUT_V2:
        return f"{base}{shard(item.key)}/{item.key}"
    raise ManifestError(f"unknown backup layout {layout!r:.20}")


def manifest_key(item: ItemId, layout: int = LAYOUT) -> str:
    return f"{item_prefix(item, layout)}{_MANIFEST_SUFFIX}"


def data_key(item: ItemId, path: str, layout: int = LAYOUT) -> str:
    return f"{item_prefix(item, layout)}/{path or 'data'}"


def manifest_item_key(name: str) -> str | None:
    """The ``<rank>-<worker>`` of a manifest named ``name`` below its step's prefix, in
    either layout (a v2 name only with its item's own ``<hh>``); None for anything else."""
    m = _MANIFEST_NAME_RE.fullmatch(name)
    if m is None or (m.group(1) is not None and m.group(1) != shard(m.group(2))):
        return None
    return m.group(2)


def item_key_of(job: str, key: str) -> str | None:
    """The ``<rank>-<worker>`` whose data ``key`` is, in either layout (a v2 key only below
    its item's own ``<hh>``); None for a key that is not item data of ``job``."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] != job or not parts[1].isascii() or not parts[1].isdigit():
        return None
    if _ITEM_KEY_RE.fullmatch(parts[2]):
        return parts[2]
    if len(parts) >= 5 and _ITEM_KEY_RE.fullmatch(parts[3]) and parts[2] == shard(parts[3]):
        return parts[3]
    return None


def commit_key(job: str, step: int) -> str:
    return f"{step_prefix(job, step)}{COMMIT}"


@dataclass(frozen=True)
class CommitRecord:
    """A committed backup step: the manifest digest of every item, when it was made, and
    where its objects are (``layout``)."""

    job: str
    step: int
    items: dict[str, str]
    created: float
    layout: int = LAYOUT
    owner: str | None = None
    """The owner every item's attestation names (``core.attestation``); None in a COMMIT
    of items without one (written before attestations, or unowned)."""

    def body(self) -> dict[str, object]:
        """The record's fields, as stored (and signed: ``core.signed``). A v1 record has no
        ``layout``, byte for byte what the versions before layouts wrote."""
        body: dict[str, object] = {
            "job": self.job,
            "step": self.step,
            "items": self.items,
            "created": self.created,
        }
        if self.layout != LAYOUT_V1:
            body["layout"] = self.layout
        if self.owner is not None:
            body["owner"] = self.owner
        return body

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
        if not is_job_name(job):
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
        layout = data.get("layout", LAYOUT_V1)
        if not isinstance(layout, int) or isinstance(layout, bool) or layout not in LAYOUTS:
            # A newer version's layout: refusing beats looking for objects in the wrong place.
            raise ManifestError(f"COMMIT has an unknown layout {layout!r:.20}")
        owner = data.get("owner")
        if owner is not None and not (isinstance(owner, str) and len(owner) <= 253):
            raise ManifestError(f"COMMIT has a bad owner {owner!r:.80}")
        return cls(job, step, dict(items), when, layout, owner)

    def manifest_key(self, item: ItemId) -> str:
        return manifest_key(item, self.layout)

    def data_key(self, item: ItemId, path: str) -> str:
        return data_key(item, path, self.layout)

    def has(self, item: ItemId) -> bool:
        return item.job == self.job and item.step == self.step and item.key in self.items
