"""Item manifests: what one checkpoint item holds, byte for byte, and how to check it.

An item is one (job, step, rank, worker) checkpoint: a directory tree or a single file. Its
manifest lists every file's relative path, size, crc32c and BLAKE3 digest, and is the
item's commit point wherever the item lives (local store, peer, backup). The crc32c is the
fast check against bit rot, and anyone can forge it; the BLAKE3 digest is what a restore
trusts (``local.digests``). A manifest of format 1, written before digests, has crc32cs
only: it is still read, and its item is restored as *unverifiable* (``unverifiable``).
Parsing treats the JSON as hostile input. Pure: building and verifying a manifest against
files on disk is ``mtc_replicator.local.hashing``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mtc_replicator.core.jobname import is_job_name

MAX_FILES = 1_000_000
"""Most files and directories of any manifest this code reads (a stored item's included)."""
DEFAULT_MAX_ITEM_FILES = 100_000
"""Most files and directories of one item a peer may push here (``--max-item-files``).
A rank's step holds a handful of files with Orbax's OCDBT or torch DCP (one ``.distcp`` per
rank), a few thousand without OCDBT (a directory and chunk files per array): 100,000 is
tens of times that, and 650,000 empty files (15 MiB of manifest) cost a receiver 13-25 s
and as many inodes, which no byte budget counts."""
MAX_PATH_BYTES = 4095
"""Longest relative path, in bytes as the filesystem takes it: Linux's PATH_MAX less its NUL."""
MAX_NAME_BYTES = 255
"""Longest name of one path component: Linux's NAME_MAX."""
MAX_DEPTH = 64
"""Most components of one path. Real checkpoints nest a handful deep; the receiver opens
every level of every file's path, so depth multiplies its work."""
MAX_FILE_BYTES = 1 << 44  # 16 TiB: larger than any single checkpoint shard we expect
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
FORMAT_VERSION = 2
"""Format 2 adds each file's BLAKE3 digest; format 1 (crc32c only) is still read."""
LEGACY_VERSION = 1
MAX_ATTESTED_NAME = 253
"""Longest owner or producer name an attestation may carry (a DNS subdomain's bound)."""
MAX_ATTESTATION_CERTS = 16 * 1024
"""Bytes of PEM chain an attestation may carry: one or two certificates of about 1 KiB."""
MAX_ATTESTATION_SIGNATURE = 1024
_CRC_RE = re.compile(r"[0-9a-f]{8}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class ManifestError(ValueError):
    """A manifest is malformed or unsafe (hostile input is rejected, never repaired)."""


class CorruptItem(Exception):
    """An item's bytes do not match its manifest."""


class Cancelled(Exception):
    """Long file work stopped because its owner asked it to."""


class ItemKind(StrEnum):
    DIR = "dir"
    FILE = "file"


@dataclass(frozen=True, order=True)
class ItemId:
    """Which checkpoint an item is: job, step, node rank and worker."""

    job: str
    step: int
    rank: int
    worker: int

    @property
    def key(self) -> str:
        """The item's name below its step, in the store and in backups."""
        return f"{self.rank}-{self.worker}"

    def __str__(self) -> str:
        return f"{self.job}/s{self.step}/n{self.rank}-w{self.worker}"


@dataclass(frozen=True)
class FileEntry:
    """One regular file of an item. ``path`` is relative; empty for a file item."""

    path: str
    size: int
    crc32c: int
    blake3: str | None = None
    """The file's BLAKE3 digest (64 lowercase hex digits); None only in a format-1
    manifest, written before digests."""


@dataclass(frozen=True)
class Attestation:
    """Who produced an item and for whom, as the producing node signed it at ingest.

    It sits beside the manifest's content and outside its digest, so a manifest's digest
    is what it always was and COMMITs and plans pin the same bytes; what is signed names
    that digest (``core.attestation`` decides what is believed)."""

    owner: str
    """The job's owner at the handshake (``core.ownership``); "" unowned."""
    producer: str
    """The node that produced the item, as its certificate names it; "" not known (no TLS,
    or a shared certificate)."""
    created: float
    """When it was signed (unix seconds): the signer's certificate must hold then."""
    certificates: bytes = b""
    """The signer's PEM chain, its own certificate first; empty: unsigned (no TLS)."""
    signature: bytes = b""


@dataclass(frozen=True)
class Manifest:
    """The full description of one item; ``digest`` identifies its content."""

    item: ItemId
    kind: ItemKind
    files: tuple[FileEntry, ...]
    dirs: tuple[str, ...] = ()
    """Directories of a tree item, so empty ones survive a copy."""
    version: int = FORMAT_VERSION
    """``LEGACY_VERSION`` for a manifest written before digests (no file has one)."""
    attestation: Attestation | None = field(default=None, compare=False)
    """The producing node's signed word on the item (``core.attestation``); None in a
    manifest written before attestations. Not part of ``digest``."""

    def __post_init__(self) -> None:
        if self.version not in (LEGACY_VERSION, FORMAT_VERSION):
            raise ManifestError(f"unsupported manifest version {self.version!r:.40}")
        legacy = self.version == LEGACY_VERSION
        for f in self.files:
            if (f.blake3 is None) != legacy:
                raise ManifestError(
                    f"{f.path or 'the file'}: a format-{self.version} manifest "
                    + ("has no digests" if legacy else "needs every file's digest")
                )

    @property
    def unverifiable(self) -> bool:
        """Written before digests: its bytes are checked by crc32c only, which anyone who
        can write them can forge (docs/architecture.md, "Content digests")."""
        return self.version == LEGACY_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def _content(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "job": self.item.job,
            "step": self.item.step,
            "rank": self.item.rank,
            "worker": self.item.worker,
            "kind": self.kind.value,
            "dirs": list(self.dirs),
            "files": [_file_json(f) for f in self.files],
        }

    def to_json(self) -> bytes:
        """Canonical JSON: the same manifest always serialises to the same bytes: its
        content, then its attestation, if any, under ``attestation``."""
        data = self._content()
        if self.attestation is not None:
            data["attestation"] = _attestation_json(self.attestation)
        return _canonical(data)

    @property
    def digest(self) -> str:
        """The SHA-256 of the canonical content, every file's BLAKE3 digest in it; the
        attestation is left out, so it is what versions before attestations computed.
        Kept once computed (the fields are frozen; 0.3 CPU s at 100,000 files), without
        ``functools.cached_property``, whose lock (Python 3.11) is one for every instance."""
        known: str | None = self.__dict__.get("_digest")
        if known is None:
            known = hashlib.sha256(_canonical(self._content())).hexdigest()
            object.__setattr__(self, "_digest", known)
        return known

    @property
    def entries(self) -> int:
        """Files and directories: the inodes a copy of the item takes."""
        return len(self.files) + len(self.dirs)

    @classmethod
    def from_json(cls, raw: bytes, max_entries: int = MAX_FILES) -> Manifest:
        """Parse and validate a manifest from an untrusted source; one of more than
        ``max_entries`` files and directories is refused before any entry is checked."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(raw)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ManifestError(f"manifest is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a JSON object")
        return _manifest_from_dict(data, max_entries)


CANONICAL_SLICE = 2048
"""List entries encoded per ``json.dumps`` call in ``_canonical``: one call holds the GIL
throughout, and a manifest of 100,000 files in one call held it 0.3 s, stalling the daemon's
event loop from whichever thread encoded it."""


def _canonical(data: dict[str, Any]) -> bytes:
    """``json.dumps(data, separators=(",", ":"), sort_keys=True)``, byte for byte, with a
    long list (``files``) encoded ``CANONICAL_SLICE`` entries at a time."""

    def dumps(value: object) -> str:
        return json.dumps(value, separators=(",", ":"), sort_keys=True)

    def encode(value: object) -> str:
        if not isinstance(value, list) or len(value) <= CANONICAL_SLICE:
            return dumps(value)
        slices = range(0, len(value), CANONICAL_SLICE)
        return "[" + ",".join(dumps(value[i : i + CANONICAL_SLICE])[1:-1] for i in slices) + "]"

    return ("{" + ",".join(f"{dumps(k)}:{encode(data[k])}" for k in sorted(data)) + "}").encode()


def _attestation_json(a: Attestation) -> dict[str, Any]:
    data: dict[str, Any] = {"owner": a.owner, "producer": a.producer, "created": a.created}
    if a.signature:
        data["certificates"] = a.certificates.decode("ascii")
        data["signature"] = base64.b64encode(a.signature).decode("ascii")
    return data


def _attestation_from(raw: object) -> Attestation:
    """Parse an attestation from hostile JSON; whether it is believed is not decided here."""
    if (
        not isinstance(raw, dict)
        or not {"owner", "producer", "created"} <= set(raw)
        or not set(raw) <= {"owner", "producer", "created", "certificates", "signature"}
    ):
        raise ManifestError("the manifest's attestation is malformed")
    owner, producer, created = raw["owner"], raw["producer"], raw["created"]
    for name in (owner, producer):
        if not isinstance(name, str) or len(name) > MAX_ATTESTED_NAME or not name.isascii():
            raise ManifestError(f"the manifest's attestation names {name!r:.80}")
    if (
        not isinstance(created, int | float)
        or isinstance(created, bool)
        or not math.isfinite(created)
    ):
        raise ManifestError(f"the manifest's attestation has a bad time {created!r:.40}")
    certs, value = raw.get("certificates", ""), raw.get("signature", "")
    if (
        not isinstance(certs, str)
        or not isinstance(value, str)
        or bool(certs) != bool(value)
        or len(certs) > MAX_ATTESTATION_CERTS
        or len(value) > 2 * MAX_ATTESTATION_SIGNATURE
        or not certs.isascii()
    ):
        raise ManifestError("the manifest's attestation signature is malformed")
    try:
        signature = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError("the manifest's attestation signature is malformed") from None
    return Attestation(owner, producer, float(created), certs.encode("ascii"), signature)


def _file_json(f: FileEntry) -> list[Any]:
    entry: list[Any] = [f.path, f.size, f"{f.crc32c:08x}"]
    return entry if f.blake3 is None else [*entry, f.blake3]


def _field(data: dict[str, Any], key: str, typ: type) -> Any:
    value = data.get(key)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ManifestError(f"manifest field {key!r} must be {typ.__name__}, got {value!r:.80}")
    return value


def _manifest_from_dict(data: dict[str, Any], max_entries: int) -> Manifest:
    version = data.get("version")
    if version not in (LEGACY_VERSION, FORMAT_VERSION) or isinstance(version, bool):
        raise ManifestError(f"unsupported manifest version {version!r:.40}")
    width = 3 if version == LEGACY_VERSION else 4
    job = _field(data, "job", str)
    if not is_job_name(job):
        raise ManifestError(f"unsafe job name {job!r:.80}")
    nums = {k: _field(data, k, int) for k in ("step", "rank", "worker")}
    if any(v < 0 for v in nums.values()):
        raise ManifestError(f"negative step/rank/worker in {nums}")
    item = ItemId(job, nums["step"], nums["rank"], nums["worker"])
    try:
        kind = ItemKind(str(data.get("kind")))
    except ValueError:
        raise ManifestError(f"unknown item kind {data.get('kind')!r:.40}") from None
    raw_files = _field(data, "files", list)
    raw_dirs = _field(data, "dirs", list)
    listed, limit = len(raw_files) + len(raw_dirs), min(max_entries, MAX_FILES)
    if listed > limit:
        raise ManifestError(
            f"manifest lists {listed} files and directories, more than {limit} "
            "(the most one item may have here: --max-item-files)"
        )
    files: list[FileEntry] = []
    for entry in raw_files:
        if not (isinstance(entry, list) and len(entry) == width):
            shape = "[path, size, crc]" if width == 3 else "[path, size, crc, blake3]"
            raise ManifestError(f"file entry must be {shape}, got {entry!r:.80}")
        path, size, crc = entry[:3]
        digest = entry[3] if width == 4 else None
        if digest is not None and not (isinstance(digest, str) and _DIGEST_RE.fullmatch(digest)):
            raise ManifestError(f"bad blake3 digest {digest!r:.80} for {path!r:.80}")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES:
            raise ManifestError(f"bad size {size!r:.40} for {path!r:.80}")
        # int(x, 16) alone would also take a sign, spaces and underscores.
        if not isinstance(crc, str) or not _CRC_RE.fullmatch(crc):
            raise ManifestError(f"bad crc32c {crc!r:.40} for {path!r:.80}")
        files.append(FileEntry(_checked_path(path, kind), size, int(crc, 16), digest))
    dirs = tuple(_checked_path(d, ItemKind.DIR) for d in raw_dirs)
    attestation = None if "attestation" not in data else _attestation_from(data["attestation"])
    manifest = Manifest(item, kind, tuple(files), dirs, version, attestation)
    _check_layout(manifest)
    return manifest


def _checked_path(path: object, kind: ItemKind) -> str:
    """Reject anything that could escape the item's root or alias another entry."""
    if not isinstance(path, str):
        raise ManifestError(f"path must be a string, got {path!r:.80}")
    if kind is ItemKind.FILE:
        if path != "":
            raise ManifestError(f"a file item has one entry with an empty path, got {path!r:.80}")
        return path
    return check_path(path)


def check_path(path: str) -> str:
    """``path`` if it is a safe relative path inside a tree item that any receiver can
    create; ``ManifestError`` otherwise. ``build_manifest`` applies it too, so whatever this
    node commits, it and its peers can read back."""
    try:
        # The bytes the filesystem will see: names read from disk that are not UTF-8 come
        # back as surrogate escapes and round-trip; any other lone surrogate cannot be a name.
        encoded = path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise ManifestError(f"path is not a file name: {path!r:.80}") from None
    if not encoded or len(encoded) > MAX_PATH_BYTES:
        raise ManifestError(f"path length must be 1..{MAX_PATH_BYTES} bytes: {path!r:.80}")
    if "\x00" in path or "\\" in path or path.startswith("/"):
        raise ManifestError(f"unsafe path {path!r:.80}")
    parts = encoded.split(b"/")
    if any(p in (b"", b".", b"..") for p in parts):
        raise ManifestError(f"unsafe path {path!r:.80}")
    if len(parts) > MAX_DEPTH:
        raise ManifestError(f"path deeper than {MAX_DEPTH} levels: {path!r:.80}")
    if any(len(p) > MAX_NAME_BYTES for p in parts):
        raise ManifestError(f"a name in the path is over {MAX_NAME_BYTES} bytes: {path!r:.80}")
    return path


def _check_layout(manifest: Manifest) -> None:
    paths = [f.path for f in manifest.files]
    if manifest.kind is ItemKind.FILE:
        if len(paths) != 1 or manifest.dirs:
            raise ManifestError("a file item has exactly one file entry and no dirs")
        return
    if len(set(paths)) != len(paths) or len(set(manifest.dirs)) != len(manifest.dirs):
        raise ManifestError("duplicate path in manifest")
    dirs = set(manifest.dirs)
    file_set = set(paths)
    for p in paths:
        if p in dirs:
            raise ManifestError(f"{p!r:.80} is listed as both file and directory")
    # Exactly the layout build_manifest produces: every parent of an entry is a listed dir.
    # The immediate parent suffices (it is an entry too, so its own parent is checked), and
    # keeps the check linear in the manifest's size, however deep its paths.
    for p in (*paths, *manifest.dirs):
        parent = p.rpartition("/")[0]
        if parent and parent not in dirs:
            if parent in file_set:
                raise ManifestError(f"{parent!r:.80} is a file and a parent directory")
            raise ManifestError(f"parent directory of {p!r:.80} is not listed")


CancelCheck = Callable[[], bool]
"""Polled between chunks of long work; True stops it with ``Cancelled``."""
