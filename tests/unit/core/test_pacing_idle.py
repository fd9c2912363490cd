"""A paced transfer never goes quiet for long: the other side drops a transfer idle for its
timeout (30 s by default), so a slice is never more than a second's worth at any rate, and
a thread waiting on the pacer leaves at once when its transfer is cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from mtc_replicator.core.manifest import Cancelled
from mtc_replicator.core.pacing import PaceBook, PaceRules, Traffic, earned_seconds
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.transport import transfer
from mtc_replicator.transport.peer_client import PeerClient

KiB = 1 << 10
MiB = 1 << 20


@pytest.mark.parametrize("rate", [1 * KiB, 16 * KiB, 100 * KiB, 1 * MiB, 100 * MiB])
def test_a_slice_is_never_more_than_a_seconds_worth(rate: float) -> None:
    book = PaceBook(PaceRules(rate=rate))
    assert 1 <= book.slice(Traffic.REPLICATION, 0) <= rate
    book.begin(Traffic.RESTORE)  # replication is held now: it trickles at a sixteenth
    assert 1 <= book.slice(Traffic.REPLICATION, 0) <= rate / 16


def test_a_held_slice_is_booked_within_a_second_at_a_low_rate() -> None:
    """At 16 KiB/s a held transfer trickles at 1 KiB/s: slice after slice, each within a
    second of the one before, never one 64 KiB slice a minute."""
    book = PaceBook(PaceRules(rate=16 * KiB))
    book.begin(Traffic.RESTORE)
    now = 0.0
    for _ in range(10):
        size = book.slice(Traffic.REPLICATION, now)
        booking = book.book(Traffic.REPLICATION, size, now)
        while not booking.booked:
            assert booking.wait <= 1.0
            now += booking.wait
            booking = book.book(Traffic.REPLICATION, size, now)
        assert booking.wait <= 1.0
        now += booking.wait


def test_a_wait_ends_when_its_transfer_is_stopped() -> None:
    pacer = Pacer(PaceRules(yield_to_saves=15.0))
    pacer.saving(True)  # holds replication for 15 s
    stop = threading.Event()
    outcome: list[BaseException] = []

    def send() -> None:
        with pacer.transfer(Traffic.REPLICATION) as meter:
            try:
                meter.take(MiB, stop)
            except Cancelled as exc:
                outcome.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 5
    while pacer.waited[Traffic.REPLICATION] < 0.2 and time.monotonic() < deadline:
        thread.join(0.01)
    assert thread.is_alive()  # held by the save
    t0 = time.monotonic()
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert time.monotonic() - t0 < 1.0
    assert len(outcome) == 1
    assert pacer.sent[Traffic.REPLICATION] == 0


def test_a_paced_push_gets_a_deadline_its_limit_can_meet() -> None:
    """At 10 MiB/s a 512 MiB push needs 51 s alone, longer when shared: its deadline allows
    a quarter of the limit and a save's hold, where 25 MB/s would give it 51 s in all."""
    unpaced = PeerClient(timeout=30.0)
    paced = PeerClient(timeout=30.0, pacer=Pacer(PaceRules(rate=10 * MiB, yield_to_saves=5)))
    try:
        assert paced._push_deadline(512 * MiB) == pytest.approx(30 + 5 + 4 * 51.2)
        assert unpaced._push_deadline(512 * MiB) == pytest.approx(30 + 5 + 512 * MiB / 25e6)
    finally:
        for client in (unpaced, paced):
            asyncio.run(client.close())


def test_a_transfer_earns_its_time_by_what_it_moved() -> None:
    assert earned_seconds(0, 4 * MiB, 30.0) == 30.0  # the grace alone, before a byte
    assert earned_seconds(8 * MiB, 4 * MiB, 30.0) == 32.0
    assert earned_seconds(-1, 4 * MiB, 30.0) == 30.0


def _run_with_progress(rate: float, total: float, monkeypatch: pytest.MonkeyPatch) -> float:
    """Move ``total`` bytes at ``rate`` under a 1 KiB/s floor with a 0.2 s grace and a
    whole deadline of 10 s; the seconds it ran (``TooSlow`` when dropped)."""
    monkeypatch.setattr(transfer, "PROGRESS_TICK", 0.05)
    moved = 0.0

    async def go() -> float:
        nonlocal moved
        start = time.monotonic()

        def earned() -> float:
            return earned_seconds(int(moved), KiB, 0.2)

        async with transfer.deadline(10.0, "a test transfer", earned):
            while moved < total:
                await asyncio.sleep(0.02)
                moved += rate * 0.02
        return time.monotonic() - start

    return asyncio.run(go())


def test_a_transfer_under_the_floor_is_dropped_once_its_grace_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte a second under a 1 KiB/s floor: dropped after the grace and a tick or two, not
    at the whole deadline (10 s here); the error says it moved too little."""
    start = time.monotonic()
    with pytest.raises(transfer.TooSlow, match=r"too little moved .* under the minimum rate"):
        _run_with_progress(1.0, 1e9, monkeypatch)
    assert time.monotonic() - start < 2.0


def test_a_transfer_at_the_floor_is_never_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twice the floor for 1 s: it only gains on what it must have moved; done."""
    assert _run_with_progress(2 * KiB, 2 * KiB, monkeypatch) >= 0.9
