"""``core.settle``: when a handshake file is judged, from the times it was read and what it
parsed as; no clock, no files."""

from __future__ import annotations

import pytest

from mtc_replicator.core.settle import Act, Reading, Reads, SettleRules, judge, observe

RULES = SettleRules(settle_seconds=10.0, config_wait_seconds=30.0)
TEXT = "job_name: a\n"


def _judge(
    reading: Reading,
    *,
    changed: float = 0.0,
    first: float = 0.0,
    now: float,
    closed: bool = False,
    renamed: bool = False,
) -> Act:
    reads = Reads(TEXT, first, changed)
    return judge(RULES, reads, reading, now, closed=closed, renamed=renamed).act


def test_reads_keep_their_first_time_and_restart_the_stable_time_on_a_change() -> None:
    reads = observe(None, "a", 1.0)
    assert (reads.first_seen, reads.changed_at) == (1.0, 1.0)
    assert observe(reads, "a", 2.0) is reads
    changed = observe(reads, "ab", 3.0)
    assert (changed.text, changed.first_seen, changed.changed_at) == ("ab", 1.0, 3.0)


def test_a_renamed_valid_file_is_accepted_at_the_first_read() -> None:
    assert _judge(Reading.VALID, now=0.0, closed=True, renamed=True) is Act.ACCEPT


def test_a_valid_file_written_in_place_needs_two_equal_reads_after_its_close() -> None:
    assert _judge(Reading.VALID, now=0.0, closed=True) is Act.WAIT
    assert _judge(Reading.VALID, now=RULES.valid_settle, closed=True) is Act.ACCEPT


def test_without_a_close_a_valid_file_waits_for_the_settle_time() -> None:
    assert _judge(Reading.VALID, now=RULES.settle_seconds - 0.01) is Act.WAIT
    assert _judge(Reading.VALID, now=RULES.settle_seconds) is Act.ACCEPT
    # A change restarts it: what counts is the time since the text last read differently.
    assert _judge(Reading.VALID, changed=5.0, now=RULES.settle_seconds) is Act.WAIT


def test_an_invalid_file_is_rejected_once_finished_and_a_second_stable() -> None:
    assert _judge(Reading.INVALID, now=0.5, closed=True) is Act.WAIT
    assert _judge(Reading.INVALID, now=RULES.invalid_settle, closed=True) is Act.REJECT
    assert _judge(Reading.INVALID, now=5.0) is Act.WAIT  # neither closed nor settled
    assert _judge(Reading.INVALID, now=RULES.settle_seconds) is Act.REJECT


def test_an_incomplete_file_is_final_once_closed_else_after_the_config_wait() -> None:
    assert _judge(Reading.INCOMPLETE, now=0.0, closed=True) is Act.WAIT
    closed = judge(
        RULES, Reads(TEXT, 0.0, 0.0), Reading.INCOMPLETE, 0.1, closed=True, renamed=False
    )
    assert (closed.act, closed.timed_out) == (Act.REJECT, False)
    # Unchanged for longer than the settle time but never closed: still waited for.
    assert _judge(Reading.INCOMPLETE, now=RULES.settle_seconds + 1) is Act.WAIT
    late = judge(
        RULES, Reads(TEXT, 0.0, 20.0), Reading.INCOMPLETE, 31.0, closed=False, renamed=False
    )
    assert (late.act, late.timed_out, late.waited) == (Act.REJECT, True, 31.0)


def test_an_empty_file_written_in_place_is_cleared_only_after_the_config_wait() -> None:
    for closed in (False, True):
        assert _judge(Reading.EMPTY, now=29.9, closed=closed) is Act.WAIT
        assert _judge(Reading.EMPTY, now=30.0, closed=closed) is Act.CLEAR


def test_an_empty_file_renamed_into_place_is_cleared_at_once() -> None:
    # client.finish_job renames an empty file in: the job's end, not a writer's first open.
    assert _judge(Reading.EMPTY, now=0.0, closed=True, renamed=True) is Act.CLEAR


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (0.0, RULES.poll),  # nothing is due sooner than the next poll
        (0.08, pytest.approx(0.02)),  # the double read's 0.1 s comes first
        (9.99, pytest.approx(0.01)),  # then the settle time without a close
    ],
)
def test_a_wait_says_when_to_read_again(now: float, expected: float) -> None:
    verdict = judge(RULES, Reads(TEXT, 0.0, 0.0), Reading.VALID, now, closed=False, renamed=False)
    assert verdict.act is Act.WAIT
    assert verdict.recheck_in == expected
    assert 0 < verdict.recheck_in <= RULES.poll
