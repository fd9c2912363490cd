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
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

from mtc_replicator.core.contract import ascii_digits
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.pacing import MIN_FLOOR_RATE, parse_rate
from mtc_replicator.core.retry import parse_storage_timeout


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


MAX_DURATION = 1e9
"""The longest duration a flag takes (about 31 years, in seconds, minutes or days): the OS
cannot wait much longer (a socket or lock timeout past 2**63 ns overflows), and anything
near it is a typo, not a setting."""


def non_negative(value: str) -> float:
    """A finite number >= 0 (minutes, seconds; ``30``, ``2.5``), at most ``MAX_DURATION``."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value!r:.40}") from None
    if not (x >= 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r:.40}")
    if x > MAX_DURATION:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DURATION:g}, got {value!r:.40}")
    return x


def seconds(value: str) -> float:
    """A duration in seconds, more than 0."""
    x = non_negative(value)
    if x == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return x


def job(value: str) -> str:
    """A job name as ``replicator.yaml`` allows it."""
    if not is_job_name(value):
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


NAME_MAX = 255
"""Bytes in one path component (Linux, every common filesystem)."""
PATH_MAX = 4096
"""Bytes in a path with its terminating NUL (Linux)."""


def path(value: str) -> Path:
    """A filesystem path the OS can take: not empty, no NUL, each component at most NAME_MAX
    bytes and the whole under PATH_MAX. Caught here, such a name is a usage error; later
    it is an ``OSError`` deep in start-up."""
    raw = value.encode("utf-8", "surrogateescape")
    if not raw:
        raise argparse.ArgumentTypeError("must be a path, got an empty value")
    if b"\0" in raw:
        raise argparse.ArgumentTypeError(f"a path cannot hold a NUL byte, got {value!r:.80}")
    if len(raw) >= PATH_MAX:
        raise argparse.ArgumentTypeError(
            f"a path must be under {PATH_MAX} bytes, got {len(raw)}: {value!r:.80}..."
        )
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            raise argparse.ArgumentTypeError(
                f"a path component must be at most {NAME_MAX} bytes, got {len(part)}: "
                f"{part.decode('utf-8', 'replace')!r:.80}..."
            )
    return Path(value)


STORAGE_SCHEMES = ("file", "s3", "gs")


def storage_url(value: str) -> str:
    """``--backup``, ``--registry``: ``file:///abs/path``, ``s3://bucket/prefix`` or
    ``gs://bucket/prefix``. A plain path is refused: docs/daemon.md has always asked for a
    URL, and a typo like ``s3:/bucket`` would otherwise become a local directory."""
    parsed = urlparse(value)
    shown = f"{value!r:.120}"
    if parsed.scheme not in STORAGE_SCHEMES:
        hint = (
            f" (for a directory: {Path(value).absolute().as_uri()})"
            if value.startswith("/")
            else ""
        )
        raise argparse.ArgumentTypeError(
            f"must be a URL: file:///absolute/path, s3://bucket/prefix or gs://bucket/prefix, "
            f"got {shown}{hint}"
        )
    if parsed.scheme == "file":
        local = unquote(parsed.path)
        if parsed.netloc not in ("", "localhost") or not local.startswith("/"):
            raise argparse.ArgumentTypeError(f"must be file:///absolute/path, got {shown}")
        path(local)
    elif not _BUCKET_RE.fullmatch(parsed.netloc):
        raise argparse.ArgumentTypeError(
            f"must be {parsed.scheme}://bucket/prefix with a bucket name (letters, digits, "
            f"'.', '-', '_'), got {shown}"
        )
    return value


_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
"""Any bucket name S3 (legacy names included) or GCS may hold; the service checks the rest."""
_DNS_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def dns_name(value: str) -> str:
    """``--tls-server-name``: a DNS name a certificate can carry as a subjectAltName."""
    labels = value.split(".")
    if len(value) > 253 or not all(_DNS_LABEL_RE.fullmatch(label) for label in labels):
        raise argparse.ArgumentTypeError(
            f"must be a DNS name (labels of letters, digits and '-', joined by '.'), "
            f"got {value!r:.80}"
        )
    return value


_OPERATOR_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def operator_name(value: str) -> str:
    """An operator's name in a certificate: letters, digits, '.', '_', '@', '-', 1-64."""
    if not _OPERATOR_NAME_RE.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"must be 1-64 letters, digits, '.', '_', '@' or '-', starting with a letter or "
            f"digit, got {value!r:.80}"
        )
    return value
