"""Whether this node reaches each of its peers: the outcome of the last contact. Pure.

Every call to a peer (a push, a pull, a listing, a health probe) ends in one of two ways
that matter to an operator: the peer answered (whatever it said: refusing a push is an
answer) or it could not be reached (no connection, no answer in time). ``Contacts`` keeps
the last of those per peer address, with the time of the last answer, for ``mtc status``
and the ``mtc_peer_*`` metrics. Times are given by the caller (no clock here).

Peers are addressed by pod IP: a peer that restarts elsewhere, or a source a restore pulled
from once, leaves an address that is never called again. A contact not refreshed within
``MAX_AGE`` is dropped, so that such an address does not read "unreachable" for ever.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PEERS = 1024
"""Peers remembered at once; the oldest contact goes first (addresses change on restarts)."""
MAX_AGE = 30.0
"""Seconds after which a contact not refreshed is forgotten: a few periods of the daemon's
health probe of the running job's peers (5 s, ``node.status.PROBE_EVERY``), which refreshes
every current peer's contact, its timeout included."""
MAX_ERROR = 300
"""Characters of a failure's reason kept (a peer's message is not ours to store whole)."""


@dataclass(frozen=True)
class Contact:
    """The last contact with one peer."""

    peer: str
    """Its address, HOST:PORT."""
    reachable: bool
    """Whether it answered the last time it was called."""
    at: float
    """When that last call ended (unix seconds)."""
    last_answer_at: float | None
    """When it last answered at all (unix seconds); None: never, since this daemon started."""
    error: str | None
    """Why the last call did not reach it (None when it did)."""


class Contacts:
    """The last contact per peer address."""

    def __init__(self, max_peers: int = MAX_PEERS, max_age: float = MAX_AGE) -> None:
        self.max_peers = max_peers
        self.max_age = max_age
        self._by_peer: dict[str, Contact] = {}

    def answered(self, peer: str, at: float) -> None:
        self._put(Contact(peer, True, at, at, None))

    def unreachable(self, peer: str, at: float, error: str) -> None:
        old = self._by_peer.get(peer)
        last = old.last_answer_at if old is not None else None
        self._put(Contact(peer, False, at, last, error[:MAX_ERROR]))

    def _put(self, contact: Contact) -> None:
        self._by_peer.pop(contact.peer, None)  # re-inserted last: the dict stays in time order
        self._by_peer[contact.peer] = contact
        while len(self._by_peer) > self.max_peers:
            del self._by_peer[next(iter(self._by_peer))]
        self.expire(contact.at)

    def expire(self, now: float) -> None:
        """Forget the contacts older than ``max_age`` at ``now`` (the caller's thread only)."""
        while self._by_peer:
            oldest = next(iter(self._by_peer.values()))
            if oldest.at >= now - self.max_age:
                break
            del self._by_peer[oldest.peer]

    def get(self, peer: str) -> Contact | None:
        return self._by_peer.get(peer)

    def snapshot(self, now: float) -> list[Contact]:
        """Every contact refreshed within ``max_age`` of ``now``, by peer address (a copy,
        nothing removed: safe to read from another thread)."""
        fresh = [c for c in self._by_peer.copy().values() if c.at >= now - self.max_age]
        return sorted(fresh, key=lambda c: c.peer)
