"""Tests for ``mtc_replicator.transport.transfer``: crc32c arithmetic, chunked reads, verified
writes.

Real files in ``tmp_path``; no sockets. The gRPC layer on top is tested against real daemon
processes in ``tests/integration/test_peer*.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.crc import crc32c_combine
from mtc_replicator.core.manifest import (
    LEGACY_VERSION,
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
)
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.transport.transfer import (
    MAX_CHUNK,
    ItemWriter,
    TransferError,
    check_manifest,
    discard_staging,
    iter_chunks,
    room_on,
)
from tests.forge import same_crc32c

ITEM = ItemId("job", 3, 1, 0)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_combine_equals_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    combined = crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    assert combined == google_crc32c.value(a + b)


def test_combine_over_a_full_chunk() -> None:
    a, b = os.urandom(7), os.urandom(1 << 20)
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == (
        google_crc32c.value(a + b)
    )


def make_tree(root: Path) -> Path:
    (root / "state" / "deep").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "_CHECKPOINT_METADATA").write_bytes(b'{"step": 3}')
    (root / "state" / "big.bin").write_bytes(os.urandom(5 * 1024 + 17))
    (root / "state" / "deep" / "zero.bin").write_bytes(b"")
    (root / "state" / "deep" / "small.bin").write_bytes(b"abc")
    return root


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Manifest, Path]:
    data = make_tree(tmp_path / "src")
    return build_manifest(ITEM, data), data


def staging(tmp_path: Path) -> Path:
    d = tmp_path / "staged"
    d.mkdir()
    return d


Chunks = list[tuple[int, int, bytes, int]]


def feed(writer: ItemWriter, chunks: Chunks) -> None:
    """Write every chunk, then end the stream; the writer is closed whatever happens."""
    try:
        for chunk in chunks:
            writer.write(*chunk)
        writer.finish()
    finally:
        writer.close()


def copy(manifest: Manifest, data: Path, staged: Path, chunk_size: int = 1024) -> None:
    feed(ItemWriter(manifest, staged), list(iter_chunks(manifest, data, chunk_size)))


def test_a_tree_round_trips_byte_for_byte(tree: tuple[Manifest, Path], tmp_path: Path) -> None:
    manifest, data = tree
    staged = staging(tmp_path)
    copy(manifest, data, staged)
    verify_item(manifest, staged / "data")
    assert (staged / "data" / "empty_dir").is_dir()
    assert (staged / "data" / "state" / "deep" / "zero.bin").read_bytes() == b""


def test_a_file_item_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "model.pt"
    src.write_bytes(os.urandom(3000))
    manifest = build_manifest(ITEM, src)
    staged = staging(tmp_path)
    copy(manifest, src, staged, chunk_size=1000)
    assert (staged / "data").read_bytes() == src.read_bytes()


def test_chunks_are_page_aligned_and_sized(tree: tuple[Manifest, Path]) -> None:
    manifest, data = tree
    chunks = list(iter_chunks(manifest, data, 4096))
    big = [c for c in chunks if manifest.files[c[0]].path == "state/big.bin"]
    assert [c[1] for c in big] == [0, 4096]
    assert all(c[3] == google_crc32c.value(c[2]) for c in chunks)
    # Empty files send nothing; the manifest creates them.
    assert all(manifest.files[c[0]].size > 0 for c in chunks)


def test_a_source_shorter_than_its_manifest_is_corrupt(tree: tuple[Manifest, Path]) -> None:
    manifest, data = tree
    (data / "state" / "big.bin").write_bytes(b"short")
    with pytest.raises(CorruptItem, match=r"big\.bin"):
        list(iter_chunks(manifest, data))


def chunks_of(manifest: Manifest, data: Path) -> Chunks:
    return list(iter_chunks(manifest, data, 1024))


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda c: [(9, *c[0][1:]), *c[1:]], TransferError, "out of range"),
        (lambda c: [(c[0][0], 5, *c[0][2:]), *c[1:]], TransferError, "expected 0"),
        (lambda c: [(*c[0][:3], c[0][3] ^ 1), *c[1:]], CorruptItem, "fails its crc32c"),
        (lambda c: [c[0], c[0], *c[1:]], TransferError, "expected"),
        (lambda c: c[1:], CorruptItem, "received 0 bytes"),
        (lambda c: [(c[0][0], 0, b"", 0), *c], TransferError, "chunk of 0 bytes"),
    ],
    ids=["index-out-of-range", "gap", "bad-crc", "repeat", "missing-first", "empty-chunk"],
)
def test_the_writer_rejects_a_broken_stream(
    tree: tuple[Manifest, Path],
    tmp_path: Path,
    mutate: object,
    error: type[Exception],
    match: str,
) -> None:
    manifest, data = tree
    chunks = mutate(chunks_of(manifest, data))  # type: ignore[operator]
    writer = ItemWriter(manifest, staging(tmp_path))
    with pytest.raises(error, match=match):
        feed(writer, chunks)


def test_a_chunk_past_the_declared_size_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"0123456789")
    manifest = build_manifest(ITEM, src)
    writer = ItemWriter(manifest, staging(tmp_path))
    more = b"0123456789ab"
    with pytest.raises(TransferError, match="data up to 12 bytes"):
        writer.write(0, 0, more, google_crc32c.value(more))
    writer.close()


def test_an_earlier_file_after_a_later_one_is_rejected(
    tree: tuple[Manifest, Path], tmp_path: Path
) -> None:
    manifest, data = tree
    chunks = chunks_of(manifest, data)
    writer = ItemWriter(manifest, staging(tmp_path))
    with pytest.raises((TransferError, CorruptItem)):
        feed(writer, chunks[::-1])


def test_a_format_1_files_whole_crc_is_checked_when_the_file_is_complete(
    tmp_path: Path,
) -> None:
    # A format-2 file's digest decides instead (tests/unit/local/test_digests_decide.py).
    src = tmp_path / "f"
    src.write_bytes(b"payload")
    good = build_manifest(ITEM, src)
    entry = dataclasses.replace(good.files[0], crc32c=0xDEADBEEF, blake3=None)
    lying = Manifest(ITEM, good.kind, (entry,), version=LEGACY_VERSION)
    writer = ItemWriter(lying, staging(tmp_path))
    writer.write(0, 0, b"payload", google_crc32c.value(b"payload"))
    with pytest.raises(CorruptItem, match="deadbeef"):
        writer.finish()
    writer.close()


@pytest.mark.parametrize("planted", ["dangling-file-link", "dir-swapped-for-link"])
def test_a_planted_symlink_is_never_followed(
    tree: tuple[Manifest, Path], tmp_path: Path, planted: str
) -> None:
    manifest, data = tree
    outside = tmp_path / "outside"
    outside.mkdir()
    staged = staging(tmp_path)
    writer = ItemWriter(manifest, staged)
    # Someone with access to the staging area plants links before the data arrives.
    if planted == "dangling-file-link":
        (staged / "data" / "state" / "big.bin").symlink_to(outside / "planted")
        expected: type[OSError] = FileExistsError
    else:
        (staged / "data" / "state" / "deep").rmdir()
        (staged / "data" / "state" / "deep").symlink_to(outside)
        expected = OSError  # ELOOP
    with pytest.raises(expected):
        feed(writer, chunks_of(manifest, data))
    assert list(outside.iterdir()) == []


def test_a_chunk_larger_than_the_protocol_allows_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"x")
    manifest = Manifest(ITEM, build_manifest(ITEM, src).kind, ())
    big = bytes(MAX_CHUNK + 1)
    writer = ItemWriter(manifest, staging(tmp_path))
    with pytest.raises(TransferError, match="chunk of"):
        writer.write(0, 0, big, google_crc32c.value(big))
    writer.close()


def test_check_manifest_accepts_exactly_the_canonical_bytes_its_digest_names(
    tree: tuple[Manifest, Path],
) -> None:
    manifest, _ = tree
    raw = manifest.to_json()
    digest = hashlib.sha256(raw).hexdigest()
    assert check_manifest(raw, digest, ITEM) == manifest
    with pytest.raises(CorruptItem, match="sha256"):
        check_manifest(raw, "0" * 64, ITEM)
    with pytest.raises(TransferError, match="64 lowercase hex"):
        check_manifest(raw, digest.upper(), ITEM)
    pretty = json.dumps(json.loads(raw), indent=1).encode()
    with pytest.raises(TransferError, match="canonical"):
        check_manifest(pretty, digest, ITEM)
    # An attestation beside the content: the digest still names the content alone.
    attested = ManifestTrust().attest(manifest, "team-a", 1.0)
    assert check_manifest(attested.to_json(), digest, ITEM).attestation == attested.attestation
    with pytest.raises(TransferError, match="the header names"):
        check_manifest(raw, digest, ItemId("job", 4, 1, 0))


def test_room_keeps_a_margin_of_at_most_a_sixteenth(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    room = room_on(tmp_path, reserve=1 << 20)
    assert free - (1 << 20) - (1 << 22) <= room <= free  # statvfs moves a little meanwhile
    assert room_on(tmp_path, reserve=1 << 62) <= free - total // 16 + (1 << 22)


def test_many_empty_files_hold_one_descriptor_at_a_time(tmp_path: Path) -> None:
    """3,000 empty files with room for 64 more descriptors than the process holds now: each
    is created and closed at once (they were once held until the item was finished: EMFILE).
    Counted from what is open, since earlier tests in the same process may hold many."""
    empty = blake3.blake3().hexdigest()
    files = tuple(FileEntry(f"f{i:05d}", 0, 0, empty) for i in range(3000))
    manifest = Manifest(ItemId("job", 1, 0, 0), ItemKind.DIR, files)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 64, hard))
    try:
        ItemWriter(manifest, tmp_path).finish()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(os.listdir(tmp_path / "data")) == 3000


# --- content digests ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["checked chunks", "raw slices"])
def test_bytes_of_the_same_size_and_crc32c_are_refused_by_their_digest(
    tmp_path: Path, how: str
) -> None:
    """A peer (a pull, a push, the data channel) sends other bytes whose every chunk crc and
    whole-file crc32c match: only the manifest's BLAKE3 digest tells them apart."""
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3000))
    manifest = build_manifest(ITEM, src)
    forged = same_crc32c(src.read_bytes())
    writer = ItemWriter(manifest, staging(tmp_path))
    if how == "checked chunks":
        writer.write(0, 0, forged, google_crc32c.value(forged))
    else:
        writer.write_raw(0, 0, forged)
    with pytest.raises(CorruptItem, match=r"content digest \(blake3\)"):
        writer.finish()
    writer.close()


@pytest.mark.parametrize("aside", [False, True], ids=["inline", "hash aside"])
@pytest.mark.parametrize("version", ["format 2", "format 1"])
@pytest.mark.parametrize("flip", [False, True], ids=["intact", "a flipped byte"])
def test_raw_slices_may_be_views_of_buffers_the_caller_reuses(
    tmp_path: Path, aside: bool, version: str, flip: bool
) -> None:
    """The data channel hands ``write_raw`` views of ``slices_held`` buffers it refills in
    turn (no ``bytes`` per slice): every check still sees each slice as it came, the
    digest (format 2) or the whole-file crc32c (format 1, whose crc needs the copy)."""
    src = tmp_path / "f"
    data = os.urandom(40 * 1024 + 123)
    src.write_bytes(data)
    manifest = build_manifest(ITEM, src)
    if version == "format 1":
        files = tuple(dataclasses.replace(f, blake3=None) for f in manifest.files)
        manifest = dataclasses.replace(manifest, files=files, version=LEGACY_VERSION)
    wire = bytearray(data)
    if flip:
        wire[5000] ^= 0x01
    writer = ItemWriter(manifest, staging(tmp_path), hash_aside=aside)
    ring = [memoryview(bytearray(1024)) for _ in range(writer.slices_held)]
    try:
        for turn, off in enumerate(range(0, len(wire), 1024)):
            view = ring[turn % len(ring)]
            piece = wire[off : off + 1024]
            view[: len(piece)] = piece
            writer.write_raw(0, off, view[: len(piece)])
        if flip:
            with pytest.raises(CorruptItem, match="blake3" if version == "format 2" else "crc32c"):
                writer.finish()
            return
        writer.finish()
    finally:
        writer.close()
    assert (tmp_path / "staged" / "data").read_bytes() == data


def test_the_digest_is_fed_every_chunk_in_order(tmp_path: Path) -> None:
    src = tmp_path / "f"
    data = os.urandom(10_000)
    src.write_bytes(data)
    manifest = build_manifest(ITEM, src)
    writer = ItemWriter(manifest, staging(tmp_path))
    for off in range(0, len(data), 999):
        part = data[off : off + 999]
        writer.write(0, off, part, google_crc32c.value(part))
    writer.finish()
    assert (tmp_path / "staged" / "data").read_bytes() == data


def test_a_format_1_manifest_is_received_on_its_crc32c(tmp_path: Path) -> None:
    """From a daemon of the version before digests (a rolling upgrade): accepted as before."""
    src = tmp_path / "f"
    src.write_bytes(b"older node")
    built = build_manifest(ITEM, src)
    old = Manifest(ITEM, built.kind, (dataclasses.replace(built.files[0], blake3=None),), version=1)
    writer = ItemWriter(old, staging(tmp_path))
    writer.write(0, 0, b"older node", google_crc32c.value(b"older node"))
    writer.finish()


def test_skipping_to_a_later_file_makes_the_ones_before_and_counts_them(tmp_path: Path) -> None:
    """``skip_to`` (what the receiving loop hands a thread when a chunk skips many files)
    makes every file before the one named, as ``accept`` would; ``moved`` counts a page for
    each (``core.pacing.ENTRY_BYTES``) beside the bytes; a partly received file it would
    pass over is corrupt."""
    empty = blake3.blake3().hexdigest()
    files = (
        *(FileEntry(f"e{i:03d}", 0, 0, empty) for i in range(100)),
        FileEntry("last", 1, google_crc32c.value(b"x"), blake3.blake3(b"x").hexdigest()),
    )
    manifest = Manifest(ITEM, ItemKind.DIR, files)
    writer = ItemWriter(manifest, tmp_path)
    assert writer.moved == 0
    writer.skip_to(100)
    assert writer.next_file == 100
    assert writer.moved == 100 * 4096
    writer.write(100, 0, b"x", google_crc32c.value(b"x"))
    writer.finish()
    assert writer.moved == 101 * 4096 + 1
    assert len(os.listdir(tmp_path / "data")) == 101

    two = Manifest(ITEM, ItemKind.DIR, (files[-1], dataclasses.replace(files[-1], path="z")))
    again = tmp_path / "again"
    again.mkdir()
    writer = ItemWriter(two, again)
    with pytest.raises(CorruptItem, match="received 0 bytes"):
        writer.skip_to(1)
    writer.close()


def test_a_staged_copy_is_removed_even_when_its_push_is_cancelled_while_the_removal_waits(
    tmp_path: Path,
) -> None:
    """The removal is queued behind a busy pool when the push's task is cancelled (the
    puller hung up during the cleanup): it still runs, and nothing staged is left."""
    staged = tmp_path / "staging" / "0-abc"
    (staged / "data").mkdir(parents=True)
    (staged / "data" / "state").write_bytes(b"x" * 4096)
    busy = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(busy.wait, 10.0)  # the removal queues behind this

        async def scenario() -> None:
            task = asyncio.create_task(discard_staging(staged, pool))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            busy.set()

        asyncio.run(scenario())
    assert not staged.exists()
