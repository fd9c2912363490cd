"""The rank files' format and checks (``core.rank_file``), the controller's identity
(``core.identity.is_controller``) and ``mtc certs controller``: pure rules, real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography import x509

from mtc_replicator.core.identity import CONTROLLER_URI, is_controller, node_uri
from mtc_replicator.core.rank_file import (
    BadRankRecord,
    RankRecord,
    is_host_port,
    jax_init_info,
    parse_rank_file,
    rank_file_bytes,
)
from mtc_replicator.tools import certs
from mtc_replicator.tools.cli import main as mtc

GOOD = {
    "job": "train",
    "rank": 3,
    "nodes": 4,
    "coordinator": "10.0.0.5:8476",
    "pod_uid": "0a0a-1",
    "assignment": "a-1",
    "source": "holdings",
}


@pytest.mark.parametrize(
    ("uris", "controller"),
    [
        ([CONTROLLER_URI], True),
        ([CONTROLLER_URI, "urn:x"], True),
        ([CONTROLLER_URI, node_uri("n1")], False),  # both: it could act as either
        ([node_uri("n1")], False),
        ([], False),
        (["spiffe://mtc-replicator/controller/x"], False),
    ],
)
def test_is_controller(uris: list[str], controller: bool) -> None:
    assert is_controller(uris) is controller


def test_the_two_files_round_trip() -> None:
    record = RankRecord(**GOOD)  # type: ignore[arg-type]
    assert jax_init_info(record) == b"3\n10.0.0.5:8476\n"
    assert json.loads(rank_file_bytes(record)) == GOOD
    assert parse_rank_file(rank_file_bytes(record)) == record
    assert (record.coordinator_host, record.coordinator_port) == ("10.0.0.5", 8476)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("job", "Bad Job"),
        ("rank", -1),
        ("rank", 4),
        ("rank", True),
        ("nodes", 0),
        ("coordinator", "host"),
        ("coordinator", "host:0"),
        ("coordinator", "a b:1"),
        ("coordinator", "h:1\nx"),
        ("pod_uid", "a/b"),
        ("assignment", ""),
        ("assignment", "x" * 65),
        ("source", "other"),
    ],
)
def test_bad_fields_are_named(field: str, value: object) -> None:
    with pytest.raises(BadRankRecord):
        RankRecord(**{**GOOD, field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("10.0.0.5:8476", True),
        ("train-0.train.ns.svc:1", True),
        ("[fd00::1]:8476", True),
        ("fd00::1:8476", False),
        (":1", False),
        ("h:65536", False),
        ("h:", False),
    ],
)
def test_is_host_port(text: str, ok: bool) -> None:
    assert is_host_port(text) is ok


@pytest.mark.parametrize("raw", [b"", b"[]", b"{}", json.dumps({**GOOD, "x": 1}).encode()])
def test_anything_else_is_no_rank_file(raw: bytes) -> None:
    with pytest.raises(BadRankRecord):
        parse_rank_file(raw)


def test_mtc_certs_controller_issues_a_client_certificate_naming_the_controller(
    tmp_path: Path,
) -> None:
    assert mtc(["certs", "controller", str(tmp_path)]) == 0
    out = tmp_path / "controller"
    cert = x509.load_pem_x509_certificate((out / certs.NODE_CERT).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [CONTROLLER_URI]
    assert (out / certs.NODE_KEY).stat().st_mode & 0o777 == 0o600
    assert (out / certs.CA_CERT).read_bytes() == (tmp_path / certs.CA_CERT).read_bytes()
