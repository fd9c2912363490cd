"""Tests for ``mtc_replicator.core.crc``: combining pieces' crcs and cutting files into ranges."""

from __future__ import annotations

import itertools

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core.crc import crc32c_concat, split_ranges


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 700))
def test_concat_of_ranges_equals_the_whole_crc(data: bytes, piece: int) -> None:
    ranges = split_ranges(len(data), piece)
    pieces = [(google_crc32c.value(data[o : o + n]), n) for o, n in ranges]
    assert crc32c_concat(pieces) == google_crc32c.value(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 999))
def test_ranges_cover_every_byte_once_in_order(size: int, piece: int) -> None:
    ranges = split_ranges(size, piece)
    assert ranges[0][0] == 0
    assert all(0 < n <= piece for _, n in ranges) or ranges == [(0, 0)]
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert sum(n for _, n in ranges) == size


def test_an_empty_file_is_one_empty_range() -> None:
    assert split_ranges(0, 10) == [(0, 0)]


def test_a_piece_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        split_ranges(10, 0)
