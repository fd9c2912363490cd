"""Whether this node's store still belongs to the namespace that holds the node: the rule of
a node handoff. Pure, no I/O.

The CSI plugin hands a node's CHECKPOINT_DIR to another namespace's pod only once no pod of
the last one holds it, and rewrites ``owner.json`` before that pod starts. The store beside
CHECKPOINT_DIR outlives the pods, so it remembers whose items it holds (``store-owner``,
written by the daemon). Before a handshake is acted on, before a saved incarnation is
resumed and before the Peer server starts, the daemon compares the two: a store of another
namespace is emptied (and its record rewritten) first, so nothing of the previous owner's
is restored into, listed for or served on behalf of the new owner's pods. The previous
owner's copies on other nodes and in the bucket are not this node's to touch.
"""

from __future__ import annotations

import enum

from mtc_replicator.core.ownership import BadOwner, check_owner

MAX_RECORD_BYTES = 256
"""A namespace is at most 63 characters; anything longer is not a record we wrote."""


class NoRecord(enum.Enum):
    """Why the store names no owner."""

    MISSING = "missing"
    """Never written: a new store, or one from before the rule."""
    MALFORMED = "malformed"
    """Not a record we wrote: nobody can say whose the items are."""


class StoreHandoff(enum.Enum):
    KEEP = "keep"
    """The store's items are the current owner's."""
    ADOPT = "adopt"
    """The store has no record (a new store, or one written before the rule): the current
    owner's from now on. The upgrade path, as with unowned registry entries."""
    PURGE = "purge"
    """The node changed hands: the previous owner's items go before anything reads them."""


def decide_handoff(recorded: str | NoRecord, current: str) -> StoreHandoff:
    """What to do with the store whose record says ``recorded`` on a node that ``current``
    holds now. A malformed record protects nobody's items: they go."""
    if recorded is NoRecord.MISSING:
        return StoreHandoff.ADOPT
    if recorded == current:
        return StoreHandoff.KEEP
    return StoreHandoff.PURGE


def owner_record(namespace: str) -> bytes:
    """The bytes of ``store-owner`` for ``namespace``."""
    return (check_owner(namespace) + "\n").encode()


def parse_owner_record(raw: bytes) -> str:
    """The namespace a ``store-owner`` names; raises ``BadOwner`` when it is not a record we
    wrote (``NoRecord.MALFORMED``: the store is emptied)."""
    if len(raw) > MAX_RECORD_BYTES or not raw.endswith(b"\n"):
        raise BadOwner(f"not a store owner record: {raw[:80]!r}")
    try:
        text = raw[:-1].decode("ascii")
    except UnicodeDecodeError:
        raise BadOwner(f"not a store owner record: {raw[:80]!r}") from None
    return check_owner(text)
