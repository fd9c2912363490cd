"""Tests for ``mtc_replicator.core.humanize``: sizes and ages as ``mtc`` prints them."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc_replicator.core.humanize import count, human_age, human_bytes

HOUR = 3600.0
DAY = 24 * HOUR


# --- formatting ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 * 1024**2, "3.0 MiB"),
        (int(1.5 * 1024**3), "1.5 GiB"),
        (2 * 1024**5, "2.0 PiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (59.9, "59s"),
        (60, "1m"),
        (3 * HOUR + 12 * 60 + 5, "3h12m"),
        (2 * DAY + 4 * HOUR, "2d4h"),
        (-5, "0s"),
        (-2 * HOUR, "2h0m ahead"),
        (math.nan, "?"),
    ],
)
def test_human_age(seconds: float, text: str) -> None:
    assert human_age(seconds) == text


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_human_age_answers_any_time_in_two_units_at_most(seconds: float) -> None:
    """Prune words its reasons with it, for clocks and commit times from any writer."""
    text = human_age(seconds).removesuffix(" ahead")
    assert text == "?" or re.fullmatch(r"\d+[smhd](\d+[mh])?", text)


@given(st.integers(0, 2**70))
def test_human_bytes_is_one_number_and_a_unit(n: int) -> None:
    assert re.fullmatch(r"\d+ B|\d+\.\d [KMGTP]iB", human_bytes(n))


@pytest.mark.parametrize(
    ("n", "noun", "plural", "said"),
    [
        (1, "item", None, "1 item"),
        (2, "item", None, "2 items"),
        (0, "step", None, "0 steps"),
        (1, "copy", "copies", "1 copy"),
        (3, "copy", "copies", "3 copies"),
    ],
)
def test_a_count_names_its_noun_in_the_right_number(
    n: int, noun: str, plural: str | None, said: str
) -> None:
    assert count(n, noun, plural) == said
