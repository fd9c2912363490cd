"""``core.stripes``: how an item's files are split between a transfer's connections (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc_replicator.core.manifest import Attestation, FileEntry, ItemId, ItemKind, Manifest
from mtc_replicator.core.stripes import MAX_STREAMS, parts, stream_count, stripes


@given(st.lists(st.integers(0, 1 << 40), max_size=60), st.integers(1, MAX_STREAMS))
def test_every_file_goes_to_exactly_one_connection_in_manifest_order(
    sizes: list[int], count: int
) -> None:
    split = stripes(sizes, count)
    assert len(split) == count
    assert sorted(i for part in split for i in part) == list(range(len(sizes)))
    assert all(part == sorted(part) for part in split)
    assert [i for part in split[1:] for i in part if sizes[i] == 0] == []  # empties: first
    assert stripes(sizes, count) == split  # both ends compute the same


@given(st.lists(st.integers(1, 1 << 30), min_size=1, max_size=60), st.integers(1, MAX_STREAMS))
def test_no_connection_carries_more_than_another_plus_one_file(
    sizes: list[int], count: int
) -> None:
    loads = [sum(sizes[i] for i in part) for part in stripes(sizes, count)]
    assert max(loads) - min(loads) <= max(sizes)


def test_equal_files_are_dealt_out_evenly() -> None:
    assert stripes([10] * 8, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert stripes([100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2) == [
        [0],
        list(range(1, 11)),
    ]


def test_the_count_is_what_was_asked_within_the_bounds_and_the_files() -> None:
    assert stream_count([5] * 20, 4) == 4
    assert stream_count([5] * 20, 100) == MAX_STREAMS
    assert stream_count([5] * 20, 0) == 1
    assert stream_count([5, 0, 0, 5], 4) == 2  # two files carry bytes
    assert stream_count([0, 0], 4) == 1
    assert stream_count([], 4) == 1
    with pytest.raises(ValueError, match="0 connections"):
        stripes([1], 0)


def test_parts_list_their_files_and_the_first_every_directory() -> None:
    files = tuple(FileEntry(f"d/f{n}", n * 10, n, f"{n:064x}") for n in range(5))
    signed = Attestation("owner", "node-a", 1.0, b"pem", b"sig")
    manifest = Manifest(ItemId("job", 7, 1, 0), ItemKind.DIR, files, ("d", "e"), attestation=signed)
    split = parts(manifest, 2)
    assert [p.dirs for p in split] == [("d", "e"), ()]
    assert sorted((f for p in split for f in p.files), key=lambda f: f.path) == list(files)
    assert all(p.item == manifest.item and p.attestation is None for p in split)
    assert parts(manifest, 1) == [manifest]
