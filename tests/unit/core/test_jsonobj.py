"""``core.jsonobj``: what every record read from outside must be before its fields are read."""

from __future__ import annotations

import pytest

from mtc_replicator.core.jsonobj import NotAnObject, load_object


def test_an_object_within_the_bound_is_returned() -> None:
    assert load_object(b'{"a": 1}', 8) == {"a": 1}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        pytest.param(b'{"a": 12345}', "12 bytes, more than 8 bytes", id="too large"),
        pytest.param(b"{", "not JSON", id="not JSON"),
        pytest.param(b'{"t": NaN}', "NaN is not a number", id="NaN"),
        pytest.param(b'{"t": -Infinity}', "-Infinity is not a number", id="Infinity"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "not JSON", id="nested too deep"),
        pytest.param(b"[1, 2]", "not a JSON object", id="a list"),
    ],
)
def test_anything_else_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(NotAnObject, match=reason):
        load_object(raw, 8 if reason.endswith("8 bytes") else None)
