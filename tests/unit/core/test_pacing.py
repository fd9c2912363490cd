"""The pacing rules (``core.pacing``) and their meter (``local.pacer``) on a simulated clock."""

from __future__ import annotations

import asyncio
import io
import os
import threading

import pytest

from mtc_replicator.core.manifest import Cancelled
from mtc_replicator.core.pacing import (
    DEFAULT_MIN_TRANSFER_RATE,
    HELD_RATE,
    MAX_SLICE,
    MAX_YIELD_TO_SAVES,
    MIN_RATE,
    PaceBook,
    PaceRules,
    Traffic,
    default_floor,
    format_rate,
    parse_rate,
    transfer_deadline,
)
from mtc_replicator.local.pacer import PacedReader, Pacer

MiB = 1 << 20


class Clock:
    """Time that passes only when someone sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


def pacer(rate: float | None = None, **kw: float) -> tuple[Pacer, Clock]:
    clock = Clock()
    return Pacer(PaceRules(rate=rate, **kw), clock=clock, sleep=clock.sleep), clock


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("400MiB", 400 * MiB),
        ("400 MiB/s", 400 * MiB),
        ("1.5GB", 1.5e9),
        ("2Gbit", 2e9 / 8),
        ("2Gb", 2e9 / 8),
        ("2Gibit", 2 * (1 << 30) / 8),
        ("100Mbps", 100e6 / 8),
        ("512KiB", 512 << 10),
        ("unlimited", None),
        ("", None),
    ],
)
def test_rates_are_read_in_bytes_or_bits(text: str, rate: float | None) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize(
    "text", ["fast", "400", "400XB", "-5MiB", "0MiB", "0.1B", "1e9MB", "MiB", "63KiB"]
)
def test_a_bad_rate_says_the_rule(text: str) -> None:
    with pytest.raises(ValueError, match=r"transfer rate"):
        parse_rate(text)


def test_rates_print_in_the_units_they_were_given() -> None:
    assert format_rate(parse_rate("400MiB")) == "400MiB/s"
    assert format_rate(None) == "unlimited"


def test_rules_refuse_what_would_break_a_transfer() -> None:
    with pytest.raises(ValueError, match="idle"):
        PaceRules(yield_to_saves=MAX_YIELD_TO_SAVES + 1)
    with pytest.raises(ValueError, match="positive"):
        PaceRules(rate=0)


def send(p: Pacer, traffic: Traffic, total: int) -> None:
    with p.transfer(traffic) as meter:
        left = total
        while left:
            n = min(meter.slice(), left)
            meter.take(n)
            left -= n


def test_the_limit_holds_over_a_long_transfer_with_one_burst_at_most() -> None:
    p, clock = pacer(rate=100 * MiB)
    start = clock.now
    send(p, Traffic.REPLICATION, 512 * MiB)
    elapsed = clock.now - start
    # The first second's worth goes at once (the burst), the rest at the rate.
    assert elapsed == pytest.approx((512 - 100) / 100, rel=0.01)


def test_no_window_carries_more_than_a_burst_plus_the_rate() -> None:
    p, clock = pacer(rate=10 * MiB)
    sends: list[tuple[float, int]] = []
    with p.transfer(Traffic.BACKUP) as meter:
        for _ in range(400):
            n = meter.slice()
            meter.take(n)
            sends.append((clock.now, n))
    for i, (t0, _) in enumerate(sends):
        window = sum(n for t, n in sends[i:] if t < t0 + 1.0)
        assert window <= 2 * 10 * MiB + meter.slice()


def test_restores_are_never_throttled() -> None:
    p, clock = pacer(rate=1 * MiB)
    start = clock.now
    send(p, Traffic.RESTORE, 512 * MiB)
    assert clock.now == start


def test_concurrent_transfers_share_the_limit_fairly() -> None:
    p, _ = pacer(rate=50 * MiB)
    # Two replications interleaved slice by slice, as two threads would book them.
    with p.transfer(Traffic.REPLICATION) as a, p.transfer(Traffic.REPLICATION) as b:
        shares = [0, 0]
        for _ in range(200):
            for i, m in enumerate((a, b)):
                n = m.slice()
                m.take(n)
                shares[i] += n
        assert shares[0] == shares[1]


def test_jobs_side_by_side_share_the_limit_evenly_whatever_their_transfers() -> None:
    """Job directories (issue 36): job a sends through three transfers, job b through one,
    each booking slice by slice in turn: each job gets half. Alone, a job's transfers book
    whole slices as before."""
    p, _ = pacer(rate=50 * MiB)
    with (
        p.transfer(Traffic.REPLICATION, job="a") as a1,
        p.transfer(Traffic.REPLICATION, job="a") as a2,
        p.transfer(Traffic.REPLICATION, job="a") as a3,
    ):
        assert a1.slice() == PaceRules(rate=50 * MiB).slice  # a alone
        with p.transfer(Traffic.REPLICATION, job="b") as b:
            shares = {"a": 0, "b": 0}
            for _ in range(300):
                for m in (a1, a2, a3, b):
                    n = m.slice()
                    m.take(n)
                    shares[m.job] += n
            assert shares["a"] == pytest.approx(shares["b"], rel=0.01)


def test_a_higher_class_in_flight_holds_lower_ones_to_a_trickle() -> None:
    p, clock = pacer()
    with p.transfer(Traffic.RESTORE):
        start = clock.now
        send(p, Traffic.REPLICATION, 4 * MiB)
        assert clock.now - start == pytest.approx(4 * MiB / HELD_RATE, rel=0.05)
    with p.transfer(Traffic.REPLICATION):
        start = clock.now
        send(p, Traffic.BACKUP, 2 * MiB)
        assert clock.now - start == pytest.approx(2 * MiB / HELD_RATE, rel=0.05)
    start = clock.now
    send(p, Traffic.BACKUP, 512 * MiB)  # nothing above it any more: no waiting
    assert clock.now == start


def test_a_save_holds_replication_and_backups_up_to_the_bound() -> None:
    p, clock = pacer(yield_to_saves=3.0)
    p.saving(True)
    start = clock.now
    send(p, Traffic.RESTORE, 8 * MiB)
    assert clock.now == start  # restores do not yield
    send(p, Traffic.REPLICATION, 8 * MiB)
    assert clock.now - start == pytest.approx(3.0, abs=0.06)
    p.saving(True)  # the same save, still going: no new hold
    mark = clock.now
    send(p, Traffic.BACKUP, 8 * MiB)
    assert clock.now == mark
    p.saving(False)
    p.saving(True)  # the next save holds again
    mark = clock.now
    send(p, Traffic.BACKUP, 1)
    assert clock.now - mark == pytest.approx(3.0, abs=0.06)


def test_a_save_that_ends_releases_at_once() -> None:
    book = PaceBook(PaceRules(yield_to_saves=5.0))
    book.saving(0.0, True)
    assert not book.book(Traffic.REPLICATION, 1, 1.0).booked
    book.saving(1.0, False)
    assert book.book(Traffic.REPLICATION, 1, 1.0).booked


def test_slices_follow_the_limit() -> None:
    assert PaceBook(PaceRules()).slice(Traffic.BACKUP, 0) == MAX_SLICE
    assert PaceBook(PaceRules(rate=100 * MiB)).slice(Traffic.BACKUP, 0) == MAX_SLICE
    assert PaceBook(PaceRules(rate=40 * MiB)).slice(Traffic.BACKUP, 0) == 2 * MiB
    small = PaceBook(PaceRules(rate=1 * MiB)).slice(Traffic.BACKUP, 0)
    assert small == 64 << 10


def test_the_meter_works_from_threads_and_the_loop_together() -> None:
    p = Pacer(PaceRules(rate=200 * MiB))
    done = threading.Event()

    def worker() -> None:
        send(p, Traffic.REPLICATION, 20 * MiB)
        done.set()

    async def main() -> None:
        t = threading.Thread(target=worker)
        t.start()
        with p.transfer(Traffic.BACKUP) as meter:
            left = 20 * MiB
            while left:
                n = min(meter.slice(), left)
                await meter.take_async(n)
                left -= n
        await asyncio.to_thread(t.join)

    asyncio.run(main())
    assert done.is_set()
    assert p.sent[Traffic.REPLICATION] >= 20 * MiB
    assert p.sent[Traffic.BACKUP] >= 20 * MiB


def test_a_paced_reader_reads_like_a_file_and_pays_for_rereads() -> None:
    p, clock = pacer(rate=1 * MiB, burst_seconds=1.0)
    data = bytes(range(256)) * 4096 * 3  # 3 MiB
    with p.transfer(Traffic.BACKUP) as meter:
        reader = PacedReader(data, meter)
        out = io.BytesIO()
        while chunk := reader.read(8192):
            out.write(chunk)
        assert out.getvalue() == data
        first = clock.now
        reader.seek(0)
        assert reader.read() == data
        assert clock.now - first == pytest.approx(3.0, rel=0.05)


def test_paced_slices_carry_every_byte_in_order_and_book_them() -> None:
    p, clock = pacer(rate=1 * MiB)
    data = os.urandom(3 * MiB + 123)
    start = clock.now
    with p.transfer(Traffic.BACKUP) as meter:
        pieces = list(meter.paced(data))
    assert b"".join(pieces) == data
    assert max(len(x) for x in pieces) <= 64 << 10
    assert p.sent[Traffic.BACKUP] >= len(data)
    assert clock.now - start == pytest.approx((len(data) - MiB) / MiB, rel=0.05)


def test_a_halted_pacer_ends_every_paced_transfer_at_its_next_slice() -> None:
    p, _ = pacer(rate=1 * MiB)
    with p.transfer(Traffic.BACKUP) as meter:
        meter.take(1024)
        p.halt()
        with pytest.raises(Cancelled):
            meter.take(2 * MiB)
    with p.transfer(Traffic.REPLICATION) as meter, pytest.raises(Cancelled):
        asyncio.run(meter.take_async(2 * MiB))


def test_a_cancelled_transfer_ends_at_its_next_slice_and_the_others_go_on() -> None:
    """A job switch past its drain's deadline: that job's upload stops mid-file, while the
    pacer (and the next job's transfers) carry on."""
    p, _ = pacer(rate=1 * MiB)
    stopped = threading.Event()
    with p.transfer(Traffic.BACKUP, stopped.is_set) as meter:
        meter.take(1024)
        stopped.set()
        with pytest.raises(Cancelled):
            list(meter.paced(b"x" * (2 * MiB)))
    with p.transfer(Traffic.BACKUP) as meter:
        meter.take(2 * MiB)
    assert not p.halted.is_set()


# --- the floor under a peer's transfer ---------------------------------------------------------


def test_a_transfer_may_take_a_grace_plus_its_bytes_at_the_floor() -> None:
    assert transfer_deadline(8 << 20, 4 << 20, 30.0) == 32.0
    assert transfer_deadline(0, 4 << 20, 30.0) == 30.0  # empty files: the grace alone
    assert transfer_deadline(8 << 20, None, 30.0) is None  # --min-transfer-rate off
    # Each file or directory counts as a page: 30,000 small files are not dropped for it.
    assert transfer_deadline(0, 4 << 20, 2.0, entries=1024) == 3.0


@pytest.mark.parametrize("limit", [None, MIN_RATE, 1 << 20, 4 << 20, 400 << 20])
def test_the_default_floor_lets_a_held_push_of_its_own_pacing_finish(limit: float | None) -> None:
    """A peer paced as this node is, even held to its class's trickle (a sixteenth of the
    limit, or ``HELD_RATE``), moves at least the default floor: never dropped for it."""
    floor = default_floor(limit)
    assert floor <= DEFAULT_MIN_TRANSFER_RATE
    slowest = HELD_RATE if limit is None else min(HELD_RATE, limit / 16)
    assert floor <= slowest
    size = 1 << 30
    deadline = transfer_deadline(size, floor, 30.0)
    assert deadline is not None
    assert size / slowest <= deadline


def test_the_floor_is_parsed_with_its_own_minimum() -> None:
    assert parse_rate("1KiB", minimum=1024) == 1024
    with pytest.raises(ValueError, match="under the minimum of 1KiB/s"):
        parse_rate("512B", minimum=1024)
    with pytest.raises(ValueError, match="64KiB per second"):
        parse_rate("1KiB")  # --max-transfer-rate keeps its own
