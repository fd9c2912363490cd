"""``obs.metrics_endpoint``: the address it is served on (the HTTP behaviour, with real
sockets, is ``tests/integration/test_metrics.py`` and ``test_http_bounds.py``)."""

from __future__ import annotations

import pytest

from mtc_replicator.obs.metrics_endpoint import split_address


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:80", ("::1", 80)),
        ("node-a:9464", ("node-a", 9464)),
    ],
)
def test_split_address(address: str, expected: tuple[str, int]) -> None:
    assert split_address(address) == expected


@pytest.mark.parametrize(
    "address", ["9464", ":9464", "host:", "host:port", "host:65536", "host:²", "host:\u0661\u0662"]
)
def test_split_address_refuses(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address(address)
