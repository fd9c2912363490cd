"""``mtc_replicator.obs.logs``: the text format's line layout."""

from __future__ import annotations

import io
import logging

from mtc_replicator.obs.logs import JobLog, KeyValueFormatter, RepeatLimit


def test_a_text_line_with_a_traceback_has_its_fields_on_the_message_line() -> None:
    """``job= rank= step=`` belong to the message, not after the traceback's last line: a
    grep for the job must find the line that says what failed."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(KeyValueFormatter())
    logger = logging.getLogger("test_logs.traceback")
    logger.propagate = False
    logger.handlers[:] = [handler]
    try:
        raise ValueError("bad item")
    except ValueError:
        JobLog(logger, "train", 3).exception("push of %s failed", "x", step=7)
    first, *rest = out.getvalue().splitlines()
    assert first.endswith(" ERROR test_logs.traceback: push of x failed job=train rank=3 step=7")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: bad item"


def test_a_text_line_without_fields_is_the_message_alone() -> None:
    record = logging.LogRecord("n", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    assert KeyValueFormatter().format(record).endswith(" INFO n: hello you")


def _record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("replicator.x", level, __file__, 1, msg, args, None)


def test_a_repeated_warning_is_written_burst_times_then_once_per_interval_with_a_count() -> None:
    now = [0.0]
    limit = RepeatLimit(burst=3, interval=60.0, clock=lambda: now[0])
    written = [limit.filter(_record("join of %s refused", f"job{i}")) for i in range(100)]
    assert written == [True] * 3 + [False] * 97
    # Another cause is not held back by the first.
    assert limit.filter(_record("peer %s unreachable", "a"))
    now[0] = 61.0
    first = _record("join of %s refused", "job")
    assert limit.filter(first)
    assert (
        first.getMessage()
        == "join of job refused (97 more lines like this in the last 60s not logged)"
    )
    assert limit.filter(_record("join of %s refused", "job"))


def test_info_lines_are_never_limited_and_causes_are_bounded() -> None:
    limit = RepeatLimit(burst=1, interval=60.0, clock=lambda: 0.0, max_causes=8)
    assert all(limit.filter(_record("ingested %s", i, level=logging.INFO)) for i in range(50))
    # Messages built with f-strings: each its own cause, and the table stays bounded.
    assert all(limit.filter(_record(f"unique {i}")) for i in range(100))
    assert len(limit._windows) <= 8
