"""Parse a RAM disk size such as ``64Gi``, ``512Mi`` or ``1073741824`` into bytes. Pure.

Sizes come from a DaemonSet's environment, so they use Kubernetes quantity suffixes: binary
(``Ki`` ... ``Ei``) and decimal (``k``, ``M`` ... ``E``). The lowercase ``m`` is refused
rather than guessed: to Kubernetes it means milli, to ``mount -o size=`` it means MiB.
"""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal, InvalidOperation

_MULTIPLIERS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)([A-Za-z]*)")


class SizeError(ValueError):
    """The text is not a positive size we understand."""


def parse_size(text: str) -> int:
    """Bytes in ``text``; a fraction (``1.5Gi``) rounds up to a whole byte, like Kubernetes."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise SizeError(f"invalid size {text!r}: expected a number with an optional suffix")
    number, suffix = match.groups()
    if suffix not in _MULTIPLIERS:
        known = ", ".join(s for s in _MULTIPLIERS if s)
        raise SizeError(f"invalid size {text!r}: unknown suffix {suffix!r} (use one of {known})")
    try:
        value = Decimal(number) * _MULTIPLIERS[suffix]
    except InvalidOperation:  # pragma: no cover - the pattern admits only valid decimals
        raise SizeError(f"invalid size {text!r}") from None
    size = int(value.to_integral_value(rounding=ROUND_CEILING))
    if size <= 0:
        raise SizeError(f"invalid size {text!r}: must be more than 0 bytes")
    return size


def format_size(size: int) -> str:
    """The shortest exact binary spelling of ``size`` (``64Gi``), for log lines."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _MULTIPLIERS[suffix]
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
