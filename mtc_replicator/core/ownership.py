"""Who a job belongs to: the owner file the CSI plugin writes, and the claim rules. Pure.

A job's owner is the Kubernetes namespace of the pod that published this node's
CHECKPOINT_DIR. The CSI plugin writes it to ``owner.json`` outside the pod's volume, with
the values kubelet hands it (podInfoOnMount), so a pod cannot choose it. An empty owner
means "unowned": a daemon without ``--owner-file`` (local runs, the demo) or an entry
written before owners existed. The rules (SECURITY.md, "A job belongs to its namespace"):

- a registry entry may be replaced only by a rank 0 of the same owner; an unowned entry
  records nobody and may be claimed by anyone (the upgrade path);
- a coordinator admits only joins of its own job's owner.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mtc_replicator.core.jsonobj import NotAnObject, load_object

UNOWNED = ""
"""The owner of a job whose daemon has no ``--owner-file``."""
MAX_OWNER_FILE_BYTES = 4096
NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace: an RFC 1123 label."""
_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
"""Pod and service account names: RFC 1123 subdomains."""
_UID_RE = re.compile(r"[0-9a-fA-F-]{1,64}")
_FIELDS = ("namespace", "pod", "pod_uid", "service_account", "published_at")


class BadOwner(ValueError):
    """An owner file or owner field breaks a rule; the message names it."""


def check_owner(owner: object) -> str:
    """``owner`` as a namespace, or ``UNOWNED``; raises ``BadOwner`` otherwise."""
    if not isinstance(owner, str) or (owner and not NAMESPACE_RE.fullmatch(owner)):
        raise BadOwner(f"bad owner namespace {owner!r:.80}")
    return owner


@dataclass(frozen=True)
class Owner:
    """The pod that published this node's CHECKPOINT_DIR, as kubelet told the CSI plugin."""

    namespace: str
    """The owner of every job this node's pod runs: what registry entries and joins carry."""
    pod: str
    pod_uid: str
    service_account: str
    published_at: float
    """Wall-clock seconds of the publish (for diagnostics)."""

    def __post_init__(self) -> None:
        if not self.namespace:
            raise BadOwner("namespace is empty")
        check_owner(self.namespace)
        for name, value, pattern in (
            ("pod", self.pod, _NAME_RE),
            ("pod_uid", self.pod_uid, _UID_RE),
            ("service_account", self.service_account, _NAME_RE),
        ):
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise BadOwner(f"bad {name} {value!r:.80}")
        at = self.published_at
        number = isinstance(at, int | float) and not isinstance(at, bool)
        if not number or not math.isfinite(at) or at < 0:
            raise BadOwner(f"bad published_at {at!r:.40}")


def parse_owner(raw: bytes) -> Owner:
    """Parse ``owner.json``; every field is required and checked."""
    try:
        data = load_object(raw, MAX_OWNER_FILE_BYTES)
    except NotAnObject as exc:
        raise BadOwner(str(exc)) from None
    missing = [k for k in _FIELDS if k not in data]
    if missing:
        raise BadOwner(f"missing {', '.join(missing)}")
    return Owner(*(data[k] for k in _FIELDS))


def may_claim(entry_owner: str | None, claimant: str) -> bool:
    """Whether a rank 0 of ``claimant`` may replace a registry entry owned by ``entry_owner``
    (None: there is no readable entry).

    An unowned entry names nobody, so it protects nobody: any claimant takes it, which is
    how jobs registered before owners existed get their owner at the first registration
    after the upgrade. An unowned claimant never takes an owned entry.
    """
    return entry_owner is None or entry_owner in (UNOWNED, claimant)


def may_join(job_owner: str, member_owner: str) -> bool:
    """Whether a coordinator of a job owned by ``job_owner`` admits a member of
    ``member_owner``: only its own (unowned admits unowned)."""
    return job_owner == member_owner
