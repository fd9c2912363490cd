"""``mtc_replicator.obs.logs``: the text format's line layout, the JSON keys, and every log call
that names a job passing it as a key."""

from __future__ import annotations

import ast
import io
import json
import logging
import re
from pathlib import Path

import mtc_replicator
from mtc_replicator.obs.logs import JobLog, JsonLineFormatter, KeyValueFormatter, RepeatLimit


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


def test_a_cause_that_stops_still_gets_its_count_written() -> None:
    now = [0.0]
    limit = RepeatLimit(burst=2, interval=60.0, clock=lambda: now[0])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    handler.addFilter(limit)
    logger = logging.getLogger("replicator.stops")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for i in range(12):
            logger.warning("peer %s unreachable", f"p{i}")
        assert lines == ["peer p0 unreachable", "peer p1 unreachable"]
        now[0] = 30.0
        logger.info("step %d ingested", 10)  # the interval is not over: nothing more
        assert lines[2:] == ["step 10 ingested"]
        now[0] = 61.0
        logger.info("step %d ingested", 20)  # any line after it is over writes the count
        assert lines[3:] == [
            "peer p11 unreachable (9 more lines like this in the last 60s not logged)",
            "step 20 ingested",
        ]
        logger.warning("peer %s unreachable", "p12")  # the cause starts afresh
        assert lines[5:] == ["peer p12 unreachable"]
    finally:
        logger.removeHandler(handler)


def test_info_lines_are_never_limited_and_causes_are_bounded() -> None:
    limit = RepeatLimit(burst=1, interval=60.0, clock=lambda: 0.0, max_causes=8)
    assert all(limit.filter(_record("ingested %s", i, level=logging.INFO)) for i in range(50))
    # Messages built with f-strings: each its own cause, and the table stays bounded.
    assert all(limit.filter(_record(f"unique {i}")) for i in range(100))
    assert len(limit._windows) <= 8


def test_a_message_that_names_the_job_is_not_followed_by_it_again() -> None:
    record = _record("backup committed job=%s step=%d", "train", 4)
    record.job = "train"
    record.step = 4
    assert KeyValueFormatter().format(record).endswith(" backup committed job=train step=4")
    record.job = "other"
    assert KeyValueFormatter().format(record).endswith(" job=train step=4 job=other")


def test_a_job_passed_as_extra_is_a_json_key() -> None:
    record = _record("accepted %s: job=%s", "replicator.yaml", "train", level=logging.INFO)
    record.job = "train"
    line = json.loads(JsonLineFormatter().format(record))
    assert (line["job"], line["message"]) == ("train", "accepted replicator.yaml: job=train")
    assert "rank" not in line


_JOB_ARG = re.compile(r"(job|keep|job_name|[\w.]*\.job|[\w.]*\.job_name)")


def test_every_log_call_that_names_a_job_passes_it_as_a_key() -> None:
    """A plain ``logging`` call whose arguments include a job name passes ``extra={"job": ...}``
    (``JobLog`` adds it itself), so ``--log-format json`` lines carry ``job`` as a key."""
    root = Path(mtc_replicator.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "log"
                and node.func.attr in ("debug", "info", "warning", "error", "exception", "log")
            ):
                continue
            names_a_job = any(_JOB_ARG.fullmatch(ast.unparse(a)) for a in node.args[1:])
            if names_a_job and not any(k.arg == "extra" for k in node.keywords):
                missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not missing, missing
