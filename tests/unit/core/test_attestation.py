"""``core.attestation``: what is signed, and which attested manifests a node takes.

The verifier here is an in-memory stand-in that names the node a "certificate" says;
the real one (``transport.attesting``) is exercised against real daemons in
``tests/integration/test_attested_manifests.py`` and below with a real CA."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mtc_replicator.core.attestation import (
    Attested,
    ManifestTrust,
    Unattested,
    attest,
    statement,
)
from mtc_replicator.core.manifest import (
    Attestation,
    FileEntry,
    ItemId,
    ItemKind,
    Manifest,
    ManifestError,
)
from mtc_replicator.core.signed import RecordRefused, Signature
from mtc_replicator.tools import certs
from mtc_replicator.transport.attesting import manifest_trust
from tests.tls import node_tls

ITEM = ItemId("job", 20, 1, 0)
MANIFEST = Manifest(ITEM, ItemKind.FILE, (FileEntry("", 5, 0x1234, "ab" * 32),))


class NamedSigner:
    """Signs as ``node``: the signature is the node's name and the payload."""

    def __init__(self, node: str) -> None:
        self.node = node

    def sign(self, payload: bytes) -> Signature:
        return Signature(self.node.encode(), payload)


class NamingVerifier:
    def verify_node(self, payload: bytes, signature: Signature, at: float) -> str:
        if signature.value != payload:
            raise RecordRefused("altered after signing")
        return signature.certificates.decode()


def trust(node: str, **kw: object) -> ManifestTrust:
    return ManifestTrust(NamedSigner(node), NamingVerifier(), node, **kw)  # type: ignore[arg-type]


def test_the_attestation_leaves_the_digest_as_it_was_and_round_trips() -> None:
    signed = trust("node-1").attest(MANIFEST, "team-a", 1700000000.5)
    assert signed.digest == MANIFEST.digest  # COMMITs and plans pin the same bytes
    assert signed.to_json() != MANIFEST.to_json()
    back = Manifest.from_json(signed.to_json())
    assert back.attestation == signed.attestation
    assert back.to_json() == signed.to_json()


def test_the_statement_names_item_digest_owner_producer_and_time() -> None:
    base = statement(MANIFEST, "team-a", "node-1", 1.0)
    assert base.startswith(b"mtc-signed-record/1\nitem-manifest\n")
    for other in (
        statement(replace(MANIFEST, item=ItemId("job", 21, 1, 0)), "team-a", "node-1", 1.0),
        statement(MANIFEST, "team-b", "node-1", 1.0),
        statement(MANIFEST, "team-a", "node-2", 1.0),
        statement(MANIFEST, "team-a", "node-1", 2.0),
        statement(
            replace(MANIFEST, files=(FileEntry("", 5, 0x1234, "cd" * 32),)),
            "team-a",
            "node-1",
            1.0,
        ),
    ):
        assert other != base


def test_a_node_takes_its_owners_items_signed_by_their_producer() -> None:
    signed = trust("node-1").attest(MANIFEST, "team-a", 1.0)
    assert trust("node-2").check(signed, "team-a") is Attested.VERIFIED
    assert trust("node-2").check(signed, "team-a", producers=("node-0", "node-1"))


@pytest.mark.parametrize(
    ("manifest", "owner", "producers", "why"),
    [
        (MANIFEST, "team-a", None, "not signed by its producer"),
        (attest(MANIFEST, "team-a", "node-1", 1.0, None), "team-a", None, "not signed"),
        (
            attest(MANIFEST, "team-b", "node-1", 1.0, NamedSigner("node-1")),
            "team-a",
            None,
            "belongs to owner 'team-b'",
        ),
        (
            attest(MANIFEST, "team-a", "node-0", 1.0, NamedSigner("mallory")),
            "team-a",
            None,
            "says node 'node-0' produced it, but node 'mallory' signed it",
        ),
        (
            attest(MANIFEST, "team-a", "mallory", 1.0, NamedSigner("mallory")),
            "team-a",
            ("node-1", "node-4"),
            "which never held rank 1",
        ),
    ],
)
def test_what_a_node_refuses(
    manifest: Manifest, owner: str, producers: tuple[str, ...] | None, why: str
) -> None:
    with pytest.raises(Unattested, match=why):
        trust("node-2").check(manifest, owner, producers)


def test_a_signature_over_other_bytes_is_refused() -> None:
    signed = trust("node-1").attest(MANIFEST, "team-a", 1.0)
    assert signed.attestation is not None
    moved = replace(signed, attestation=replace(signed.attestation, created=2.0))
    with pytest.raises(Unattested, match="altered after signing"):
        trust("node-2").check(moved, "team-a")


def test_unsigned_items_pass_only_with_the_migration_flag_and_still_for_their_owner() -> None:
    assert trust("n", accept_unsigned=True).check(MANIFEST, "team-a") is Attested.UNSIGNED
    unsigned_b = attest(MANIFEST, "team-b", "", 1.0, None)
    with pytest.raises(Unattested, match="belongs to owner"):
        trust("n", accept_unsigned=True).check(unsigned_b, "team-a")


def test_without_tls_the_owner_is_still_checked() -> None:
    open_trust = ManifestTrust()
    assert open_trust.check(MANIFEST, "team-a") is Attested.UNCHECKED
    made = open_trust.attest(MANIFEST, "team-b", 1.0)
    assert made.attestation == Attestation("team-b", "", 1.0)
    with pytest.raises(Unattested, match="belongs to owner"):
        open_trust.check(made, "team-a")
    assert open_trust.check(made, "") is Attested.UNCHECKED  # an unowned node takes any


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"owner": "a", "producer": "b"},
        {"owner": "a", "producer": "b", "created": "now"},
        {"owner": "a", "producer": "b", "created": float("inf")},
        {"owner": 1, "producer": "b", "created": 1.0},
        {"owner": "a" * 300, "producer": "b", "created": 1.0},
        {"owner": "a", "producer": "b", "created": 1.0, "extra": 1},
        {"owner": "a", "producer": "b", "created": 1.0, "certificates": "x"},
        {"owner": "a", "producer": "b", "created": 1.0, "certificates": "x", "signature": "!!"},
    ],
)
def test_a_malformed_attestation_is_a_manifest_error(bad: object) -> None:

    data = json.loads(MANIFEST.to_json())
    data["attestation"] = bad
    with pytest.raises(ManifestError, match="attestation"):
        Manifest.from_json(json.dumps(data).encode())


def test_real_node_certificates_attest_and_check(tmp_path: Path) -> None:
    ca, other_ca = certs.new_ca(), certs.new_ca()
    one = node_tls(tmp_path / "one", ca, node="node-1").material()
    two = node_tls(tmp_path / "two", ca, node="node-2").material()
    stranger = node_tls(tmp_path / "x", other_ca, node="node-1").material()
    signed = manifest_trust(one, "node-1").attest(MANIFEST, "team-a", time.time())
    assert manifest_trust(two, "node-2").check(signed, "team-a") is Attested.VERIFIED
    forged = manifest_trust(stranger, "node-1").attest(MANIFEST, "team-a", time.time())
    with pytest.raises(Unattested, match="not a node certificate"):
        manifest_trust(two, "node-2").check(forged, "team-a")


def test_a_commit_names_its_owner_in_its_body_and_refuses_a_bad_one() -> None:
    from mtc_replicator.core.backup_layout import CommitRecord

    record = CommitRecord("job", 3, {"0-0": "ab" * 32}, 1.0, owner="team-a")
    back = CommitRecord.from_json(json.dumps(record.body()).encode())
    assert back.owner == "team-a"
    assert "owner" not in CommitRecord("job", 3, {}, 1.0).body()  # as versions before wrote
    with pytest.raises(ManifestError, match="bad owner"):
        CommitRecord.from_json(json.dumps({**record.body(), "owner": 7}).encode())
