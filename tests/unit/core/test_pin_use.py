"""A restore pin is honoured once, and not after its expiry (issue 39, finding 4).

The rule (``core.pin_use.pin_refusal``) and the used record's format, pure; then
``StorePins`` against a real ``file://`` bucket with a node's real signing key: a pin
honoured once, its copy put back after every store was lost, is refused and said.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.pin_use import MalformedUsedRecord, UsedPin, pin_refusal, utc
from mtc_replicator.core.signed import RecordTrust
from mtc_replicator.local.usedpins import UsedPins
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.storage.restore_pins import (
    MalformedPin,
    RestorePin,
    StorePins,
    commit_digest,
    pin_digest,
    pin_key,
    read_used_record,
    used_key,
    write_restore_pin,
)
from mtc_replicator.tools import certs
from mtc_replicator.transport.signing import record_trust
from tests.tls import node_tls
from tests.unit.storage.test_backup_audit import JOB, upload_step

D1, D2 = "a" * 64, "b" * 64
NOW = 1_800_000_000.0


# --- the rule (pure) -------------------------------------------------------------------------


def test_a_pin_with_no_used_record_and_no_expiry_may_be_honoured() -> None:
    assert pin_refusal(JOB, D1, None, NOW, None) is None


def test_a_pin_whose_used_record_is_there_is_refused_whatever_else() -> None:
    used = UsedPin(JOB, 10, D1, NOW - 3600)
    why = pin_refusal(JOB, D1, None, NOW, used)
    assert why is not None
    assert "used already" in why
    assert "step 10" in why
    assert utc(NOW - 3600) in why
    assert pin_refusal(JOB, D1, NOW + 3600, NOW, used) is not None, "not saved by an expiry"


@pytest.mark.parametrize("other", ["another pin", "another job"])
def test_a_used_record_of_another_pin_says_nothing_of_this_one(other: str) -> None:
    """A record copied to this pin's key from another's (signed, but not of this pin)."""
    used = UsedPin(JOB, 10, D2, NOW) if other == "another pin" else UsedPin("other", 10, D1, NOW)
    assert pin_refusal(JOB, D1, None, NOW, used) is None


def test_a_pin_is_refused_from_its_expiry_on() -> None:
    assert pin_refusal(JOB, D1, NOW + 1, NOW, None) is None
    why = pin_refusal(JOB, D1, NOW, NOW, None)
    assert why is not None
    assert f"expired at {utc(NOW)}" in why


def test_a_used_record_round_trips_and_refuses_what_is_not_one() -> None:
    used = UsedPin(JOB, 10, D1, NOW)
    assert UsedPin.from_json(json.dumps(used.to_dict()).encode()) == used
    good = used.to_dict()
    for bad in (
        {**good, "version": 2},
        {**good, "step": -1},
        {**good, "step": True},
        {**good, "pin_digest": "A" * 64},
        {**good, "used_at": -1},
        {**good, "used_at": 10**400},
        {**good, "job": "../x"},
        {k: v for k, v in good.items() if k != "used_at"},
    ):
        with pytest.raises(MalformedUsedRecord):
            UsedPin.from_json(json.dumps(bad).encode())
    with pytest.raises(MalformedUsedRecord):
        UsedPin.from_json(b"[]")


def test_an_expiry_leaves_older_pins_as_they_were() -> None:
    """A pin without one keeps its bytes, so its signature and digest (used-pins records)."""
    old = RestorePin(JOB, 10, 1234.5, "ab" * 32, "ops@host")
    assert "expires_at" not in old.to_dict()
    before = {  # what a pin was before expiries
        "version": 1,
        "job": JOB,
        "step": 10,
        "requested_at": 1234.5,
        "commit_digest": "ab" * 32,
        "requested_by": "ops@host",
    }
    assert old.to_json() == json.dumps(before, sort_keys=True).encode()
    assert pin_digest(old) == hashlib.sha256(old.to_json()).hexdigest()
    timed = RestorePin(JOB, 10, 1234.5, "ab" * 32, "ops@host", 5000.0)
    assert RestorePin.from_json(timed.to_json()) == timed
    assert pin_digest(timed) != pin_digest(old)
    for bad in (-1, "soon", True, float("inf")):
        with pytest.raises(MalformedPin):
            RestorePin(JOB, 10, 1234.5, "ab" * 32, "ops@host", bad)  # type: ignore[arg-type]


# --- StorePins, a real file:// bucket, a node's signature ------------------------------------


class Counting(FileObjectStore):
    """A real file:// bucket that counts reads."""

    reads = 0

    def read_chunks(self, key: str) -> Iterator[bytes]:
        self.reads += 1
        return super().read_chunks(key)


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Counting, RecordTrust, RecordTrust]:
    """A bucket with steps 1 and 2 committed, signed by node 0 of a CA; node 0's and node 1's
    trust (both sign and verify)."""
    ca = certs.new_ca()
    trusts = [
        record_trust(node_tls(tmp_path / f"node{n}", ca, node=f"node{n}").material())
        for n in (0, 1)
    ]
    objects = Counting(tmp_path / "bucket")
    backup = BackupStore(objects, trusts[0])
    for step in (1, 2):
        upload_step(backup, tmp_path, step, commit_at=time.time())
    return objects, trusts[0], trusts[1]


def _pin(objects: FileObjectStore, trust: RecordTrust, expires: float | None = None) -> bytes:
    raw = BackupStore(objects, trust).read_commit_raw(JOB, 1)
    assert raw is not None
    pin = RestorePin(JOB, 1, time.time(), commit_digest(raw[1]), "ops@host", expires)
    write_restore_pin(objects, pin)  # unsigned: these StorePins check no operator
    return objects.get_bytes(pin_key(JOB))


Said = list[tuple[str, str | None]]


def _pins(objects: FileObjectStore, trust: RecordTrust, store: Path) -> tuple[StorePins, Said]:
    said: Said = []
    pins = StorePins(objects, trust, used=UsedPins(store), on_refused=lambda *r: said.append(r))
    return pins, said


def test_a_pin_put_back_after_every_store_was_lost_is_refused(
    setup: tuple[Counting, RecordTrust, RecordTrust], tmp_path: Path
) -> None:
    """Before: the used pin was recorded in rank 0's store only; a new store honoured it."""
    objects, node0, node1 = setup
    raw = _pin(objects, node0)
    pins, said = _pins(objects, node0, tmp_path / "store0")
    assert pins.pinned_step(JOB) == 1
    pins.consumed(JOB, 1)
    assert not objects.root.joinpath(pin_key(JOB)).exists(), "the used pin is deleted"
    digest = pin_digest(RestorePin.from_json(raw))
    record = read_used_record(objects, JOB, digest, node1)
    assert record is not None, "signed by node 0, believed by node 1"
    assert record.step == 1
    assert b'"signature"' in objects.get_bytes(used_key(JOB, digest))

    # A bucket writer puts the same signed pin back; every store is gone (a new one, on
    # another node: rank 0 moved).
    objects.put_bytes(pin_key(JOB), raw)
    again, said = _pins(objects, node1, tmp_path / "store1")
    assert again.pinned_step(JOB) is None
    assert again.pinned_step(JOB) is None  # every round lists it: said once
    ((job, message),) = said
    assert job == JOB
    assert message is not None
    assert "refused the restore pin" in message, message
    assert "used already" in message, message
    assert "new pin" in message, message
    objects.delete(pin_key(JOB))
    assert again.pinned_step(JOB) is None
    assert said[1:] == [(JOB, None)]


def test_an_unbelieved_used_record_neither_blocks_a_pin_nor_stays(
    setup: tuple[Counting, RecordTrust, RecordTrust], tmp_path: Path
) -> None:
    """A bucket writer's unsigned record at a new pin's key: the pin is honoured, and the
    coordinator's signed record replaces it (create-only would otherwise keep the forgery)."""
    objects, node0, _ = setup
    raw = _pin(objects, node0)
    digest = pin_digest(RestorePin.from_json(raw))
    forged = UsedPin(JOB, 1, digest, time.time())
    objects.put_bytes(used_key(JOB, digest), json.dumps(forged.to_dict()).encode())
    pins, said = _pins(objects, node0, tmp_path / "store")
    assert pins.pinned_step(JOB) == 1
    assert said == []
    pins.consumed(JOB, 1)
    assert read_used_record(objects, JOB, digest, node0) is not None
    assert b'"signature"' in objects.get_bytes(used_key(JOB, digest))


def test_an_expired_pin_is_refused_and_said(
    setup: tuple[Counting, RecordTrust, RecordTrust], tmp_path: Path
) -> None:
    objects, node0, _ = setup
    _pin(objects, node0, expires=time.time() - 1)
    pins, said = _pins(objects, node0, tmp_path / "store")
    assert pins.pinned_step(JOB) is None
    ((_, message),) = said
    assert message is not None
    assert "expired at" in message, message
    _pin(objects, node0, expires=time.time() + 3600)
    assert pins.pinned_step(JOB) == 1


def test_the_used_record_costs_no_read_without_a_pin(
    setup: tuple[Counting, RecordTrust, RecordTrust], tmp_path: Path
) -> None:
    objects, node0, _ = setup
    pins, _ = _pins(objects, node0, tmp_path / "store")
    objects.reads = 0
    assert pins.pinned_step(JOB) is None
    assert objects.reads == 1, "the pin's read only"
