"""Option types shared by both command lines (``core.argtypes``): what each takes, and the
rule each bad value is refused with."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mtc_replicator.core import argtypes


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (argtypes.count, "0", 0),
        (argtypes.count, " 12 ", 12),
        (argtypes.positive, "3", 3),
        (argtypes.non_negative, "2.5", 2.5),
        (argtypes.seconds, "0.5", 0.5),
        (argtypes.host_port, "node-1:7070", "node-1:7070"),
        (argtypes.host_port, "[::1]:65535", "[::1]:65535"),
        (argtypes.listen_address, "0.0.0.0:0", "0.0.0.0:0"),
        (argtypes.job, "train-01", "train-01"),
        (argtypes.rate, "400MiB", 400 * 2**20),
        (argtypes.rate, "unlimited", None),
        (argtypes.storage_timeout, "300", 300.0),
    ],
)
def test_good_values(parse: object, text: str, value: object) -> None:
    assert parse(text) == value  # type: ignore[operator]


@pytest.mark.parametrize(
    ("parse", "text", "rule"),
    [
        (argtypes.count, "abc", "must be a whole number >= 0, got 'abc'"),
        (argtypes.count, "-1", "must be a whole number >= 0, got '-1'"),
        # Digits other than ASCII ones, which int() would take for 12 or refuse.
        (argtypes.count, "١٢", "must be a whole number >= 0"),
        (argtypes.positive, "0", "must be a whole number >= 1, got '0'"),
        (argtypes.non_negative, "nan", "must be a finite number >= 0"),
        (argtypes.non_negative, "-2", "must be a finite number >= 0"),
        (argtypes.seconds, "0", "must be more than 0 seconds"),
        (argtypes.host_port, "node:0", "must be HOST:PORT"),
        (argtypes.host_port, "node:7²", "must be HOST:PORT"),
        (argtypes.host_port, ":7070", "must be HOST:PORT"),
        (argtypes.listen_address, "0.0.0.0:65536", "must be HOST:PORT"),
        (argtypes.job, "../x", "not a job name"),
        (argtypes.rate, "fast", "fast"),
        (argtypes.storage_timeout, "-1", "must be more than 0 and at most 86400 s"),
    ],
)
def test_bad_values_say_the_rule(parse: object, text: str, rule: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        parse(text)  # type: ignore[operator]
    assert rule in str(refused.value)


# --- values the OS or a store would refuse later ------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/tmp/" + "a" * 256, "component must be at most 255 bytes, got 256"),
        ("/" + "/".join(["d" * 200] * 21), "must be under 4096 bytes"),
        ("/tmp/a\0b", "NUL"),
        ("", "empty"),
    ],
)
def test_a_path_the_os_would_refuse_is_a_usage_error(value: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        argtypes.path(value)


def test_a_path_at_the_limits_is_taken() -> None:
    assert argtypes.path("/tmp/" + "é" * 127) == Path("/tmp/" + "é" * 127)  # 254 bytes


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("/tmp/plainpath", "must be a URL.*for a directory: file:///tmp/plainpath"),
        ("relative/dir", "must be a URL"),
        ("file://host/x", "file:///absolute/path"),
        ("file://relative", "file:///absolute/path"),
        ("s3:/bucket/x", "s3://bucket/prefix with a bucket name"),
        ("gs://", "gs://bucket/prefix"),
        ("ftp://x/y", "must be a URL"),
        ("file:///tmp/" + "x" * 300, "at most 255 bytes"),
    ],
)
def test_a_storage_location_must_be_a_usable_url(value: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        argtypes.storage_url(value)


@pytest.mark.parametrize(
    "value", ["file:///var/lib/mtc/backup", "s3://bucket/prefix", "gs://my.bucket", "s3://B_1"]
)
def test_storage_urls_are_taken(value: str) -> None:
    assert argtypes.storage_url(value) == value


@pytest.mark.parametrize("value", ["a b", "-x", "x..y", "é", "a" * 64, ""])
def test_a_server_name_must_be_a_dns_name(value: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="DNS name"):
        argtypes.dns_name(value)


def test_a_duration_the_os_cannot_wait_is_a_usage_error() -> None:
    # settimeout(1e12) and Lock.acquire(timeout=1e300) raise OverflowError deep in a thread.
    with pytest.raises(argparse.ArgumentTypeError, match="must be at most 1e"):
        argtypes.non_negative("1e300")
    assert argtypes.non_negative("1e9") == 1e9
