"""A genuine used record of *another* pin, moved to a new pin's key by a bucket
writer, must not stop the coordinator from writing the new pin's own used record, or the
new pin can be put back and honoured again once every store is lost (SECURITY.md: "another
pin's moved there ... counts as none and is replaced by the coordinator's")."""

from __future__ import annotations

import time
from pathlib import Path

from mtc_replicator.core.signed import RecordTrust
from mtc_replicator.storage.restore_pins import (
    RestorePin,
    pin_digest,
    pin_key,
    read_used_record,
    used_key,
)
from tests.unit.core.test_pin_use import Counting, _pin, _pins, setup  # noqa: F401
from tests.unit.storage.test_backup_audit import JOB


def test_a_moved_used_record_of_another_pin_does_not_make_a_pin_replayable(
    setup: tuple[Counting, RecordTrust, RecordTrust],  # noqa: F811
    tmp_path: Path,
) -> None:
    objects, node0, node1 = setup
    # Pin A honoured once: its genuine, node-signed used record is in the bucket.
    raw_a = _pin(objects, node0)
    pins, _ = _pins(objects, node0, tmp_path / "store0")
    assert pins.pinned_step(JOB) == 1
    pins.consumed(JOB, 1)
    digest_a = pin_digest(RestorePin.from_json(raw_a))
    record_a = objects.get_bytes(used_key(JOB, digest_a))

    # The operator pins again (pin B). A bucket writer copies A's record to B's key.
    time.sleep(0.01)
    raw_b = _pin(objects, node0)
    digest_b = pin_digest(RestorePin.from_json(raw_b))
    assert digest_b != digest_a
    objects.put_bytes(used_key(JOB, digest_b), record_a)
    assert pins.pinned_step(JOB) == 1, "A's record says nothing of B: B is honoured"
    pins.consumed(JOB, 1)
    assert not objects.root.joinpath(pin_key(JOB)).exists()
    used_b = read_used_record(objects, JOB, digest_b, node1)
    assert used_b is not None
    assert used_b.pin_digest == digest_b, "B's own record is written"

    # Every store lost; the writer puts B back: it must not roll the job back again.
    objects.put_bytes(pin_key(JOB), raw_b)
    again, said = _pins(objects, node1, tmp_path / "store1")
    assert again.pinned_step(JOB) is None
    assert said
    assert "used already" in str(said[0][1])
