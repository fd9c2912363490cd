"""Where a file has a BLAKE3 digest (format 2), the digest alone decides on every path that
receives bytes, and none computes the file's crc32c (``local.digests.crc_checked``); the
local verify, whose bytes only this daemon and the job's own pods can have written since
they were hashed, checks crc32c alone (``local.hashing``).

The three receiving paths, each with its real code on real files: a peer's gRPC chunks
(``ItemWriter.write``), the data channel's raw slices (``ItemWriter.write_raw``) and a
backup download (``BackupStore.fetch_pinned`` from a ``file://`` bucket). A format-2
manifest whose crc32c is wrong but whose digest is right is received on all three alike
(the bytes are exactly those the producing node hashed); a flipped byte, or other bytes of
the same size and crc32c, is ``CorruptItem`` on all three. A format-1 manifest (no digest)
still has its crc32c checked, on those and on the local verify.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import blake3
import google_crc32c
import pytest

from mtc_replicator.core.backup_layout import manifest_key
from mtc_replicator.core.manifest import LEGACY_VERSION, CorruptItem, ItemId, Manifest
from mtc_replicator.local import hashing
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.transport.transfer import SEND_CHUNK, ItemWriter, iter_chunks
from tests.forge import same_crc32c

ITEM = ItemId("job", 7, 0, 0)
BIG = 3 * SEND_CHUNK + 4097
"""Over the verify's read size and several chunks: every read of a reused buffer counts."""


def make_item(root: Path, files: int) -> Path:
    root.mkdir()
    for i in range(files):
        (root / f"shard-{i}.bin").write_bytes(os.urandom(BIG + i))
    return root


def crc_lies(m: Manifest) -> Manifest:
    """``m`` with every file's crc32c wrong and its digest right."""
    files = tuple(dataclasses.replace(f, crc32c=f.crc32c ^ 0x5A5A5A5A) for f in m.files)
    return dataclasses.replace(m, files=files)


def legacy(m: Manifest) -> Manifest:
    files = tuple(dataclasses.replace(f, blake3=None) for f in m.files)
    return dataclasses.replace(m, files=files, version=LEGACY_VERSION)


def local(m: Manifest, data: Path, tmp: Path) -> None:
    verify_item(m, data)


def grpc_chunks(m: Manifest, data: Path, tmp: Path) -> None:
    """As ``transfer.receive_item`` does: checked chunks, hashed beside the writer."""
    staged = tmp / "staged-grpc"
    staged.mkdir()
    writer = ItemWriter(m, staged, hash_aside=True)
    try:
        for index, offset, chunk, crc in iter_chunks(m, data):
            writer.write(index, offset, chunk, crc)
        writer.finish()
    finally:
        writer.close()


def data_channel(m: Manifest, data: Path, tmp: Path) -> None:
    """As ``datachannel.receive_into`` does: raw slices with no checksum of their own."""
    staged = tmp / "staged-raw"
    staged.mkdir()
    writer = ItemWriter(m, staged)  # hashed inline, as ``datachannel.receive_staged`` does
    try:
        for index, entry in enumerate(m.files):
            raw = (data / entry.path).read_bytes()
            for off in range(0, len(raw), 65536):
                writer.write_raw(index, off, raw[off : off + 65536])
        writer.finish()
    finally:
        writer.close()


def backup(m: Manifest, data: Path, tmp: Path) -> None:
    """The bucket holds ``data``'s bytes under the manifest ``m`` (written as a bucket
    writer would: the upload itself hands the object store the real crc32c)."""
    objects = FileObjectStore(tmp / "bucket")
    real = build_manifest(m.item, data)
    BackupStore(objects).upload_item(real, data)
    objects.put_bytes(manifest_key(m.item), m.to_json())
    staged = tmp / "staged-backup"
    staged.mkdir()
    BackupStore(objects).fetch_pinned(m.item, m.digest, staged)


PATHS: dict[str, Callable[[Manifest, Path, Path], None]] = {
    "grpc-chunks": grpc_chunks,
    "data-channel": data_channel,
    "backup": backup,
}


@pytest.fixture(params=sorted(PATHS))
def path(request: pytest.FixtureRequest) -> Callable[[Manifest, Path, Path], None]:
    return PATHS[request.param]


@pytest.mark.parametrize("files", [1, 5], ids=["one-file", "many-files"])
def test_a_format_2_item_with_a_wrong_crc32c_and_the_right_digest_restores(
    path: Callable[[Manifest, Path, Path], None], tmp_path: Path, files: int
) -> None:
    """The digest decides: the bytes are the ones the producing node hashed. (Before
    digests, these paths refused such an item.)"""
    data = make_item(tmp_path / "step", files)
    path(crc_lies(build_manifest(ITEM, data)), data, tmp_path)


@pytest.mark.parametrize("files", [1, 5], ids=["one-file", "many-files"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_format_2_item_with_a_flipped_byte_is_refused(
    path: Callable[[Manifest, Path, Path], None], tmp_path: Path, files: int, where: str
) -> None:
    data = make_item(tmp_path / "step", files)
    m = build_manifest(ITEM, data)
    victim = data / m.files[-1].path
    raw = bytearray(victim.read_bytes())
    at = {"first": 0, "middle": len(raw) // 2, "last": len(raw) - 1}[where]
    raw[at] ^= 0x01
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptItem, match="content digest"):
        path(m, data, tmp_path)


def test_same_size_same_crc32c_bytes_are_refused_by_the_digest(
    path: Callable[[Manifest, Path, Path], None], tmp_path: Path
) -> None:
    data = make_item(tmp_path / "step", 2)
    m = build_manifest(ITEM, data)
    victim = data / m.files[0].path
    forged = same_crc32c(victim.read_bytes())
    assert google_crc32c.value(forged) == m.files[0].crc32c
    victim.write_bytes(forged)
    with pytest.raises(CorruptItem, match="content digest"):
        path(m, data, tmp_path)


@pytest.mark.parametrize("receive", [*sorted(PATHS), "local"])
def test_a_format_1_item_still_has_its_crc32c_checked(receive: str, tmp_path: Path) -> None:
    path = {**PATHS, "local": local}[receive]
    data = make_item(tmp_path / "step", 2)
    m = legacy(build_manifest(ITEM, data))
    victim = data / m.files[1].path
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x80
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptItem):
        path(m, data, tmp_path)


# --- the local verify: crc32c ----------------------------------------------------------------


@pytest.mark.parametrize("files", [1, 5], ids=["one-file", "many-files"])
def test_the_local_verify_checks_every_file_by_crc32c(tmp_path: Path, files: int) -> None:
    """A format-2 item in the store is read in ranges whose crc32cs combine, digest or not:
    a crc32c the bytes do not have is refused (the digest alone would have passed it), and
    so is a byte flipped in a file's first, middle or last range."""
    data = make_item(tmp_path / "step", files)
    m = build_manifest(ITEM, data)
    verify_item(m, data)
    with pytest.raises(CorruptItem, match="crc32c"):
        verify_item(crc_lies(m), data)
    victim = data / m.files[-1].path
    raw = bytearray(victim.read_bytes())
    for at in (0, len(raw) // 2, len(raw) - 1):
        raw[at] ^= 0x01
        victim.write_bytes(bytes(raw))
        with pytest.raises(CorruptItem, match="crc32c"):
            verify_item(m, data)
        raw[at] ^= 0x01
    victim.write_bytes(bytes(raw))
    verify_item(m, data)


def test_the_local_verify_computes_no_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local tier's check costs crc32c's pass, not BLAKE3's: no hasher is made (the
    digest was computed, or checked on arrival, when the bytes came under this daemon)."""
    data = make_item(tmp_path / "step", 3)
    m = build_manifest(ITEM, data)

    def no_hasher(**_: object) -> None:
        raise AssertionError("the local verify computed a BLAKE3 digest")

    monkeypatch.setattr(hashing.digests, "hasher", no_hasher)
    verify_item(m, data)


@pytest.mark.parametrize("files", [1, 2, 9], ids=["one", "fewer-than-cores", "more"])
def test_ingest_and_verify_read_every_piece_in_order(
    tmp_path: Path, files: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of several reads, hashed with the hasher's threads (one read hashed on a lane
    while the next fills the other buffer) or without: ingest's digest is BLAKE3 of the
    whole file, its crc32c the file's (the local verify checks it), and a byte flipped in
    any read, the last one's last byte included, is refused."""
    monkeypatch.setattr(hashing, "_pool_threads", lambda: 4)
    root = tmp_path / "step"
    root.mkdir()
    size = 2 * hashing.CHUNK + hashing.VERIFY_READ + 5
    for i in range(files):
        (root / f"f{i}").write_bytes(os.urandom(size))
    m = build_manifest(ITEM, root)
    for entry in m.files:
        assert entry.blake3 == blake3.blake3((root / entry.path).read_bytes()).hexdigest()
    verify_item(m, root)
    victim = root / m.files[-1].path
    for at in (hashing.VERIFY_READ + 1, hashing.CHUNK + 3, 2 * hashing.CHUNK + 1, size - 1):
        raw = bytearray(victim.read_bytes())
        raw[at] ^= 0x04
        victim.write_bytes(bytes(raw))
        with pytest.raises(CorruptItem, match="crc32c"):
            verify_item(m, root)
        raw[at] ^= 0x04
        victim.write_bytes(bytes(raw))
    verify_item(m, root)
