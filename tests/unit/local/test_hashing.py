"""Tests for ``mtc_replicator.local.hashing``'s parallel verify: whatever a one-thread, one-pass
verify caught is still caught when files and ranges of a file are hashed on many threads.

Real files in ``tmp_path``; ``PIECE`` is made small so a file of a few hundred KiB has many
ranges (the same code paths as 32 MiB ranges of a 1 GiB file). Each test runs on a manifest
with BLAKE3 digests (a file is one whole-file read) and on its format-1 form, written before
digests (crc32c ranges), since stores and backups still hold those.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import (
    LEGACY_VERSION,
    Cancelled,
    CorruptItem,
    ItemId,
    Manifest,
    ManifestError,
)
from mtc_replicator.local import hashing
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.transport.transfer import ItemWriter, iter_chunks
from tests.forge import same_crc32c

ITEM = ItemId("job-1", 7, 0, 0)
PIECE = 64 * 1024


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "PIECE", PIECE)


def legacy(m: Manifest) -> Manifest:
    """``m`` as a format-1 manifest, written before digests, says it."""
    files = tuple(dataclasses.replace(f, blake3=None) for f in m.files)
    return dataclasses.replace(m, files=files, version=LEGACY_VERSION)


def bad(name: str) -> str:
    """What a verify says of a file whose bytes differ: its digest, or its crc32c."""
    return rf"{name}( has size .* crc32c|: content digest)"


@pytest.fixture(params=[False, True], ids=["digests", "legacy"])
def old(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def item(tmp_path: Path, old: bool) -> tuple[Manifest, Path]:
    """A large file of 4.5 ranges, small files, an empty file, one a single range long."""
    root = tmp_path / "step"
    (root / "d").mkdir(parents=True)
    (root / "big").write_bytes(os.urandom(4 * PIECE + PIECE // 2))
    (root / "exact").write_bytes(os.urandom(PIECE))
    (root / "d" / "small").write_bytes(b"s" * 1000)
    (root / "empty").write_bytes(b"")
    m = build_manifest(ITEM, root)
    return (legacy(m) if old else m), root


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def unchanged(path: Path, data: bytes) -> None:
    assert path.read_bytes() == data  # verifying never writes


def test_an_intact_item_verifies(item: tuple[Manifest, Path]) -> None:
    m, root = item
    verify_item(m, root)


@pytest.mark.parametrize("offset", [PIECE + PIECE // 2, 0, PIECE - 1, PIECE, 4 * PIECE + 10])
def test_a_flipped_byte_in_any_range_is_caught(item: tuple[Manifest, Path], offset: int) -> None:
    """The middle of the second range, and each range's edges, the last range's too."""
    m, root = item
    flip(root / "big", offset)
    with pytest.raises(CorruptItem, match=bad("big")):
        verify_item(m, root)


def test_two_equal_ranges_swapped_are_caught(tmp_path: Path, old: bool) -> None:
    """Ranges must combine in order: a file whose halves trade places differs."""
    a, b = os.urandom(PIECE), os.urandom(PIECE)
    f = tmp_path / "f"
    f.write_bytes(a + b)
    m = build_manifest(ITEM, f)
    m = legacy(m) if old else m
    f.write_bytes(b + a)
    with pytest.raises(CorruptItem, match=bad("the file")):
        verify_item(m, f)


@pytest.mark.parametrize("size", [4 * PIECE + PIECE // 2 - 1, 2 * PIECE + 5, PIECE, 0])
def test_a_truncated_large_file_is_caught(item: tuple[Manifest, Path], size: int) -> None:
    m, root = item
    os.truncate(root / "big", size)
    with pytest.raises(CorruptItem, match=f"big has size {size}, manifest says size"):
        verify_item(m, root)


@pytest.mark.parametrize("name", ["big", "exact", "d/small", "empty"])
def test_extra_bytes_after_a_file_are_caught(item: tuple[Manifest, Path], name: str) -> None:
    """Bytes beyond the manifest's size, in a file of many ranges, one, or none."""
    m, root = item
    with open(root / name, "ab") as f:
        f.write(b"x")
    with pytest.raises(CorruptItem, match=f"{name} has size"):
        verify_item(m, root)


def test_a_flipped_byte_in_a_small_file_among_many_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "many"
    root.mkdir()
    for i in range(40):
        (root / f"f{i:02}").write_bytes(os.urandom(3000 + i))
    m = build_manifest(ITEM, root)
    flip(root / "f37", 2999)
    with pytest.raises(CorruptItem, match="f37"):
        verify_item(m, root)


def test_the_first_bad_file_in_manifest_order_is_named(item: tuple[Manifest, Path]) -> None:
    """Several bad files: the message is the same whichever thread finished first."""
    m, root = item
    flip(root / "big", 3 * PIECE)
    flip(root / "exact", 1)
    with pytest.raises(CorruptItem, match=bad("big")):
        verify_item(m, root)


def test_a_file_replaced_by_a_symlink_is_caught(item: tuple[Manifest, Path]) -> None:
    m, root = item
    (root / "exact").unlink()
    os.symlink("/etc/hostname", root / "exact")
    with pytest.raises(CorruptItem, match=r"exact. is neither a regular file"):
        verify_item(m, root)


def test_cancelling_stops_the_verify(item: tuple[Manifest, Path]) -> None:
    m, root = item
    with pytest.raises(Cancelled):
        verify_item(m, root, lambda: True)


def test_a_verify_uses_several_threads_and_leaves_the_data_alone(
    item: tuple[Manifest, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    m, root = item
    before = (root / "big").read_bytes()
    seen: set[int] = set()
    real = hashing._range_crc  # observed, not replaced

    def watched(*args: object) -> hashing._Result:
        seen.add(threading.get_ident())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(hashing, "_range_crc", watched)
    verify_item(m, root)
    unchanged(root / "big", before)
    if (os.cpu_count() or 1) > 1:
        assert threading.get_ident() not in seen  # on the pool, not the caller's thread


def test_a_file_swapped_for_a_non_regular_one_mid_verify_is_corruption(
    item: tuple[Manifest, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the walk and a range's open the file can change under us (a pod still holds
    the directory): that is corruption of the copy, not a malformed manifest."""
    m, root = item

    def swapped(base: Path | int, rel: str) -> int:
        raise ManifestError(f"{rel!r} is a FIFO, not a regular file")

    monkeypatch.setattr(hashing, "_open_regular", swapped)
    with pytest.raises(CorruptItem, match="not a regular file"):
        verify_item(m, root)


def test_the_local_verify_leaves_a_same_crc32c_forgery_to_the_receiving_paths(
    tmp_path: Path,
) -> None:
    """Bytes of the same size and crc32c: the local verify, crc32c's check, cannot tell
    (only the job's own pods and the daemon write the store, SECURITY.md "Content
    digests"); a peer's copy of them, checked by digest as it arrives, is refused."""
    f = tmp_path / "f"
    f.write_bytes(os.urandom(3 * PIECE + 17))
    m = build_manifest(ITEM, f)
    f.write_bytes(same_crc32c(f.read_bytes()))
    verify_item(m, f)
    verify_item(legacy(m), f)
    staged = tmp_path / "staged"
    staged.mkdir()
    writer = ItemWriter(m, staged)

    def receive() -> None:
        for index, offset, chunk, crc in iter_chunks(m, f):
            writer.write(index, offset, chunk, crc)
        writer.finish()

    try:
        with pytest.raises(CorruptItem, match="content digest"):
            receive()
    finally:
        writer.close()
