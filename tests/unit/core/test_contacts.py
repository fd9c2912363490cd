"""``core.contacts``: the last contact per peer."""

from __future__ import annotations

from mtc_replicator.core.contacts import Contacts


def test_the_last_outcome_wins_and_the_last_answer_is_kept() -> None:
    c = Contacts()
    assert c.get("a:1") is None
    c.answered("a:1", 10.0)
    c.unreachable("a:1", 20.0, "UNAVAILABLE: connection refused")
    got = c.get("a:1")
    assert got is not None
    assert (got.reachable, got.at, got.last_answer_at) == (False, 20.0, 10.0)
    assert got.error == "UNAVAILABLE: connection refused"
    c.answered("a:1", 30.0)
    got = c.get("a:1")
    assert got is not None
    assert (got.reachable, got.last_answer_at, got.error) == (True, 30.0, None)


def test_never_answered_and_bounded() -> None:
    c = Contacts(max_peers=2)
    c.unreachable("a:1", 1.0, "x" * 1000)
    first = c.get("a:1")
    assert first is not None
    assert first.last_answer_at is None
    assert len(first.error or "") == 300
    c.answered("b:1", 2.0)
    c.answered("c:1", 3.0)
    assert [x.peer for x in c.snapshot(3.0)] == ["b:1", "c:1"]  # the oldest went


def test_a_contact_not_refreshed_is_forgotten() -> None:
    """A peer that moved (a new pod IP) leaves its old address behind: it must not read
    "unreachable" for ever (the alert on mtc_peer_reachable == 0 would never clear)."""
    c = Contacts(max_age=30.0)
    c.unreachable("10.0.0.2:7070", 100.0, "UNAVAILABLE")  # the peer's old pod
    c.answered("10.0.0.9:7070", 100.0)
    assert [x.peer for x in c.snapshot(120.0)] == ["10.0.0.2:7070", "10.0.0.9:7070"]
    c.answered("10.0.0.9:7070", 125.0)  # the current peer, probed every few seconds
    assert [x.peer for x in c.snapshot(131.0)] == ["10.0.0.9:7070"]  # the old one is stale
    assert c.get("10.0.0.2:7070") is not None  # a read takes nothing away
    c.answered("10.0.0.9:7070", 131.0)  # the next refresh drops it from the table
    assert c.get("10.0.0.2:7070") is None
    assert c.get("10.0.0.9:7070") is not None
    c.expire(1000.0)
    assert c.snapshot(1000.0) == []
