"""Argument types for both command lines (``mtc-replicator``, ``mtc``). Pure.

Each parses one kind of value or says what it expected. argparse turns a ``ValueError``
from a type function into "invalid <function name> value"; these raise
``ArgumentTypeError`` instead, whose message argparse prints after the option's name, so a
bad value reads "argument --step: must be a whole number >= 0, got 'abc'". Digits are
ASCII digits only (``core.contract.ascii_digits``): ``int`` takes "١٢" for 12.
"""

from __future__ import annotations

import argparse
import math

from replicator.core.contract import JOB_NAME_RE, ascii_digits
from replicator.core.pacing import MIN_FLOOR_RATE, parse_rate
from replicator.core.retry import parse_storage_timeout


def _whole(value: str, what: str, low: int) -> int:
    text = value.strip()
    if not ascii_digits(text) or int(text) < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value!r:.40}")
    return int(text)


def count(value: str) -> int:
    """A whole number >= 0 (steps, ranks, how many to keep)."""
    return _whole(value, "a whole number >= 0", 0)


def positive(value: str) -> int:
    """A whole number >= 1 (days, limits)."""
    return _whole(value, "a whole number >= 1", 1)


def non_negative(value: str) -> float:
    """A finite number >= 0 (minutes, seconds; ``30``, ``2.5``)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value!r:.40}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r:.40}")
    return x


def seconds(value: str) -> float:
    """A duration in seconds, more than 0."""
    x = non_negative(value)
    if x == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return x


def job(value: str) -> str:
    """A job name as ``replicator.yaml`` allows it."""
    if not JOB_NAME_RE.fullmatch(value) or ".." in value:
        raise argparse.ArgumentTypeError(f"not a job name: {value!r:.80}")
    return value


def _address(value: str, lowest_port: int) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not ascii_digits(port) or not lowest_port <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {value!r:.80}")
    return value


def host_port(value: str) -> str:
    """``HOST:PORT`` to reach, with a port in 1..65535 (a bracketed IPv6 host is fine)."""
    return _address(value, 1)


def listen_address(value: str) -> str:
    """``HOST:PORT`` to listen on: port 0 asks the system for a free one."""
    return _address(value, 0)


def storage_timeout(value: str) -> float:
    """``--storage-timeout``: seconds, within the bounds ``core.retry`` sets."""
    try:
        return parse_storage_timeout(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rate(value: str) -> float | None:
    """``--max-transfer-rate``: bytes per second as ``core.pacing`` reads them (None:
    unlimited)."""
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def floor_rate(value: str) -> float:
    """``--min-transfer-rate``: bytes per second, at least 1 KiB/s; ``off``: 0 (no floor)."""
    if value.strip().lower() == "off":
        return 0.0
    try:
        parsed = parse_rate(value, minimum=MIN_FLOOR_RATE)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if parsed is None:
        raise argparse.ArgumentTypeError(f"must be a rate such as 256KiB, or 'off', got {value!r}")
    return parsed
