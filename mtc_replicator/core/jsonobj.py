"""JSON that someone else wrote (a bucket writer, a pod, the CSI plugin): one object, bounded.

Every record we read from outside (registry entries, restore pins, signed records,
``owner.json``) is one JSON object; Python's ``json`` would also take a top-level list,
``NaN`` and ``Infinity``, and recurse until it fails. ``load_object`` refuses all of those
with a short reason its caller wraps in its own error.
"""

from __future__ import annotations

import json
from typing import Any


class NotAnObject(ValueError):
    """The bytes are not one bounded JSON object; the message says why, to be wrapped."""


def _no_constant(name: str) -> Any:
    raise NotAnObject(f"{name} is not a number any record of ours holds")


def load_object(raw: bytes, max_bytes: int | None = None) -> dict[str, Any]:
    """The JSON object in ``raw``; ``NotAnObject`` when it is larger than ``max_bytes``, not
    JSON (``NaN`` and ``Infinity`` included), too deeply nested, or not an object."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise NotAnObject(f"{len(raw)} bytes, more than {max_bytes} bytes")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # NotAnObject from a constant among them
        raise NotAnObject(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise NotAnObject("not a JSON object")
    return data
