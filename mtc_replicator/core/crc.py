"""crc32c arithmetic: combining the crcs of adjacent pieces, and splitting a file into
pieces to hash in parallel. Pure.

``crc32c_combine`` gives crc32c(A + B) from crc32c(A), crc32c(B) and len(B) without
reading either, so pieces hashed on different cores (``local.hashing``) or checked chunk
by chunk as they arrive (``transport.transfer``) make one whole-file crc.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

_CRC32C_POLY = 0x82F63B78  # Castagnoli, bit-reflected


def _mult_mod_p(a: int, b: int) -> int:
    """``a * b`` modulo the crc32c polynomial, in the reflected bit order crcs use."""
    m = 1 << 31
    product = 0
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


_X_2N = [1 << 30]  # x^(2^k) mod p for k = 0..63 (lengths below 2^61 bytes), x^1 first
for _ in range(63):
    _X_2N.append(_mult_mod_p(_X_2N[-1], _X_2N[-1]))


@functools.lru_cache(maxsize=64)
def _x_8n(n: int) -> int:
    """x^(8n) mod p: the operator that shifts a crc past ``n`` zero bytes."""
    p = 1 << 31  # x^0
    k = 3
    while n:
        if n & 1:
            p = _mult_mod_p(_X_2N[k], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of ``A + B`` from crc32c(A), crc32c(B) and len(B), without reading either."""
    return _mult_mod_p(_x_8n(len_b), crc_a) ^ crc_b


def crc32c_concat(pieces: Iterable[tuple[int, int]]) -> int:
    """crc32c of consecutive pieces, each given as ``(crc32c, length)``, in order."""
    crc = 0
    for piece_crc, length in pieces:
        crc = crc32c_combine(crc, piece_crc, length)
    return crc


def split_ranges(size: int, piece: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of at most ``piece`` bytes covering ``[0, size)`` exactly,
    in order; one empty piece for an empty file (its crc is still checked)."""
    if piece <= 0:
        raise ValueError(f"piece must be positive, got {piece}")
    if size <= 0:
        return [(0, 0)]
    return [(off, min(piece, size - off)) for off in range(0, size, piece)]
