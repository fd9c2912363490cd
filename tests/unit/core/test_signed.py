"""Signed records: the canonical bytes, signing with a node's TLS key, and who is believed.

Real certificates from throwaway CAs (``tests.tls``), real ECDSA; the files are on tmp_path
because the signer reads the node's key the way the daemon does (``TlsMaterial``).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest

from mtc_replicator.cluster.registry import (
    BlockedName,
    RefusedEntry,
    Registry,
    RegistryEntry,
    inspect,
    release,
)
from mtc_replicator.core.backup_layout import CommitRecord, commit_key
from mtc_replicator.core.signed import (
    COMMIT_KIND,
    OPEN,
    REGISTRY_KIND,
    RecordRefused,
    RecordTrust,
    Seal,
)
from mtc_replicator.node.options import parse_args
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.signing import CaVerifier, record_trust
from tests.tls import NodeTls, node_tls

DIGEST = "ab" * 32
NOW = time.time()


@pytest.fixture(scope="module")
def ca() -> certs.Pair:
    # Valid since a month ago, so records can be dated before today.
    return certs.new_ca(not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=30))


@pytest.fixture
def node(tmp_path: Path, ca: certs.Pair) -> NodeTls:
    return node_tls(tmp_path / "node", ca)


def trust_of(node: NodeTls, *, accept_unsigned: bool = False) -> RecordTrust:
    return record_trust(node.material(), accept_unsigned=accept_unsigned)


def reader(ca: certs.Pair, name: str = certs.DEFAULT_SERVER_NAME) -> RecordTrust:
    """A reader with only the CA, as ``mtc backups --tls-ca`` has."""
    return RecordTrust(verifier=CaVerifier(lambda: ca.cert, name))


def commit(step: int = 10, at: float = NOW) -> CommitRecord:
    return CommitRecord("job", step, {"0-0": DIGEST, "1-0": DIGEST}, at)


def sealed(trust: RecordTrust, record: CommitRecord) -> bytes:
    return trust.seal(COMMIT_KIND, record.body())


def edit(raw: bytes, **changes: object) -> bytes:
    data = json.loads(raw)
    data.update(changes)
    return json.dumps(data).encode()


def test_a_signed_commit_verifies_and_reads_back_the_same(node: NodeTls, ca: certs.Pair) -> None:
    raw = sealed(trust_of(node), commit())
    assert reader(ca).check(COMMIT_KIND, raw, NOW) is Seal.VERIFIED
    assert CommitRecord.from_json(raw) == commit()


def test_layout_and_key_order_do_not_matter_only_the_fields(node: NodeTls, ca: certs.Pair) -> None:
    raw = sealed(trust_of(node), commit())
    data = json.loads(raw)
    respaced = json.dumps(dict(reversed(list(data.items()))), indent=3).encode()
    assert reader(ca).check(COMMIT_KIND, respaced, NOW) is Seal.VERIFIED


@pytest.mark.parametrize(
    "changes",
    [
        {"step": 11},
        {"items": {"0-0": DIGEST}},
        {"items": {"0-0": DIGEST, "1-0": "cd" * 32}},
        {"created": NOW + 1},
        {"owner": "someone"},  # a field the signer never wrote is not covered: refused
    ],
    ids=["step", "dropped item", "other digest", "time", "added field"],
)
def test_a_tampered_field_is_refused(node: NodeTls, ca: certs.Pair, changes: dict) -> None:
    raw = edit(sealed(trust_of(node), commit()), **changes)
    with pytest.raises(RecordRefused, match="altered after signing"):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_a_signature_from_another_ca_is_refused(tmp_path: Path, ca: certs.Pair) -> None:
    stranger = node_tls(tmp_path / "stranger", certs.new_ca("other CA"))
    raw = sealed(trust_of(stranger), commit())
    with pytest.raises(RecordRefused, match="not a node certificate"):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_a_certificate_of_the_ca_for_another_name_is_refused(
    tmp_path: Path, ca: certs.Pair
) -> None:
    other = node_tls(tmp_path / "other", ca, server_name="not-a-node")
    raw = sealed(trust_of(other), commit())
    with pytest.raises(RecordRefused, match="not a node certificate"):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_the_chain_is_checked_at_the_records_own_time(tmp_path: Path, ca: certs.Pair) -> None:
    # The certificate expired a day ago: a record dated inside its validity still verifies
    # (backups outlive certificates), one dated after its end does not.
    old = node_tls(tmp_path / "old", ca, expired=True)
    inside = time.time() - 2 * 86400
    raw = sealed(trust_of(old), commit(at=inside))
    assert reader(ca).check(COMMIT_KIND, raw, inside) is Seal.VERIFIED
    late = sealed(trust_of(old), commit(at=NOW))
    with pytest.raises(RecordRefused, match="at the record's time"):
        reader(ca).check(COMMIT_KIND, late, NOW)
    before = time.time() - 10 * 86400
    with pytest.raises(RecordRefused, match="at the record's time"):
        reader(ca).check(COMMIT_KIND, sealed(trust_of(old), commit(at=before)), before)


def test_a_signature_by_a_key_other_than_the_certificates_is_refused(
    tmp_path: Path, node: NodeTls, ca: certs.Pair
) -> None:
    # Someone with their own key embeds a genuine node certificate (it is public).
    mine = node_tls(tmp_path / "mine", certs.new_ca("mine"))
    signed_by_me = json.loads(sealed(trust_of(mine), commit()))
    signed_by_me["signature"]["certificates"] = node.files.cert.read_text()
    raw = json.dumps(signed_by_me).encode()
    with pytest.raises(RecordRefused, match="altered after signing"):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_a_record_of_one_kind_does_not_pass_for_another(node: NodeTls, ca: certs.Pair) -> None:
    raw = trust_of(node).seal(REGISTRY_KIND, commit().body())
    with pytest.raises(RecordRefused):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_unsigned_records_are_refused_unless_migrating(ca: certs.Pair) -> None:
    raw = commit().to_json()
    with pytest.raises(RecordRefused, match=r"not signed.*--accept-unsigned-records"):
        reader(ca).check(COMMIT_KIND, raw, NOW)
    migrating = RecordTrust(verifier=CaVerifier(lambda: ca.cert), accept_unsigned=True)
    assert migrating.check(COMMIT_KIND, raw, NOW) is Seal.UNSIGNED


def test_the_migration_flag_never_excuses_a_bad_signature(node: NodeTls, ca: certs.Pair) -> None:
    raw = edit(sealed(trust_of(node), commit()), step=99)
    migrating = RecordTrust(verifier=CaVerifier(lambda: ca.cert), accept_unsigned=True)
    with pytest.raises(RecordRefused):
        migrating.check(COMMIT_KIND, raw, NOW)


@pytest.mark.parametrize(
    "block",
    [
        "x",
        {"certificates": "x"},
        {"certificates": 1, "value": "AA=="},
        {"certificates": "-----BEGIN CERTIFICATE-----\nxx", "value": "AA=="},
        {"certificates": "", "value": "not base64!"},
        {"certificates": "x" * 20000, "value": "AA=="},
        {"certificates": "x", "value": "AA==", "alg": "none"},
    ],
)
def test_a_malformed_signature_is_refused(ca: certs.Pair, block: object) -> None:
    raw = edit(commit().to_json(), signature=block)
    with pytest.raises(RecordRefused):
        reader(ca).check(COMMIT_KIND, raw, NOW)


def test_without_tls_nothing_is_signed_or_required(node: NodeTls) -> None:
    # The plaintext demo and older readers see the bytes they always saw.
    assert OPEN.seal(COMMIT_KIND, commit().body()) == commit().to_json()
    assert record_trust(None).check(COMMIT_KIND, commit().to_json(), NOW) is Seal.UNCHECKED
    assert OPEN.check(COMMIT_KIND, sealed(trust_of(node), commit()), NOW) is Seal.UNCHECKED


def test_the_signer_follows_a_rotated_certificate(tmp_path: Path, ca: certs.Pair) -> None:
    node = node_tls(tmp_path / "n", ca)
    trust = trust_of(node)
    first = json.loads(sealed(trust, commit()))["signature"]["certificates"]
    time.sleep(0.01)  # a new mtime for the rewritten files
    node_tls(tmp_path / "n", ca)
    raw = sealed(trust, commit())
    assert json.loads(raw)["signature"]["certificates"] != first
    assert reader(ca).check(COMMIT_KIND, raw, NOW) is Seal.VERIFIED


def test_a_chain_with_an_intermediate_is_followed(tmp_path: Path, ca: certs.Pair) -> None:
    # Only direct children of the CA are made by mtc certs, but a bundle may list more:
    # the signer embeds its whole tls.crt, and the verifier uses what follows the leaf.
    node = node_tls(tmp_path / "n", ca)
    chain = node.files.cert.read_bytes() + ca.cert
    node.files.cert.write_bytes(chain)
    raw = sealed(trust_of(node), commit())
    assert reader(ca).check(COMMIT_KIND, raw, NOW) is Seal.VERIFIED


# --- where records are read ----------------------------------------------------------------


def test_backup_store_never_lists_a_refused_commit(node: NodeTls, ca: certs.Pair) -> None:
    objects = MemoryObjectStore()
    writer = BackupStore(objects, trust_of(node))
    assert writer.try_commit("job", 10, [], now=NOW) is not None
    # A bucket writer plants an unsigned COMMIT for a newer step, and a tampered one.
    objects.put_bytes(commit_key("job", 20), commit(20).to_json())
    signed_30 = sealed(trust_of(node), commit(30))
    objects.put_bytes(commit_key("job", 30), edit(signed_30, items={"0-0": "ef" * 32}))
    store = BackupStore(objects, trust_of(node))
    assert sorted(store.committed_steps("job")) == [10]
    assert sorted(store.refused["job"]) == [20, 30]
    assert "not signed" in store.refused["job"][20]
    with pytest.raises(RecordRefused):
        store.read_commit("job", 20)
    # The COMMIT of step 10 is untouched by the attack.
    assert store.read_commit_sealed("job", 10) is not None
    migrating = BackupStore(objects, trust_of(node, accept_unsigned=True))
    assert sorted(migrating.committed_steps("job")) == [10, 20]


def test_registry_refuses_an_unsigned_or_forged_entry(node: NodeTls, tmp_path: Path) -> None:
    objects = MemoryObjectStore()
    registry = Registry(objects, trust_of(node))
    real = RegistryEntry("job", "10.0.0.1:7070", "a" * 32, NOW)
    registry.register(real)
    assert registry.lookup("job") == real
    forged = RegistryEntry("job", "10.6.6.6:7070", "b" * 32, NOW)
    objects.put_bytes("_registry/job.json", forged.to_json())
    with pytest.raises(RefusedEntry, match="not signed"):
        registry.lookup("job")
    stranger = node_tls(tmp_path / "stranger", certs.new_ca("other"))
    objects.put_bytes("_registry/job.json", forged.to_json(trust_of(stranger)))
    with pytest.raises(RefusedEntry, match="not a node certificate"):
        registry.lookup("job")
    # A forgery names no owner anyone can check: nobody claims over it, until released.
    squatter = RegistryEntry("job", "10.6.6.6:7070", "b" * 32, NOW, "team-b")
    objects.put_bytes("_registry/job.json", squatter.to_json(trust_of(stranger)))
    claimed = RegistryEntry("job", "10.0.0.1:7070", "c" * 32, NOW, "team-a")
    with pytest.raises(BlockedName, match="no rank 0 registers over it"):
        registry.claim(claimed)
    state = inspect(registry, "job")
    assert state.blocked
    assert state.problem is not None
    assert "not a node certificate" in state.problem
    assert release(registry, state)
    registry.claim(claimed)
    assert registry.lookup("job") == claimed
    # A migrating reader takes an unsigned entry.
    objects.put_bytes("_registry/job.json", forged.to_json())
    assert Registry(objects, trust_of(node, accept_unsigned=True)).lookup("job") == forged


def test_a_registry_entry_signs_every_field(node: NodeTls) -> None:
    # A field added later (an owner) is covered without touching the signing code.
    objects = MemoryObjectStore()
    registry = Registry(objects, trust_of(node))
    registry.register(RegistryEntry("job", "10.0.0.1:7070", "a" * 32, NOW))
    raw = objects.get_bytes("_registry/job.json")
    objects.put_bytes("_registry/job.json", edit(raw, owner="intruder"))
    with pytest.raises(RefusedEntry, match="altered"):
        registry.lookup("job")


def test_the_time_is_a_date(node: NodeTls, ca: certs.Pair) -> None:
    raw = sealed(trust_of(node), commit())
    with pytest.raises(RecordRefused, match="not a date"):
        reader(ca).check(COMMIT_KIND, raw, 1e300)


@pytest.mark.parametrize(("env", "on"), [({}, False), ({"MTC_ACCEPT_UNSIGNED_RECORDS": "1"}, True)])
def test_the_migration_flag_from_the_environment(env: dict[str, str], on: bool) -> None:
    assert parse_args(["--checkpoint-dir", "/x"], env).accept_unsigned_records is on
    assert parse_args(
        ["--checkpoint-dir", "/x", "--accept-unsigned-records"], {}
    ).accept_unsigned_records
