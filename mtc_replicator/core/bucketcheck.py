"""Whether a backup or registry location can be used, as readiness and jobs see it. Pure.

At start, and again while it is not usable, the daemon probes each location it was given
(``storage.probe``: a listing, a read and a create-only write, each a ``Right`` this node
uses) and records the outcome here; a refused step's reason names the permission it needs
(``refused_reason``). Two kinds of failure differ in what they
do to a job: a refusal (no or wrong credentials, no permission, no such bucket) does not
heal by retrying, so a job that needs the location is refused at once with the reason
(``replicator.failed``) instead of waiting 300 s for a round that cannot finish; an
unreachable store (a timeout, a reset, a 5xx) may heal, so it is retried with backoff and
jobs wait as before. Both make the daemon not ready, with the reason.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlparse

from mtc_replicator.core.retry import Backoff

RECHECK_REFUSED_SECONDS = 300.0
"""How often a refused location is probed again: retrying does not heal it, but an
operator who fixes the credentials or the policy should not have to restart every node."""
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 60.0


class Right(enum.Enum):
    """What a probe step tried under the location's prefix; each is needed by every node
    (listing the committed steps, reading manifests and the registry, uploading items,
    committing and registering)."""

    LIST = "list"
    READ = "read"
    WRITE = "write"


PERMISSIONS: dict[str, dict[Right, str]] = {
    "s3": {Right.LIST: "s3:ListBucket", Right.READ: "s3:GetObject", Right.WRITE: "s3:PutObject"},
    "gs": {
        Right.LIST: "storage.objects.list",
        Right.READ: "storage.objects.get",
        Right.WRITE: "storage.objects.create",
    },
    "file": {
        Right.LIST: "read and search permission on the directory",
        Right.READ: "read permission on the directory's files",
        Right.WRITE: "write permission on the directory",
    },
}
"""The permission each probe step needs, per URL scheme (docs/permissions.md)."""


def refused_reason(
    url: str, right: Right, error: str, *, denied: bool, no_credentials: bool = False
) -> str:
    """The reason a refused probe step gives: ``error``, and when the store denied it
    (rather than, say, finding no bucket) the right and the permission it needs. Without
    any credentials no request was made, so no permission is named: ``error`` says which
    credential sources were tried."""
    if not denied or no_credentials:
        return error
    known = PERMISSIONS.get(urlparse(url).scheme, {})
    needs = known.get(right, "a permission the store did not name")
    return f"{error} (this node may not {right.value} under the prefix: it needs {needs})"


def may_heal(right: Right, *, transient: bool, denied: bool) -> bool:
    """Whether a failed probe step is retried with backoff rather than refused: a transient
    error, and a write that failed for any reason but a denial (a full ``file://`` disk, a
    store that will not take the conditional write now): the listing and the read already
    showed the bucket and the credentials, and only a missing permission is a
    configuration to fix."""
    return transient or (right is Right.WRITE and not denied)


class Verdict(enum.Enum):
    UNCHECKED = "unchecked"
    USABLE = "usable"
    REFUSED = "refused"
    """Credentials, permission or the bucket itself: fix the configuration."""
    UNREACHABLE = "unreachable"
    """A failure a retry may heal."""


@dataclass
class BucketCheck:
    """One location's state; ``record`` takes each probe's outcome and says when to probe
    next (seconds from now), ``readiness`` and ``refusal`` say what it means."""

    url: str
    what: str
    """``backup`` or ``registry``: which flag named it."""
    verdict: Verdict = Verdict.UNCHECKED
    reason: str = ""
    backoff: Backoff | None = None

    def record(self, error: str | None, *, transient: bool) -> float | None:
        """The outcome of one probe (``error`` None: it worked); seconds until the next
        probe, None when none is needed."""
        if error is None:
            self.verdict, self.reason, self.backoff = Verdict.USABLE, "", None
            return None
        self.reason = error
        if not transient:
            self.verdict, self.backoff = Verdict.REFUSED, None
            return RECHECK_REFUSED_SECONDS
        self.verdict = Verdict.UNREACHABLE
        if self.backoff is None:
            self.backoff = Backoff(FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
        return self.backoff.next()

    def readiness(self) -> str | None:
        """None when usable; else the line ``/readyz`` shows."""
        if self.verdict is Verdict.USABLE:
            return None
        if self.verdict is Verdict.UNCHECKED:
            return f"{self.what} {self.url}: not checked yet"
        if self.verdict is Verdict.REFUSED:
            return f"{self.what} {self.url} refused: {self.reason}; {REMEDY}"
        return f"{self.what} {self.url} unreachable, retrying: {self.reason}"

    def refusal(self) -> str | None:
        """Why a job that needs this location cannot run here, when retrying cannot help."""
        if self.verdict is not Verdict.REFUSED:
            return None
        return f"the {self.what} location {self.url} cannot be used: {self.reason}"


REMEDY = (
    "give the daemon credentials that may list, read and create objects under the "
    "bucket's prefix (docs/permissions.md); it checks again every 5 minutes"
)
