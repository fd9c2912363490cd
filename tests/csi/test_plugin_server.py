"""``csi.plugin_server``: the endpoint the plugin serves on and a socket a killed plugin left."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mtc_replicator.csi.plugin_server import EndpointError, parse_endpoint, remove_stale_socket
from tests.csi.conftest import stale_socket


@pytest.mark.parametrize(
    ("endpoint", "path"),
    [
        ("unix:///csi/csi.sock", "/csi/csi.sock"),
        ("unix:/csi/csi.sock", "/csi/csi.sock"),
        ("/csi/csi.sock", "/csi/csi.sock"),
    ],
)
def test_parse_endpoint(endpoint: str, path: str) -> None:
    assert parse_endpoint(endpoint) == Path(path)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:10000", "unix://csi.sock", "csi.sock"])
def test_parse_endpoint_refuses(endpoint: str) -> None:
    with pytest.raises(EndpointError):
        parse_endpoint(endpoint)


def test_a_stale_socket_is_removed_a_live_one_or_a_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "csi.sock"
    assert remove_stale_socket(path) is False
    stale_socket(path)
    assert remove_stale_socket(path) is True
    assert not path.exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(EndpointError, match="another process"):
            remove_stale_socket(path)
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(EndpointError, match="not a socket"):
        remove_stale_socket(path)
    assert path.read_text() == "not a socket"
