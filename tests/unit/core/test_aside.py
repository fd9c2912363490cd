"""Tests for ``mtc_replicator.core.aside``: what a round passed over is kept, and until when."""

from __future__ import annotations

from mtc_replicator.core.aside import passed_over, released, why_kept
from mtc_replicator.core.manifest import ItemId

JOB = "job"


def item(step: int, rank: int = 0) -> ItemId:
    return ItemId(JOB, step, rank, 0)


def test_a_fresh_start_passes_over_every_item_and_an_older_step_the_newer_ones() -> None:
    held = [item(5), item(10), item(10, 1), item(15)]
    assert passed_over(held, None) == sorted(held)
    assert passed_over(held, 10) == [item(15)]
    assert passed_over(held, 15) == []


def test_nothing_is_released_by_a_fresh_start_or_an_older_step() -> None:
    aside = [item(10), item(10, 1)]
    # After a fresh start nothing is restorable or backed up yet; an older step is no cover.
    assert released(aside, restorable=None, backed_up=None) == []
    assert released(aside, restorable=5, backed_up=None) == []
    assert released(aside, restorable=None, backed_up=9) == []


def test_released_once_a_step_as_new_is_restorable_or_backed_up() -> None:
    aside = [item(10), item(20)]
    assert released(aside, restorable=10, backed_up=None) == [item(10)]
    assert released(aside, restorable=15, backed_up=None) == [item(10)]
    assert released(aside, restorable=None, backed_up=20) == [item(10), item(20)]
    assert released(aside, restorable=12, backed_up=25) == [item(10), item(20)]


def test_an_item_committed_again_replaces_its_aside_copy_at_once() -> None:
    aside = [item(10), item(20)]
    assert released(aside, restorable=None, backed_up=None, committed={item(20)}) == [item(20)]


def test_the_workload_is_told_what_is_kept_and_why() -> None:
    said = why_kept([item(10), item(10, 1), item(5)], None)
    assert "a fresh start" in said
    assert "3 items of steps [5, 10] aside" in said
    assert "not deleted" in said
    assert "step 5" in why_kept([item(10)], 5)
