"""The canonical JSON a manifest's digest is taken over: byte for byte what one
``json.dumps(sort_keys=True, separators=(",", ":"))`` call writes, whatever the slicing, and
encoded without holding the GIL for the whole of a long list."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtc_replicator.core import manifest as manifest_mod
from mtc_replicator.core.manifest import FileEntry, ItemId, ItemKind, Manifest

ODD_NAMES = ["plain", 'q"uote', "ünïcode", "emoji 🙂", "sp ace", "x:[]"]


def _one_call(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


@settings(deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["files", "dirs", "job", "attestation", "kind", "z", "a"]),
        st.lists(
            st.lists(st.one_of(st.text(max_size=6), st.integers(), st.none()), max_size=4)
            | st.text(max_size=6),
            max_size=12,
        )
        | st.text(max_size=8)
        | st.integers(),
    )
)
def test_sliced_encoding_is_the_one_call_encoding(data: dict[str, Any]) -> None:
    """With slices of 3 entries, every list longer than a slice is encoded in pieces."""
    slice_was = manifest_mod.CANONICAL_SLICE
    manifest_mod.CANONICAL_SLICE = 3
    try:
        assert manifest_mod._canonical(data) == _one_call(data)
    finally:
        manifest_mod.CANONICAL_SLICE = slice_was


def _many(n: int) -> Manifest:
    files = tuple(
        FileEntry(f"d/{ODD_NAMES[i % len(ODD_NAMES)]}-{i:06d}", i, i * 7919 % 2**32, "ab" * 32)
        for i in range(n)
    )
    return Manifest(ItemId("job", 5, 1, 0), ItemKind.DIR, files, ("d",))


def test_a_manifest_of_many_files_keeps_its_bytes_and_digest() -> None:
    """Digests of manifests written before the slicing must not change: the same bytes."""
    m = _many(3 * manifest_mod.CANONICAL_SLICE + 5)
    content = m._content()
    assert manifest_mod._canonical(content) == _one_call(content)
    assert m.to_json() == _one_call(json.loads(m.to_json()))
    assert Manifest.from_json(m.to_json()).digest == m.digest


def _longest_gap(work: Any) -> float:
    """The longest another thread of this process waited between two of its ticks while
    ``work`` ran: how long ``work`` kept the GIL."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    work()
    done.set()
    ticker.join()
    return max(gaps)


def test_a_long_manifest_does_not_hold_the_gil_throughout() -> None:
    """Encoding 100,000 entries in one ``json.dumps`` call keeps every other thread (the
    daemon's event loop among them) waiting for all of it; sliced, for a slice at a time.
    Compared in the same run; tried again where the box's other work preempted one."""
    content = _many(100_000)._content()
    for _ in range(3):
        whole = _longest_gap(lambda: _one_call(content))
        sliced = _longest_gap(lambda: manifest_mod._canonical(content))
        if sliced < whole / 3:
            break
    assert sliced < whole / 3, (sliced, whole)


@pytest.mark.parametrize("field", ["files", "dirs"])
def test_the_digest_is_computed_once_per_manifest(field: str) -> None:
    m = _many(10)
    assert m.digest is m.digest  # cached, the same string
    other = Manifest(m.item, m.kind, m.files[:-1] if field == "files" else m.files, ())
    assert other.digest != m.digest
