"""Option types shared by both command lines (``core.argtypes``): what each takes, and the
rule each bad value is refused with."""

from __future__ import annotations

import argparse

import pytest

from replicator.core import argtypes


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
