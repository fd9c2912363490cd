"""What anyone who can write bytes can do to a crc32c: make other bytes of the same size
match it. crc32c is affine over GF(2) in a message of fixed length, so four bytes chosen
by solving a 32x32 linear system make any prefix end on any crc (the attacker of the
content-digest tests; ``google_crc32c`` does the arithmetic).
"""

from __future__ import annotations

import google_crc32c


def crc_tail(prefix: bytes, target: int) -> bytes:
    """The four bytes that make ``prefix`` + them have crc32c ``target``."""
    state = google_crc32c.value(prefix)

    def crc_with(x: int) -> int:
        return int(google_crc32c.extend(state, x.to_bytes(4, "little")))

    base = crc_with(0)
    # An xor basis with distinct leading bits, kept in descending order, each with the
    # combination of tail bits that makes it.
    basis: list[tuple[int, int]] = []
    for bit in range(32):
        vector, combo = crc_with(1 << bit) ^ base, 1 << bit
        for b_vector, b_combo in basis:
            if vector ^ b_vector < vector:
                vector, combo = vector ^ b_vector, combo ^ b_combo
        if vector:
            basis.append((vector, combo))
            basis.sort(reverse=True)
    want, tail = target ^ base, 0
    for b_vector, b_combo in basis:
        if want ^ b_vector < want:
            want, tail = want ^ b_vector, tail ^ b_combo
    assert want == 0, "crc32c of the last four bytes is not invertible"
    return tail.to_bytes(4, "little")


def same_crc32c(original: bytes, chosen: bytes = b"attacker ") -> bytes:
    """Other bytes of ``original``'s size (over 4) and crc32c: ``chosen`` repeated, then
    the four bytes that fix the crc."""
    size = len(original)
    assert size > 4, "four bytes steer the crc, and one more makes the bytes differ"
    body = (chosen * (size // max(len(chosen), 1) + 1))[: size - 4]
    forged = body + crc_tail(body, google_crc32c.value(original))
    assert len(forged) == size
    assert forged != original
    assert google_crc32c.value(forged) == google_crc32c.value(original)
    return forged
