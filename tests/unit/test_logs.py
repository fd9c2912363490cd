"""``replicator.obs.logs``: the text format's line layout."""

from __future__ import annotations

import io
import logging

from replicator.obs.logs import JobLog, KeyValueFormatter


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
