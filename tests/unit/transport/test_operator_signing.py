"""Restore pins signed by an operator (``transport.operator_signing``, ``StorePins``): who
may roll a job back, and that a node certificate or a bucket writer may not."""

from __future__ import annotations

import datetime as dt
import json
import stat
import time
from pathlib import Path

import pytest

from mtc_replicator.core.signed import PIN_KIND, REGISTRY_KIND, RecordRefused, RecordTrust
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.backup_audit import read_commit_raw
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.storage.restore_pins import (
    RefusedPin,
    RestorePin,
    StorePins,
    commit_digest,
    pin_key,
    read_restore_pin,
    write_restore_pin,
)
from mtc_replicator.tools import certs, cli
from mtc_replicator.transport.operator_signing import OperatorSigner, OperatorVerifier, pin_trust
from mtc_replicator.transport.signing import CaVerifier
from mtc_replicator.transport.tls import TlsError
from tests.tls import node_tls
from tests.unit.storage.test_backup_audit import JOB, upload_step


@pytest.fixture(scope="module")
def ca() -> certs.Pair:
    return certs.new_ca()


def operator(tmp_path: Path, ca: certs.Pair, name: str = "alice") -> OperatorSigner:
    yesterday = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    certs.write_pair(
        tmp_path / name,
        certs.issue_operator(ca, name, not_before=yesterday),
        certs.OPERATOR_CERT,
        certs.OPERATOR_KEY,
    )
    return OperatorSigner(tmp_path / name / certs.OPERATOR_CERT, tmp_path / name / "operator.key")


def daemon_trust(ca: certs.Pair, *, accept_unsigned: bool = False) -> RecordTrust:
    return RecordTrust(None, OperatorVerifier(lambda: ca.cert), accept_unsigned)


def pinned(tmp_path: Path, objects: MemoryObjectStore, signer: OperatorSigner | None) -> None:
    """Steps 1 and 2 committed; a pin of step 1, signed by ``signer`` (None: unsigned)."""
    backup = BackupStore(objects)
    for step in (1, 2):
        upload_step(backup, tmp_path, step)
    found = read_commit_raw(objects, JOB, 1)
    assert found is not None
    pin = RestorePin(JOB, 1, time.time(), commit_digest(found[1]), "ops@host")
    write_restore_pin(objects, pin, RecordTrust(signer=signer))


def test_an_operator_signed_pin_is_honoured(tmp_path: Path, ca: certs.Pair) -> None:
    objects = MemoryObjectStore()
    pinned(tmp_path, objects, operator(tmp_path, ca))
    assert b'"signature"' in objects.get_bytes(pin_key(JOB))
    refused: list[tuple[str, str | None]] = []
    pins = StorePins(objects, pin_trust=daemon_trust(ca), on_refused=lambda *r: refused.append(r))
    assert pins.pinned_step(JOB) == 1
    assert refused == []


@pytest.mark.parametrize("signed_by", ["nobody", "a node", "another CA's operator"])
def test_a_pin_not_an_operators_is_refused_once_and_said(
    tmp_path: Path, ca: certs.Pair, signed_by: str
) -> None:
    objects = MemoryObjectStore()
    signer: OperatorSigner | None = None
    if signed_by == "a node":
        node = node_tls(tmp_path / "node", ca)
        signer = OperatorSigner(node.files.cert, node.files.key)
    elif signed_by == "another CA's operator":
        signer = operator(tmp_path, certs.new_ca("stranger"))
    pinned(tmp_path, objects, signer)
    refused: list[tuple[str, str | None]] = []
    pins = StorePins(objects, pin_trust=daemon_trust(ca), on_refused=lambda *r: refused.append(r))
    assert pins.pinned_step(JOB) is None
    assert pins.pinned_step(JOB) is None  # every round lists it: said once
    job, message = refused[0]
    assert len(refused) == 1
    assert message is not None
    assert job == JOB
    assert "refused the restore pin" in message
    assert "nothing is rolled back" in message
    assert read_restore_pin(objects, JOB) is not None, "left for the operator to see"
    objects.delete(pin_key(JOB))  # the operator removed it: no refusal stands
    assert pins.pinned_step(JOB) is None
    assert refused[1:] == [(JOB, None)]


def test_the_migration_flag_takes_an_unsigned_pin(tmp_path: Path, ca: certs.Pair) -> None:
    objects = MemoryObjectStore()
    pinned(tmp_path, objects, None)
    assert StorePins(objects, pin_trust=daemon_trust(ca, accept_unsigned=True)).pinned_step(JOB)


def test_an_altered_pin_is_refused(tmp_path: Path, ca: certs.Pair) -> None:
    objects = MemoryObjectStore()
    pinned(tmp_path, objects, operator(tmp_path, ca))
    body = json.loads(objects.get_bytes(pin_key(JOB)))
    body["requested_by"] = "someone else"
    objects.put_bytes(pin_key(JOB), json.dumps(body).encode())
    with pytest.raises(RefusedPin, match="altered"):
        read_restore_pin(objects, JOB, daemon_trust(ca))


def test_without_tls_pins_are_not_checked(tmp_path: Path) -> None:
    objects = MemoryObjectStore()
    pinned(tmp_path, objects, None)
    assert StorePins(objects, pin_trust=pin_trust(None)).pinned_step(JOB) == 1


def test_an_operator_certificate_is_good_for_pins_only(tmp_path: Path, ca: certs.Pair) -> None:
    signer = operator(tmp_path, ca)
    raw = RecordTrust(signer=signer).seal(REGISTRY_KIND, {"job": "j"})
    with pytest.raises(RecordRefused, match="not a node certificate"):
        RecordTrust(None, CaVerifier(lambda: ca.cert)).check(REGISTRY_KIND, raw, time.time())
    node = node_tls(tmp_path / "node", ca)
    with pytest.raises(TlsError, match="not an operator certificate"):
        OperatorSigner(node.files.cert, node.files.key).check(
            node.files.ca, dt.datetime.now(dt.UTC)
        )
    signed = RecordTrust(signer=signer).seal(PIN_KIND, {"job": "j"})
    assert daemon_trust(ca).check(PIN_KIND, signed, time.time()).value == "verified"


def test_mtc_certs_operator_writes_a_private_key(tmp_path: Path) -> None:
    assert cli.main(["certs", "init", str(tmp_path / "pki")]) == 0
    out = tmp_path / "alice"
    assert (
        cli.main(["certs", "operator", str(tmp_path / "pki"), "--name", "alice", "--out", str(out)])
        == 0
    )
    assert stat.S_IMODE((out / certs.OPERATOR_KEY).stat().st_mode) == 0o600
    signer = OperatorSigner(out / certs.OPERATOR_CERT, out / certs.OPERATOR_KEY)
    signer.check(tmp_path / "pki" / certs.CA_CERT, dt.datetime.now(dt.UTC))
    assert signer.name() == "alice"
    assert not (out / certs.NODE_CERT).exists()
