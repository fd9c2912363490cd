"""A cheap check that a store can be used: the daemon's start-up and readiness probe. I/O.

One listing of an empty prefix (the bucket exists, the credentials work, listing under the
prefix is allowed) and one HEAD of an absent key (reading under the prefix is allowed: S3
answers 403 rather than 404 without it). Nothing is written: a least-privilege role
(docs/permissions.md) may not delete what a probe would leave behind, so the right to
write is found at the first upload, as before.
"""

from __future__ import annotations

from mtc_replicator.storage.objectstore import ObjectStore

PROBE_PREFIX = "_mtc-probe/"
"""Under the store's prefix, never written: listing it and reading an absent key in it
costs one request each."""


def probe(store: ObjectStore) -> None:
    """Raise the store's ``ObjectStoreError`` unless it can be listed and read."""
    next(iter(store.list(PROBE_PREFIX)), None)
    store.head(PROBE_PREFIX + "absent")
