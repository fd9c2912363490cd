"""``mtc_replicator.local.digests``: a file's BLAKE3 checked from pieces fed in order, inline
or on a ``HashLane`` thread, and a format-1 entry (no digest) that checks nothing."""

from __future__ import annotations

import os

import blake3
import pytest

from mtc_replicator.core.manifest import CorruptItem, FileEntry
from mtc_replicator.local.digests import FileCheck, HashLane


def entry_of(data: bytes) -> FileEntry:
    return FileEntry("f", len(data), 0, blake3.blake3(data).hexdigest())


@pytest.mark.parametrize("lane", [False, True], ids=["inline", "lane"])
def test_pieces_fed_in_order_check_out(lane: bool) -> None:
    data = os.urandom(100_000)
    check = FileCheck(entry_of(data))
    hashing = HashLane(depth=2) if lane else None
    try:
        for off in range(0, len(data), 777):
            piece = data[off : off + 777]
            if hashing is None:
                check.update(piece)
            else:
                hashing.update(check, piece)
        if hashing is not None:
            hashing.drain()
        check.check("f")
    finally:
        if hashing is not None:
            hashing.close()


def test_other_bytes_are_refused_and_the_message_says_so() -> None:
    check = FileCheck(entry_of(b"the real bytes"))
    check.update(b"other bytes!!!")
    with pytest.raises(CorruptItem, match=r"f: content digest \(blake3\) .* the manifest says"):
        check.check("f")


def test_pieces_out_of_order_are_refused() -> None:
    data = os.urandom(2000)
    check = FileCheck(entry_of(data))
    check.update(data[1000:])
    check.update(data[:1000])
    with pytest.raises(CorruptItem):
        check.check("f")


def test_a_format_1_entry_checks_nothing_and_takes_no_lane() -> None:
    check = FileCheck(FileEntry("f", 3, 0))
    assert not check.needed
    lane = HashLane()
    try:
        lane.update(check, b"abc")
        lane.drain()
        check.check("f")
    finally:
        lane.close()
