"""``transport.obtaining``: the table a restore round writes and the peer service reads, so a
pull of an item this node is still fetching is told to wait (``IN_PROGRESS``) or to go
elsewhere (``GAVE_UP``), and an item it no longer fetches is not in it."""

from __future__ import annotations

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.transport.obtaining import Obtain, Obtaining

A = ItemId("job", 10, 1, 0)
B = ItemId("job", 10, 2, 0)
C = ItemId("job", 20, 1, 0)


def test_an_item_never_marked_is_not_part_of_the_round() -> None:
    assert Obtaining().state(A) is None


def test_marked_items_answer_their_state_and_others_stay_unknown() -> None:
    obtaining = Obtaining()
    obtaining.mark([A, B], Obtain.IN_PROGRESS)
    assert obtaining.state(A) is Obtain.IN_PROGRESS
    assert obtaining.state(B) is Obtain.IN_PROGRESS
    assert obtaining.state(C) is None


def test_a_later_mark_replaces_the_state_of_those_items_only() -> None:
    obtaining = Obtaining()
    obtaining.mark([A, B], Obtain.IN_PROGRESS)
    obtaining.mark([B], Obtain.GAVE_UP)
    assert obtaining.state(A) is Obtain.IN_PROGRESS
    assert obtaining.state(B) is Obtain.GAVE_UP
    # A round that falls back to a source others can wait on again says so.
    obtaining.mark([B], Obtain.IN_PROGRESS)
    assert obtaining.state(B) is Obtain.IN_PROGRESS


def test_mark_takes_any_iterable_once() -> None:
    obtaining = Obtaining()
    obtaining.mark(iter([A, C]), Obtain.GAVE_UP)  # a generator is consumed once
    assert obtaining.state(A) is Obtain.GAVE_UP
    assert obtaining.state(C) is Obtain.GAVE_UP


def test_done_forgets_the_named_items_whatever_their_state() -> None:
    obtaining = Obtaining()
    obtaining.mark([A], Obtain.IN_PROGRESS)
    obtaining.mark([B], Obtain.GAVE_UP)
    obtaining.mark([C], Obtain.IN_PROGRESS)
    obtaining.done([A, B])
    assert obtaining.state(A) is None
    assert obtaining.state(B) is None
    assert obtaining.state(C) is Obtain.IN_PROGRESS


def test_done_of_an_item_never_marked_is_harmless() -> None:
    obtaining = Obtaining()
    obtaining.mark([A], Obtain.IN_PROGRESS)
    obtaining.done([B, B])
    assert obtaining.state(A) is Obtain.IN_PROGRESS


def test_a_committed_item_marked_again_is_back_in_the_round() -> None:
    obtaining = Obtaining()
    obtaining.mark([A], Obtain.IN_PROGRESS)
    obtaining.done([A])
    obtaining.mark([A], Obtain.GAVE_UP)  # a new plan names it again
    assert obtaining.state(A) is Obtain.GAVE_UP


def test_clear_forgets_every_item() -> None:
    obtaining = Obtaining()
    obtaining.mark([A, B], Obtain.IN_PROGRESS)
    obtaining.mark([C], Obtain.GAVE_UP)
    obtaining.clear()
    assert [obtaining.state(i) for i in (A, B, C)] == [None, None, None]


def test_items_are_told_apart_by_every_field() -> None:
    obtaining = Obtaining()
    obtaining.mark([A], Obtain.IN_PROGRESS)
    assert obtaining.state(ItemId("job", 10, 1, 0)) is Obtain.IN_PROGRESS  # equal, not same
    for other in (
        ItemId("other", 10, 1, 0),
        ItemId("job", 11, 1, 0),
        ItemId("job", 10, 2, 0),
        ItemId("job", 10, 1, 1),
    ):
        assert obtaining.state(other) is None
