"""The figures every transfer log line ends with (``obs.stopwatch``)."""

from __future__ import annotations

from mtc_replicator.obs.stopwatch import Stopwatch, rate


def test_rate_is_megabytes_per_second_and_survives_zero_seconds() -> None:
    assert rate(5_000_000, 2.0) == 2.5
    assert rate(1, 0.0) > 0


def test_a_summary_gives_bytes_seconds_and_rate_of_the_time_so_far_or_the_time_given() -> None:
    now = [10.0]
    watch = Stopwatch(clock=lambda: now[0])
    now[0] = 12.5
    assert watch.seconds() == 2.5
    assert watch.summary(5_000_000) == "5000000 bytes in 2.500s (2.0 MB/s)"
    assert watch.summary(1_000_000, 0.5) == "1000000 bytes in 0.500s (2.0 MB/s)"
