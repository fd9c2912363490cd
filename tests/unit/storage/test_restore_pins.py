"""Tests for ``mtc_replicator.storage.restore_pins``: the restore pin as hostile input, clearing and
resolving it against real backups, and ``StorePins`` honouring a used pin once.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtc_replicator.cluster.registry import PREFIX as REGISTRY_PREFIX
from mtc_replicator.core.backup_layout import CommitRecord, commit_key
from mtc_replicator.core.jobname import JOB_NAME_PATTERN, is_job_name
from mtc_replicator.local.usedpins import UsedPins
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.backup_audit import list_jobs, read_commit_raw, scan_job
from mtc_replicator.storage.objectstore import MemoryObjectStore, PermissionDenied
from mtc_replicator.storage.restore_pins import (
    MalformedPin,
    RestorePin,
    StalePin,
    StorePins,
    clear_restore_pin,
    commit_digest,
    pin_key,
    read_restore_pin,
    resolve_restore_pin,
    write_restore_pin,
)
from tests.unit.storage.test_backup_audit import JOB, upload_step

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def backup(objects: MemoryObjectStore) -> BackupStore:
    return BackupStore(objects)


# --- restore pin ---------------------------------------------------------------------------

DIGEST = "ab" * 32


def pin_body(**changes: object) -> dict[str, object]:
    body: dict[str, object] = {
        "version": 1,
        "job": JOB,
        "step": 200,
        "requested_at": 1234.5,
        "commit_digest": DIGEST,
        "requested_by": "ops@host",
    }
    body.update(changes)
    return body


def test_pin_round_trip(objects: MemoryObjectStore) -> None:
    pin = RestorePin(JOB, 200, 1234.5, DIGEST, "ops@host")
    write_restore_pin(objects, pin)
    assert objects.head(f"_control/{JOB}/restore-pin.json") is not None
    assert read_restore_pin(objects, JOB) == pin
    assert json.loads(objects.get_bytes(pin_key(JOB))) == pin_body()


def test_no_pin_is_none(objects: MemoryObjectStore) -> None:
    assert read_restore_pin(objects, JOB) is None


def test_pin_fields_beyond_the_format_are_ignored_and_requested_by_is_optional() -> None:
    body = pin_body(future="field")
    del body["requested_by"]
    pin = RestorePin.from_json(json.dumps(body).encode())
    assert (pin.step, pin.requested_by) == (200, "")


def _dumps(body: object) -> bytes:
    return json.dumps(body).encode()


MALFORMED_PINS: dict[str, bytes] = {
    "empty": b"",
    "not json": b"{step: 200",
    "not utf-8": b"\xff\xfe\x00",
    "a list": b"[1, 2]",
    "deeply nested": b"[" * 3000,
    "no version": _dumps({k: v for k, v in pin_body().items() if k != "version"}),
    "version 2": _dumps(pin_body(version=2)),
    "version true": _dumps(pin_body(version=True)),
    "missing step": _dumps({k: v for k, v in pin_body().items() if k != "step"}),
    "step as string": _dumps(pin_body(step="200")),
    "step as bool": _dumps(pin_body(step=True)),
    "step as float": _dumps(pin_body(step=200.0)),
    "negative step": _dumps(pin_body(step=-1)),
    "job with slash": _dumps(pin_body(job="a/b")),
    "job _control": _dumps(pin_body(job="_control")),
    "job with dotdot": _dumps(pin_body(job="a..b")),
    "job not a string": _dumps(pin_body(job=7)),
    "NaN time": b'{"version":1,"job":"job","step":1,"requested_at":NaN,"commit_digest":"'
    + DIGEST.encode()
    + b'"}',
    "infinite time": _dumps(pin_body(requested_at=1e400)),
    "negative time": _dumps(pin_body(requested_at=-1)),
    "time beyond any float": _dumps(pin_body(requested_at=10**400)),
    "time as string": _dumps(pin_body(requested_at="now")),
    "short digest": _dumps(pin_body(commit_digest="ab")),
    "uppercase digest": _dumps(pin_body(commit_digest="AB" * 32)),
    "digest not a string": _dumps(pin_body(commit_digest=None)),
    "control chars in requested_by": _dumps(pin_body(requested_by="a\x1b[2Jb")),
    "huge requested_by": _dumps(pin_body(requested_by="x" * 300)),
    "oversize": _dumps(pin_body(requested_by="x" * 5000)),
}


@pytest.mark.parametrize("name", sorted(MALFORMED_PINS))
def test_malformed_pin_is_a_clear_error(objects: MemoryObjectStore, name: str) -> None:
    objects.put_bytes(pin_key(JOB), MALFORMED_PINS[name])
    with pytest.raises(MalformedPin, match=re.escape("restore pin _control/job/restore-pin.json")):
        read_restore_pin(objects, JOB)


def test_pin_of_another_job_is_refused(objects: MemoryObjectStore) -> None:
    objects.put_bytes(pin_key(JOB), _dumps(pin_body(job="other")))
    with pytest.raises(MalformedPin, match="names job 'other'"):
        read_restore_pin(objects, JOB)


def test_a_giant_pin_is_not_read_to_the_end() -> None:
    class Counting(MemoryObjectStore):
        chunks = 0

        def read_chunks(self, key: str) -> Any:
            for chunk in super().read_chunks(key):
                self.chunks += 1
                yield chunk

    objects = Counting()
    objects.put_bytes(pin_key(JOB), b"{" * (20 * 1024 * 1024))
    with pytest.raises(MalformedPin, match="more than 24576 bytes"):
        read_restore_pin(objects, JOB)
    assert objects.chunks == 1


@given(st.binary(max_size=600))
@PROPS
def test_any_bytes_parse_or_raise_malformed_pin(raw: bytes) -> None:
    with contextlib.suppress(MalformedPin):
        RestorePin.from_json(raw)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=10,
)


DROP = "\x00drop"  # a drawn value that marks its key as removed from the body


@given(st.dictionaries(st.sampled_from(sorted(pin_body())), JSON_VALUES | st.just(DROP)))
@PROPS
def test_a_pin_with_any_field_changed_parses_or_raises_malformed_pin(
    changes: dict[str, Any],
) -> None:
    body = {k: v for k, v in {**pin_body(), **changes}.items() if v != DROP}
    try:
        pin = RestorePin.from_json(json.dumps(body).encode())
    except MalformedPin:
        return
    assert RestorePin.from_json(pin.to_json()) == pin
    assert (pin.job, pin.step, pin.commit_digest) == (body["job"], body["step"], DIGEST)


JOB_NAMES = st.from_regex(JOB_NAME_PATTERN, fullmatch=True).filter(lambda j: ".." not in j)


@given(JOB_NAMES, JOB_NAMES)
@PROPS
def test_control_and_registry_keys_never_fall_under_a_job_prefix(a: str, b: str) -> None:
    assert not pin_key(a).startswith(f"{b}/")
    assert not REGISTRY_PREFIX.startswith(f"{b}/")


def test_control_can_never_be_a_job() -> None:
    assert not is_job_name("_control")
    assert re.fullmatch(JOB_NAME_PATTERN, "_control") is None
    with pytest.raises(MalformedPin):
        pin_key("_control")


def test_pins_and_registry_are_invisible_to_backups(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100)
    before = backup.committed_steps(JOB)
    write_restore_pin(objects, RestorePin(JOB, 100, 1.0, DIGEST))
    objects.put_bytes(f"{REGISTRY_PREFIX}{JOB}.json", b"{}")
    assert backup.committed_steps(JOB) == before
    assert list(before) == [100]
    assert list_jobs(objects) == [JOB]
    listing = scan_job(objects, JOB)
    assert [s.step for s in listing.steps] == [100]
    assert listing.stray == ()


def test_clear_pin_only_removes_the_expected_one(objects: MemoryObjectStore) -> None:
    first = RestorePin(JOB, 100, 1.0, DIGEST)
    second = RestorePin(JOB, 200, 2.0, DIGEST)
    write_restore_pin(objects, second)
    assert not clear_restore_pin(objects, JOB, expected=first)
    assert read_restore_pin(objects, JOB) == second
    assert clear_restore_pin(objects, JOB, expected=second)
    assert read_restore_pin(objects, JOB) is None
    assert not clear_restore_pin(objects, JOB)


def test_clear_removes_a_malformed_pin_only_when_asked_unconditionally(
    objects: MemoryObjectStore,
) -> None:
    objects.put_bytes(pin_key(JOB), b"garbage")
    assert not clear_restore_pin(objects, JOB, expected=RestorePin(JOB, 1, 1.0, DIGEST))
    assert clear_restore_pin(objects, JOB)
    assert objects.head(pin_key(JOB)) is None


def test_resolve_pin_checks_the_commit_is_the_pinned_one(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=5.0)
    found = read_commit_raw(objects, JOB, 100)
    assert found is not None
    pin = RestorePin(JOB, 100, 9.0, commit_digest(found[1]))
    assert resolve_restore_pin(objects, pin) == found[0]
    # Pruned and uploaded again: a different COMMIT, not what the operator chose.
    objects.delete(commit_key(JOB, 100))
    with pytest.raises(StalePin, match="not committed any more"):
        resolve_restore_pin(objects, pin)
    record = CommitRecord(JOB, 100, found[0].items, 6.0)
    objects.put_bytes(commit_key(JOB, 100), record.to_json())
    with pytest.raises(StalePin, match="committed again"):
        resolve_restore_pin(objects, pin)
    objects.put_bytes(commit_key(JOB, 100), b"not json")
    with pytest.raises(StalePin, match="not JSON"):
        resolve_restore_pin(objects, pin)


# --- a used pin, when its delete is refused ----------------------------------------------------


class NoDelete(MemoryObjectStore):
    """A bucket whose policy refuses every delete."""

    def delete(self, key: str) -> None:
        raise PermissionDenied(f"delete {key}: 403 AccessDenied")


def _pin_step(backup: BackupStore, tmp_path: Path, step: int, at: float) -> RestorePin:
    raw = backup.read_commit_raw(JOB, step)
    assert raw is not None
    pin = RestorePin(JOB, step, at, commit_digest(raw[1]))
    write_restore_pin(backup.objects, pin)
    return pin


def test_a_pin_whose_delete_is_refused_is_honoured_once(tmp_path: Path) -> None:
    """Before: the pin stayed and every round rolled the job back to it again."""
    objects = NoDelete()
    backup = BackupStore(objects)
    for step in (1, 2):
        upload_step(backup, tmp_path, step)
    failures: list[tuple[str, int, str]] = []
    pins = StorePins(
        objects,
        used=UsedPins(tmp_path / "store"),
        on_failure=lambda *failed: failures.append(failed),
    )
    _pin_step(backup, tmp_path, 1, 1000.0)
    assert pins.pinned_step(JOB) == 1
    pins.consumed(JOB, 1)
    ((job, step, message),) = failures
    assert (job, step) == (JOB, 1)
    assert "AccessDenied" in message
    assert read_restore_pin(objects, JOB) is not None, "the store kept it"
    assert pins.pinned_step(JOB) is None
    # After a daemon restart too: the record is on disk.
    again = StorePins(objects, used=UsedPins(tmp_path / "store"))
    assert again.pinned_step(JOB) is None
    # A pin made later, of the same step, is another pin.
    _pin_step(backup, tmp_path, 1, 2000.0)
    assert again.pinned_step(JOB) == 1


def test_a_pin_deleted_as_granted_reports_nothing(
    objects: MemoryObjectStore, tmp_path: Path
) -> None:
    backup = BackupStore(objects)
    upload_step(backup, tmp_path, 1)
    failures: list[object] = []
    pins = StorePins(objects, used=UsedPins(tmp_path), on_failure=lambda *f: failures.append(f))
    _pin_step(backup, tmp_path, 1, 1000.0)
    assert pins.pinned_step(JOB) == 1
    pins.consumed(JOB, 1)
    assert read_restore_pin(objects, JOB) is None
    assert failures == []


def test_an_unreadable_record_of_used_pins_is_ignored(tmp_path: Path) -> None:
    used = UsedPins(tmp_path)
    used.record(JOB, "a" * 64)
    assert used.used(JOB, "a" * 64)
    (tmp_path / "used-pins" / f"{JOB}.json").write_text("{not json")
    assert not used.used(JOB, "a" * 64)
    used.record(JOB, "b" * 64)
    assert used.used(JOB, "b" * 64)
