"""RAM disk sizes: Kubernetes quantity spellings to bytes."""

from __future__ import annotations

import pytest

from mtc_replicator.csi.quantity import SizeError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64Gi", 64 * 2**30),
        ("512Mi", 512 * 2**20),
        ("4Ki", 4096),
        ("1Ti", 2**40),
        ("1073741824", 2**30),
        ("1G", 10**9),
        ("2M", 2 * 10**6),
        ("3k", 3000),
        ("1.5Gi", 3 * 2**29),
        ("0.5Ki", 512),
        ("1.0001", 2),  # a fraction of a byte rounds up, as Kubernetes does
        (" 8Mi\n", 8 * 2**20),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "expected a number"),
        ("Gi", "expected a number"),
        ("-1Gi", "expected a number"),
        ("1 Gi", "expected a number"),
        ("1e9", "expected a number"),
        ("256m", "unknown suffix 'm'"),  # milli to Kubernetes, MiB to mount(8): refused
        ("1K", "unknown suffix 'K'"),
        ("1GB", "unknown suffix 'GB'"),
        ("0", "more than 0"),
        ("0Gi", "more than 0"),
    ],
)
def test_parse_size_refuses(text: str, reason: str) -> None:
    with pytest.raises(SizeError, match=reason):
        parse_size(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [(64 * 2**30, "64Gi"), (512 * 2**20, "512Mi"), (3072, "3Ki"), (1000, "1000"), (2**20, "1Mi")],
)
def test_format_size(size: int, text: str) -> None:
    assert format_size(size) == text
    assert parse_size(text) == size
