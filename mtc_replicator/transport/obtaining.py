"""Items this node's restore round is obtaining now, as its peer service answers pulls of them.

No I/O; shared by ``cluster.rounds`` (which writes it) and ``transport.peer_servicer`` (which
reads it), both in the daemon's event loop. With a fan-out restore (``core.restore_plan``,
``Fetch.pending``) other ranks pull an item from this node while this node is still
downloading it from the backup: they are told to try again shortly while it comes
(``IN_PROGRESS``), and at once when it will not (``GAVE_UP``), so they fall back to the
backup promptly instead of after a timeout. Entries exist only for the items of one rank's
current plan, so the table is bounded by that plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from mtc_replicator.core.manifest import ItemId


class Obtain(Enum):
    IN_PROGRESS = "in progress"
    """Being obtained, or still to be in this plan: a pull should try again shortly."""
    GAVE_UP = "gave up"
    """This node tries no source that others could wait on any more: pull elsewhere."""


class Obtaining:
    """What this node's current restore round still obtains, item by item."""

    def __init__(self) -> None:
        self._state: dict[ItemId, Obtain] = {}

    def state(self, item: ItemId) -> Obtain | None:
        """None: not part of this node's current round (or already committed)."""
        return self._state.get(item)

    def mark(self, items: Iterable[ItemId], state: Obtain) -> None:
        for item in items:
            self._state[item] = state

    def done(self, items: Iterable[ItemId]) -> None:
        """Forget ``items``: committed (the store serves it) or no longer planned."""
        for item in items:
            self._state.pop(item, None)

    def clear(self) -> None:
        self._state.clear()
