"""Tests for ``mtc_replicator.core.manifest``: building, serialising, parsing hostile input,
verifying.

Real files in ``tmp_path``; no sockets, no subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import blake3
import google_crc32c
import pytest

from mtc_replicator.core import manifest as manifest_mod
from mtc_replicator.core.manifest import (
    CorruptItem,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
)
from mtc_replicator.local import hashing
from mtc_replicator.local.hashing import build_manifest, verify_item

ITEM = ItemId("job-1", 42, 3, 1)


def make_tree(root: Path) -> Path:
    """A small checkpoint tree like Orbax's, with an empty directory."""
    (root / "state" / "d").mkdir(parents=True)
    (root / "process_metadata").mkdir()
    (root / "empty").mkdir()
    (root / "_CHECKPOINT_METADATA").write_bytes(b'{"step": 42}')
    (root / "state" / "manifest.ocdbt").write_bytes(b"m" * 1000)
    (root / "state" / "d" / "abc").write_bytes(bytes(range(256)) * 40)
    (root / "process_metadata" / "0.json").write_bytes(b"")
    return root


def good_dict() -> dict[str, Any]:
    return {
        "version": 1,
        "job": "job-1",
        "step": 42,
        "rank": 3,
        "worker": 1,
        "kind": "dir",
        "dirs": ["a", "a/b", "empty"],
        "files": [["a/b/c", 5, "0000abcd"], ["top", 0, "00000000"]],
    }


def raw(data: object) -> bytes:
    return json.dumps(data).encode()


# --- building ----------------------------------------------------------------------------------


def test_build_manifest_on_a_tree_lists_every_file_and_dir(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "step")
    m = build_manifest(ITEM, root)
    assert m.item == ITEM
    assert m.kind is ItemKind.DIR
    assert m.dirs == ("empty", "process_metadata", "state", "state/d")
    assert [f.path for f in m.files] == [
        "_CHECKPOINT_METADATA",
        "process_metadata/0.json",
        "state/d/abc",
        "state/manifest.ocdbt",
    ]
    by_path = {f.path: f for f in m.files}
    content = bytes(range(256)) * 40
    assert by_path["state/d/abc"] == FileEntry(
        "state/d/abc",
        len(content),
        google_crc32c.value(content),
        blake3.blake3(content).hexdigest(),
    )
    assert by_path["process_metadata/0.json"].size == 0
    assert by_path["process_metadata/0.json"].crc32c == 0
    assert m.total_bytes == 12 + 1000 + 10240


def test_build_manifest_on_a_single_file(tmp_path: Path) -> None:
    f = tmp_path / "ckpt.save"
    f.write_bytes(b"hello world")
    m = build_manifest(ITEM, f)
    assert m.kind is ItemKind.FILE
    assert m.dirs == ()
    hello = b"hello world"
    assert m.files == (
        FileEntry("", 11, google_crc32c.value(hello), blake3.blake3(hello).hexdigest()),
    )


def test_build_manifest_crosses_chunk_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashing, "CHUNK", 7)
    data = os.urandom(100)
    (tmp_path / "f").write_bytes(data)
    assert build_manifest(ITEM, tmp_path / "f").files[0].crc32c == google_crc32c.value(data)


def test_symlink_inside_a_tree_is_refused(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "step")
    (root / "state" / "link").symlink_to("/etc/passwd")
    with pytest.raises(ManifestError, match="link"):
        build_manifest(ITEM, root)


def test_symlink_as_the_item_itself_is_refused(tmp_path: Path) -> None:
    make_tree(tmp_path / "step")
    (tmp_path / "alias").symlink_to(tmp_path / "step")
    with pytest.raises(ManifestError):
        build_manifest(ITEM, tmp_path / "alias")


# --- serialising -------------------------------------------------------------------------------


def test_to_json_is_canonical_and_digest_is_stable(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "step")
    a = build_manifest(ITEM, root)
    b = build_manifest(ITEM, root)
    assert a.to_json() == b.to_json()
    assert a.digest == b.digest
    assert len(a.digest) == 64
    text = a.to_json().decode()
    assert " " not in text  # compact separators
    assert list(json.loads(text)) == sorted(json.loads(text))  # sorted keys
    # Re-serialising what was parsed gives the same bytes, whatever the input's key order.
    shuffled = json.dumps(dict(reversed(list(json.loads(text).items())))).encode()
    assert Manifest.from_json(shuffled).to_json() == a.to_json()


def test_digest_changes_with_content(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "step")
    before = build_manifest(ITEM, root).digest
    (root / "state" / "manifest.ocdbt").write_bytes(b"n" * 1000)
    assert build_manifest(ITEM, root).digest != before
    assert build_manifest(ItemId("job-1", 43, 3, 1), root).digest != before


@pytest.mark.parametrize("kind", ["tree", "file"])
def test_from_json_round_trip(tmp_path: Path, kind: str) -> None:
    if kind == "tree":
        data = make_tree(tmp_path / "step")
    else:
        data = tmp_path / "f"
        data.write_bytes(b"x" * 33)
    m = build_manifest(ITEM, data)
    back = Manifest.from_json(m.to_json())
    assert back == m
    assert back.digest == m.digest


def test_the_good_fixture_parses() -> None:
    # Guards the hostile cases below: each one changes exactly one thing in a valid manifest.
    m = Manifest.from_json(raw(good_dict()))
    assert m.files[0] == FileEntry("a/b/c", 5, 0xABCD)
    assert m.dirs == ("a", "a/b", "empty")


# --- hostile input -----------------------------------------------------------------------------


def with_file_path(path: object) -> dict[str, Any]:
    d = good_dict()
    d["files"] = [[path, 1, "00000001"]]
    d["dirs"] = []
    return d


def with_field(key: str, value: object) -> dict[str, Any]:
    d = good_dict()
    d[key] = value
    return d


def with_entry(entry: object) -> dict[str, Any]:
    d = good_dict()
    d["files"] = [entry]
    d["dirs"] = ["a", "a/b"]
    return d


def v2_entry(digest: object) -> dict[str, Any]:
    d = with_entry(["a/b/c", 1, "00000001", digest])
    d["version"] = 2
    return d


HOSTILE: dict[str, dict[str, Any]] = {
    "absolute path": with_file_path("/etc/passwd"),
    "dot-dot": with_file_path("../escape"),
    "dot-dot inside": with_file_path("a/../../escape"),
    "dot": with_file_path("./x"),
    "lone dot": with_file_path("."),
    "lone dot-dot": with_file_path(".."),
    "empty component": with_file_path("a//b"),
    "trailing slash": with_file_path("x/"),
    "empty path in a dir item": with_file_path(""),
    "backslash": with_file_path("..\\escape"),
    "NUL": with_file_path("x\x00y"),
    "path not a string": with_file_path(7),
    "overlong path": with_file_path("x" * 5000),
    # Each below once reached the filesystem and failed there (ENAMETOOLONG, an encoding
    # error), which a receiving daemon answered INTERNAL.
    "name over NAME_MAX": with_file_path("x" * 256),
    "path over PATH_MAX in bytes, not in characters": with_file_path(
        "/".join(["\u00e9" * 127] * 20)
    ),
    "a lone surrogate": with_file_path("x\ud800"),
    "deeper than MAX_DEPTH": with_file_path("/".join(["d"] * (manifest_mod.MAX_DEPTH + 1))),
    "huge size": with_entry(["a/b/c", manifest_mod.MAX_FILE_BYTES + 1, "00000000"]),
    "negative size": with_entry(["a/b/c", -1, "00000000"]),
    "bool size": with_entry(["a/b/c", True, "00000000"]),
    "float size": with_entry(["a/b/c", 1.0, "00000000"]),
    "string size": with_entry(["a/b/c", "1", "00000000"]),
    "crc not hex": with_entry(["a/b/c", 1, "zzzzzzzz"]),
    "crc too short": with_entry(["a/b/c", 1, "abc"]),
    "crc as int": with_entry(["a/b/c", 1, 12345]),
    "crc with a sign": with_entry(["a/b/c", 1, "-0000001"]),
    "crc with spaces": with_entry(["a/b/c", 1, " 000001 "]),
    "crc with underscores": with_entry(["a/b/c", 1, "0000_001"]),
    "crc not canonical (upper case)": with_entry(["a/b/c", 1, "0000ABCD"]),
    "entry too short": with_entry(["a/b/c", 1]),
    "entry not a list": with_entry({"path": "a/b/c"}),
    "duplicate file": {
        **good_dict(),
        "files": [["top", 0, "00000000"], ["top", 1, "00000001"]],
    },
    "duplicate dir": {**good_dict(), "dirs": ["a", "a/b", "empty", "empty"]},
    "file that is also a parent dir": {
        **good_dict(),
        "dirs": [],
        "files": [["a", 1, "00000001"], ["a/b", 1, "00000001"]],
    },
    "file that is also a listed parent dir": {
        **good_dict(),
        "dirs": ["a"],
        "files": [["a", 1, "00000001"], ["a/b", 1, "00000001"]],
    },
    "file's parent dir not listed": {**good_dict(), "dirs": ["a", "empty"]},
    "dir's parent dir not listed": {**good_dict(), "dirs": ["a", "a/b", "x/y"]},
    "unsupported version": with_field("version", 3),
    "bool version": with_field("version", True),
    "format 2 entry without a digest": {**good_dict(), "version": 2},
    "format 1 entry with a digest": with_entry(["a/b/c", 1, "00000001", "a" * 64]),
    "digest not hex": v2_entry("z" * 64),
    "digest upper case": v2_entry("A" * 64),
    "digest too short": v2_entry("a" * 63),
    "digest as int": v2_entry(12345),
    "digest null": v2_entry(None),
    "missing version": {k: v for k, v in good_dict().items() if k != "version"},
    "version as string": with_field("version", "1"),
    "job with slash": with_field("job", "a/b"),
    "job with dot-dot": with_field("job", "a..b"),
    "job starting with dot": with_field("job", ".hidden"),
    "empty job": with_field("job", ""),
    "job not a string": with_field("job", 5),
    "negative step": with_field("step", -1),
    "bool rank": with_field("rank", True),
    "string worker": with_field("worker", "1"),
    "unknown kind": with_field("kind", "symlink"),
    "files not a list": with_field("files", {}),
    "dirs missing": {k: v for k, v in good_dict().items() if k != "dirs"},
    "file item with a path": {
        **good_dict(),
        "kind": "file",
        "dirs": [],
        "files": [["x", 1, "00000001"]],
    },
    "file item with two entries": {
        **good_dict(),
        "kind": "file",
        "dirs": [],
        "files": [["", 1, "00000001"], ["", 1, "00000001"]],
    },
    "file item with dirs": {
        **good_dict(),
        "kind": "file",
        "dirs": ["a"],
        "files": [["", 1, "00000001"]],
    },
    "file item with no entry": {**good_dict(), "kind": "file", "dirs": [], "files": []},
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifest_is_rejected(name: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(raw(HOSTILE[name]))


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"not json", id="not JSON"),
        pytest.param(b"\xff\xfe\x00", id="not UTF-8"),
        pytest.param(b"", id="empty"),
        pytest.param(b"[1, 2]", id="array"),
        pytest.param(b'"a string"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply nested array"),
        pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="deeply nested object"),
    ],
)
def test_non_manifest_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(data)


def test_too_many_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "MAX_FILES", 3)
    assert len(good_dict()["files"]) + len(good_dict()["dirs"]) == 5
    with pytest.raises(ManifestError, match="more than 3"):
        Manifest.from_json(raw(good_dict()))


def test_names_at_the_limits_and_undecodable_bytes_are_kept(tmp_path: Path) -> None:
    """What a Linux filesystem can hold within the limits parses back: 255-byte names, a
    path of MAX_DEPTH levels, and names that are not UTF-8 (surrogate escapes)."""
    root = tmp_path / "step"
    deep = root.joinpath(*["d"] * (manifest_mod.MAX_DEPTH - 1))
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(b"x")
    (root / ("n" * 255)).write_bytes(b"y")
    (root / os.fsdecode(b"\xff\xfe")).write_bytes(b"z")
    m = build_manifest(ITEM, root)
    assert Manifest.from_json(m.to_json()) == m


def test_build_manifest_refuses_a_tree_no_manifest_could_carry(tmp_path: Path) -> None:
    root = tmp_path / "step"
    root.joinpath(*["d"] * (manifest_mod.MAX_DEPTH + 1)).mkdir(parents=True)
    with pytest.raises(ManifestError, match="deeper than"):
        build_manifest(ITEM, root)


def test_the_layout_check_is_linear_in_the_depth() -> None:
    """Nested directories as deep as allowed, many times over: the check looks at each
    entry's parent only (it once walked every ancestor of every entry)."""
    d = good_dict()
    d["dirs"] = [
        "/".join(f"{t}x{i}" for i in range(depth))
        for t in range(500)
        for depth in range(1, manifest_mod.MAX_DEPTH + 1)
    ]
    d["files"] = []
    assert len(Manifest.from_json(raw(d)).dirs) == 500 * manifest_mod.MAX_DEPTH


def test_oversized_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(ManifestError, match="exceeds"):
        Manifest.from_json(raw(good_dict()))


# --- verifying ---------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Manifest, Path]:
    root = make_tree(tmp_path / "step")
    return build_manifest(ITEM, root), root


def test_verify_passes_on_intact_tree(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    verify_item(m, root)


def test_verify_passes_on_intact_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc" * 1000)
    verify_item(build_manifest(ITEM, f), f)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_detects_one_flipped_byte(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    flip_byte(root / "state" / "d" / "abc", 5000)
    with pytest.raises(CorruptItem, match="state/d/abc"):
        verify_item(m, root)


def test_verify_detects_a_truncated_file(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    path = root / "state" / "manifest.ocdbt"
    os.truncate(path, 999)
    with pytest.raises(CorruptItem, match="size 999"):
        verify_item(m, root)


def test_verify_detects_an_extra_file(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    (root / "empty" / "intruder").write_bytes(b"")
    with pytest.raises(CorruptItem, match="file list"):
        verify_item(m, root)


def test_verify_detects_an_extra_dir(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    (root / "newdir").mkdir()
    with pytest.raises(CorruptItem, match="file list"):
        verify_item(m, root)


def test_verify_detects_a_missing_file(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    (root / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(CorruptItem, match="file list"):
        verify_item(m, root)


def test_verify_detects_missing_data(tree: tuple[Manifest, Path], tmp_path: Path) -> None:
    m, _ = tree
    with pytest.raises(CorruptItem, match="missing"):
        verify_item(m, tmp_path / "nowhere")


def test_verify_detects_a_dir_where_a_file_is_expected(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    (root / "_CHECKPOINT_METADATA").unlink()
    (root / "_CHECKPOINT_METADATA").mkdir()
    with pytest.raises(CorruptItem):
        verify_item(m, root)


def test_verify_detects_a_symlink_in_place_of_a_file(tree: tuple[Manifest, Path]) -> None:
    m, root = tree
    target = root.parent / "outside"
    target.write_bytes(b'{"step": 42}')  # same bytes: only the type differs
    (root / "_CHECKPOINT_METADATA").unlink()
    (root / "_CHECKPOINT_METADATA").symlink_to(target)
    with pytest.raises(CorruptItem):
        verify_item(m, root)


def test_verify_file_item_against_a_dir(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    m = build_manifest(ITEM, f)
    f.unlink()
    f.mkdir()
    with pytest.raises(CorruptItem, match="regular file"):
        verify_item(m, f)


def test_verify_tree_item_against_a_file(tree: tuple[Manifest, Path], tmp_path: Path) -> None:
    m, _ = tree
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    with pytest.raises(CorruptItem, match="directory"):
        verify_item(m, f)


def test_a_manifest_over_the_callers_entry_limit_is_refused_before_its_entries() -> None:
    """``--max-item-files``: counted before any entry is checked, so a huge hostile list
    costs its JSON parse and no more."""
    body = good_dict()
    assert len(body["files"]) + len(body["dirs"]) == 5
    assert Manifest.from_json(raw(body), max_entries=5).entries == 5
    body["files"].append(["../escape", 1, "zzzz"])  # would be refused for its path or crc
    with pytest.raises(ManifestError, match=r"lists 6 files and directories, more than 5"):
        Manifest.from_json(raw(body), max_entries=5)


# --- content digests and format-1 manifests ---------------------------------------------------


def test_a_built_manifest_carries_each_files_blake3_and_its_digest_covers_them(
    tmp_path: Path,
) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"checkpoint bytes")
    m = build_manifest(ITEM, f)
    assert m.version == manifest_mod.FORMAT_VERSION == 2
    assert not m.unverifiable
    assert m.files[0].blake3 == blake3.blake3(b"checkpoint bytes").hexdigest()
    assert json.loads(m.to_json())["files"] == [
        ["", 16, f"{m.files[0].crc32c:08x}", m.files[0].blake3]
    ]
    other = dataclasses.replace(m.files[0], blake3="0" * 64)
    assert dataclasses.replace(m, files=(other,)).digest != m.digest


def test_a_format_1_manifest_is_read_and_says_it_is_unverifiable() -> None:
    """Stores and buckets written before digests hold these: they still parse, keep their
    exact bytes (so the digest a COMMIT pinned still matches), and are marked."""
    text = json.dumps(good_dict(), separators=(",", ":"), sort_keys=True).encode()
    m = Manifest.from_json(text)
    assert m.version == manifest_mod.LEGACY_VERSION
    assert m.unverifiable
    assert all(f.blake3 is None for f in m.files)
    assert m.to_json() == text


def test_a_manifest_mixing_the_formats_cannot_be_made() -> None:
    with pytest.raises(ManifestError, match="needs every file's digest"):
        Manifest(ITEM, ItemKind.FILE, (FileEntry("", 1, 1),))
    with pytest.raises(ManifestError, match="has no digests"):
        Manifest(ITEM, ItemKind.FILE, (FileEntry("", 1, 1, "a" * 64),), version=1)
