"""``core.contacts``: the last contact per peer."""

from __future__ import annotations

from replicator.core.contacts import Contacts


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
    assert [x.peer for x in c.snapshot()] == ["b:1", "c:1"]  # the oldest went
