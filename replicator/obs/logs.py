"""Structured logging: one line per event, ``key=value`` fields for job, rank and step.

I/O only in ``configure`` (it installs the handler). Every line about a job carries the job
name and rank, so one grep follows a job across the fleet's logs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

_FIELDS = ("job", "rank", "step")


class KeyValueFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger>: <message> job=... rank=... step=...``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{k}={getattr(record, k)}" for k in _FIELDS if getattr(record, k, None) is not None
        ]
        return f"{line} {' '.join(extras)}" if extras else line


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
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
