"""How one item's files are split between the data connections of one transfer. Pure.

A single TLS stream encrypts on one core and decrypts on one core: on a node with many
cores, an item of tens of GB moves at one core's speed. So a transfer may run on several
data connections at once, each carrying whole files (a file's BLAKE3 digest is fed in
order, so a file never spans two), each sent and received on a thread of its own.

Both ends compute the split from the manifest and the number of connections alone
(``stripes``), so nothing on the wire says which file goes where, and a sender cannot
make the receiver write anything the manifest does not list: every connection's bytes are
checked against its files' sizes and digests exactly as a single connection's are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mtc_replicator.core.manifest import Manifest

MAX_STREAMS = 8
"""Connections one transfer may use, whatever either side asks: past a few, one item's
stream is no longer what bounds a node (its other transfers and the memory bus are)."""


def stream_count(sizes: Sequence[int], wanted: int) -> int:
    """Connections worth opening for files of ``sizes``: ``wanted`` (clamped to
    1..``MAX_STREAMS``), but no more than the files that carry bytes."""
    carrying = sum(1 for size in sizes if size > 0)
    return max(1, min(wanted, MAX_STREAMS, carrying))


def stripes(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The file indices each of ``count`` connections carries, each list ascending.

    Largest file first, each to the connection with the fewest bytes so far (the lowest
    index on a tie); empty files carry no bytes and go with the first connection. Both
    ends must agree on it: it depends on nothing but its arguments.
    """
    if count < 1:
        raise ValueError(f"{count} connections")
    loads = [0] * count
    parts: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if sizes[index] == 0:
            parts[0].append(index)
            continue
        lightest = min(range(count), key=lambda n: (loads[n], n))
        loads[lightest] += sizes[index]
        parts[lightest].append(index)
    return [sorted(part) for part in parts]


def parts(manifest: Manifest, count: int) -> list[Manifest]:
    """``manifest`` split for ``count`` connections: each part lists its connection's
    files in manifest order; the first also lists every directory (its writer makes
    them). A part is a view for the transfer, never stored, committed or signed."""
    if count == 1:
        return [manifest]
    split = stripes([entry.size for entry in manifest.files], count)
    return [
        dataclasses.replace(
            manifest,
            files=tuple(manifest.files[i] for i in indices),
            dirs=manifest.dirs if n == 0 else (),
            attestation=None,
        )
        for n, indices in enumerate(split)
    ]
