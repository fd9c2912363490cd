"""Logging: one line per event on stderr, as text or JSON, with job, rank and step.

I/O only in ``configure`` (it installs the handler). Every line about a job carries the job
name and rank, so one grep (or one JSON query) follows a job across the fleet's logs. Text
lines read ``<time> <LEVEL> <logger>: <message> job=... rank=... step=...``; JSON lines
(python-json-logger) carry the same fields as top-level keys. Both stamp the time in UTC,
RFC 3339 with its zone, so lines from nodes in different zones sort together.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pythonjsonlogger.json import JsonFormatter

_FIELDS = ("job", "rank", "step")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_log_level(value: str) -> str:
    """``info`` -> ``INFO``; raises ``ValueError`` naming the choices."""
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(
            f"invalid log level {value!r} (choose from {', '.join(x.lower() for x in LOG_LEVELS)})"
        )
    return level


def parse_log_format(value: str) -> str:
    fmt = value.strip().lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"invalid log format {value!r} (choose from {', '.join(LOG_FORMATS)})")
    return fmt


def _arg_type(parse: Any) -> Any:
    """``parse`` as an argparse type: its ``ValueError`` becomes a usage error that says
    what is wrong (argparse's own would read "invalid parse value")."""

    def convert(value: str) -> str:
        try:
            return str(parse(value))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def add_log_arguments(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """``--log-level`` and ``--log-format``, shared by ``mtc-replicator`` and ``mtc-csi``."""
    p.add_argument(
        "--log-level",
        type=_arg_type(parse_log_level),
        default=env.get("MTC_LOG_LEVEL", "info"),
        metavar="{debug,info,warning,error,critical}",
        help="least severe log lines written (default: %(default)s) [MTC_LOG_LEVEL]",
    )
    p.add_argument(
        "--log-format",
        type=_arg_type(parse_log_format),
        default=env.get("MTC_LOG_FORMAT", "text"),
        metavar="{text,json}",
        help="log lines on stderr as text, or as one JSON object per line with job, rank and "
        "step as keys (default: %(default)s) [MTC_LOG_FORMAT]",
    )


def rfc3339(created: float) -> str:
    """``2026-11-23T07:23:50.964Z``: UTC, milliseconds."""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{whole}.{int(created * 1000) % 1000:03d}Z"


class KeyValueFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> job=... rank=... step=...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return rfc3339(record.created)

    def formatMessage(self, record: logging.LogRecord) -> str:
        """The message line with its fields; ``format`` puts a traceback after it."""
        line = super().formatMessage(record)
        fields = [
            f"{k}={getattr(record, k)}" for k in _FIELDS if getattr(record, k, None) is not None
        ]
        # A message that reads ``job=x`` already is not followed by a second ``job=x``.
        extras = [f for f in fields if f" {f}" not in f" {record.getMessage()}"]
        return f"{line} {' '.join(extras)}" if extras else line


class JsonLineFormatter(JsonFormatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``message``, then any
    context (``job``, ``rank``, ``step``, other ``extra=`` keys) as top-level keys; an
    exception's traceback in ``exc_info``. A context key that is None is left out."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            json_ensure_ascii=False,
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        log_data["time"] = rfc3339(record.created)
        super().add_fields(log_data, record, message_dict)
        for key in [k for k, v in log_data.items() if v is None and k in _FIELDS]:
            del log_data[key]


class RepeatLimit(logging.Filter):
    """At most ``burst`` lines per cause per ``interval`` seconds, then a count.

    A cause is a logger, a level and a message template (before its arguments): a problem
    retried in a loop (a refused join, an unreachable peer) says so ``burst`` times, then
    once per interval with how many lines like it were not written. A cause that stops
    gets its count too: its last line held back is written, with the count, once its
    interval is over (when the next line of any cause passes this filter). Only WARNING and
    above: INFO lines are work done, each worth its line, and DEBUG is asked for.
    """

    def __init__(
        self,
        burst: int = 10,
        interval: float = 60.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_causes: int = 1024,
    ) -> None:
        super().__init__()
        self.burst, self.interval, self.clock, self.max_causes = burst, interval, clock, max_causes
        self._windows: dict[tuple[str, int, str], _Window] = {}
        self._swept = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        key = (record.name, record.levelno, str(record.msg))
        if not getattr(record, _HELD_BACK, False) and now - self._swept >= 1.0:
            self._swept = now
            self._write_ended(now, but=key)
        if record.levelno < logging.WARNING:
            return True
        window = self._windows.get(key)
        if window is None or now - window.start >= self.interval:
            if window is None and len(self._windows) >= self.max_causes:
                self._forget(now)
            self._windows[key] = _Window(now)
            if window is not None and window.dropped:
                _count(record, window.dropped, self.interval)
            return True
        if window.written < self.burst:
            window.written += 1
            return True
        window.dropped += 1
        window.last = record
        return False

    def _write_ended(self, now: float, *, but: tuple[str, int, str]) -> None:
        """Write the last held-back line of each cause whose interval is over, with its
        count, and forget the cause (its next line starts a new interval); not ``but``'s,
        whose line now takes the count."""
        for key, window in list(self._windows.items()):
            if key == but or now - window.start < self.interval or window.last is None:
                continue
            if self._windows.get(key) is not window:
                continue  # another thread's sweep wrote it (filters run in every thread)
            self._windows.pop(key, None)
            held = window.last
            _count(held, window.dropped - 1, self.interval)
            setattr(held, _HELD_BACK, True)
            logging.getLogger(held.name).handle(held)

    def _forget(self, now: float) -> None:
        """Bound the causes kept: drop the ended windows, or all of them if none ended
        (messages built with f-strings make every line its own cause)."""
        ended = [k for k, w in self._windows.items() if now - w.start >= self.interval]
        for k in ended or list(self._windows):
            self._windows.pop(k, None)  # pop: another thread may have dropped it


_HELD_BACK = "_mtc_held_back"
"""Set on a held-back line ``RepeatLimit`` writes late: it passes without a sweep."""


@dataclass
class _Window:
    """One cause's interval: when it started, lines written and held back, the last held."""

    start: float
    written: int = 1
    dropped: int = 0
    last: logging.LogRecord | None = None


def _count(record: logging.LogRecord, dropped: int, interval: float) -> None:
    if dropped:
        # No '%' in what is added: the template keeps its own arguments.
        more = f"{dropped} more lines like this in the last {interval:.0f}s not logged"
        record.msg = f"{record.msg} ({more})"


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Log ``level`` and above to stderr in ``fmt`` (``text`` or ``json``), repeated
    warnings limited (``RepeatLimit``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter() if fmt == "json" else KeyValueFormatter())
    handler.addFilter(RepeatLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class JobLog:
    """A logger bound to one job and rank; ``step=`` adds the step to a line."""

    def __init__(self, logger: logging.Logger, job: str, rank: int) -> None:
        self._logger = logger
        self._job = job
        self._rank = rank

    def _log(
        self, level: int, msg: str, args: tuple[Any, ...], step: int | None, exc: bool
    ) -> None:
        extra = {"job": self._job, "rank": self._rank, "step": step}
        self._logger.log(level, msg, *args, extra=extra, exc_info=exc, stacklevel=3)

    def log(self, level: int, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(level, msg, args, step, False)

    def debug(self, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(logging.DEBUG, msg, args, step, False)

    def info(self, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(logging.INFO, msg, args, step, False)

    def warning(self, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(logging.WARNING, msg, args, step, False)

    def error(self, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(logging.ERROR, msg, args, step, False)

    def exception(self, msg: str, *args: Any, step: int | None = None) -> None:
        self._log(logging.ERROR, msg, args, step, True)
