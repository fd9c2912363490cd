"""A cheap check that a store can be used: the daemon's start-up and readiness probe. I/O.

Three requests under the store's prefix, each a right every node uses: one listing of an
empty prefix (the bucket exists, the credentials work, listing is allowed), one HEAD of an
absent key (reading is allowed: S3 answers 403 rather than 404 without it), and one
create-only write of a fixed probe object (``PROBE_KEY``; S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``, ``file://`` a link that fails if the name exists). The write
needs no delete, which a least-privilege role (docs/permissions.md) does not have: created
or already there ("precondition failed") both mean the write was allowed, as the store
checks permission before the precondition (moto's S3 server does too: shown in
tests/integration/test_bucket_permissions.py); only a refusal means it was not. The object
stays, one line under the prefix: created by the first probe of a location, and every
later probe is answered "precondition failed" and writes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mtc_replicator.core.bucketcheck import Right
from mtc_replicator.storage.objectstore import (
    NoCredentials,
    ObjectStore,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
)

PROBE_PREFIX = "_mtc-probe/"
"""Under the store's prefix; never a job's (a job name starts with a letter or digit)."""
PROBE_KEY = PROBE_PREFIX + "writable"
"""The one object the probe creates, if absent; safe to delete (the next probe writes it
again)."""
PROBE_BODY = b"mtc-replicator's probe of the right to write here; safe to delete\n"


class ProbeFailed(ObjectStoreError):
    """A probe step failed: ``right`` says which, ``cause`` how (the store's error)."""

    def __init__(self, right: Right, cause: ObjectStoreError) -> None:
        super().__init__(str(cause))
        self.right = right
        self.cause = cause
        self.transient = cause.transient

    @property
    def denied(self) -> bool:
        """The store refused the request itself (no or wrong credentials, no permission)."""
        return isinstance(self.cause, PermissionDenied)

    @property
    def no_credentials(self) -> bool:
        """No request was made: the SDK found no credentials to make one with."""
        return isinstance(self.cause, NoCredentials)


@contextlib.contextmanager
def _step(right: Right) -> Iterator[None]:
    try:
        yield
    except ProbeFailed:
        raise
    except ObjectStoreError as exc:
        raise ProbeFailed(right, exc) from exc


def probe(store: ObjectStore) -> None:
    """Raise ``ProbeFailed`` unless the store can be listed, read and written."""
    with _step(Right.LIST):
        next(iter(store.list(PROBE_PREFIX)), None)
    with _step(Right.READ):
        store.head(PROBE_PREFIX + "absent")
    with _step(Right.WRITE), contextlib.suppress(PreconditionFailed):
        store.put_bytes(PROBE_KEY, PROBE_BODY, if_absent=True)
