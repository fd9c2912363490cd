"""Tests for ``replicator.storage.backup_ops``: the retention policy (hypothesis properties), the
restore pin as hostile input, and listing, verifying and pruning real backups made by
``BackupStore`` on the in-memory object store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replicator.cluster.registry import PREFIX as REGISTRY_PREFIX
from replicator.core.backup_layout import (
    LAYOUT_V1,
    CommitRecord,
    commit_key,
    data_key,
    manifest_key,
)
from replicator.core.jobname import JOB_NAME_PATTERN, is_job_name
from replicator.core.manifest import FileEntry, ItemId, ItemKind, Manifest
from replicator.local.hashing import build_manifest
from replicator.local.usedpins import UsedPins
from replicator.storage import backup_ops as ops
from replicator.storage.backup import BackupStore
from replicator.storage.objectstore import MemoryObjectStore, PermissionDenied
from tests.unit.test_backup import upload_v1

JOB = "job"
HOUR = 3600.0
DAY = 24 * HOUR
BASE = 1_700_006_400.0
"""2023-11-15T00:00:00Z, a Wednesday: calendar buckets in the examples start here."""
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- a real backup in memory -----------------------------------------------------------------


def upload_step(
    backup: BackupStore,
    tmp: Path,
    step: int,
    *,
    ranks: int = 2,
    commit_at: float | None = 1000.0,
    job: str = JOB,
) -> dict[str, Manifest]:
    """Upload ``ranks`` items of ``step`` (rank 0 a tree, the rest files); commit unless None."""
    manifests: dict[str, Manifest] = {}
    for rank in range(ranks):
        item = ItemId(job, step, rank, 0)
        src = tmp / f"{job}-{step}-{rank}"
        if rank == 0:
            (src / "sub").mkdir(parents=True)
            (src / "sub" / "a").write_bytes(os.urandom(3000))
            (src / "b").write_bytes(os.urandom(1000))
        else:
            src.write_bytes(os.urandom(2000))
        manifests[item.key] = build_manifest(item, src)
        backup.upload_item(manifests[item.key], src)
    if commit_at is not None:
        assert backup.try_commit(job, step, list(manifests), now=commit_at) is not None
    return manifests


@pytest.fixture
def objects() -> MemoryObjectStore:
    return MemoryObjectStore()


@pytest.fixture
def backup(objects: MemoryObjectStore) -> BackupStore:
    return BackupStore(objects)


class Recorder:
    """A progress sink that remembers the total it heard."""

    def __init__(self) -> None:
        self.total = 0

    def __call__(self, n: int) -> None:
        assert n >= 0
        self.total += n


def verify(objects: MemoryObjectStore, step: int) -> ops.StepVerdict:
    plan = ops.plan_verify(objects, JOB, step)
    assert plan.committed
    heard = Recorder()
    verdict = ops.run_verify(objects, plan, heard)
    assert heard.total == plan.total_bytes  # the bar always ends at 100%
    return verdict


def kinds(verdict: ops.StepVerdict) -> list[ops.ProblemKind]:
    return [p.kind for p in verdict.problems]


# --- formatting ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (3 * 1024**2, "3.0 MiB"),
        (int(1.5 * 1024**3), "1.5 GiB"),
        (2 * 1024**5, "2.0 PiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert ops.human_bytes(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (59.9, "59s"),
        (60, "1m"),
        (3 * HOUR + 12 * 60 + 5, "3h12m"),
        (2 * DAY + 4 * HOUR, "2d4h"),
        (-5, "0s"),
        (-2 * HOUR, "2h0m ahead"),
        (math.nan, "?"),
    ],
)
def test_human_age(seconds: float, text: str) -> None:
    assert ops.human_age(seconds) == text


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
    pin = ops.RestorePin(JOB, 200, 1234.5, DIGEST, "ops@host")
    ops.write_restore_pin(objects, pin)
    assert objects.head(f"_control/{JOB}/restore-pin.json") is not None
    assert ops.read_restore_pin(objects, JOB) == pin
    assert json.loads(objects.get_bytes(ops.pin_key(JOB))) == pin_body()


def test_no_pin_is_none(objects: MemoryObjectStore) -> None:
    assert ops.read_restore_pin(objects, JOB) is None


def test_pin_fields_beyond_the_format_are_ignored_and_requested_by_is_optional() -> None:
    body = pin_body(future="field")
    del body["requested_by"]
    pin = ops.RestorePin.from_json(json.dumps(body).encode())
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
    objects.put_bytes(ops.pin_key(JOB), MALFORMED_PINS[name])
    with pytest.raises(
        ops.MalformedPin, match=re.escape("restore pin _control/job/restore-pin.json")
    ):
        ops.read_restore_pin(objects, JOB)


def test_pin_of_another_job_is_refused(objects: MemoryObjectStore) -> None:
    objects.put_bytes(ops.pin_key(JOB), _dumps(pin_body(job="other")))
    with pytest.raises(ops.MalformedPin, match="names job 'other'"):
        ops.read_restore_pin(objects, JOB)


def test_a_giant_pin_is_not_read_to_the_end() -> None:
    class Counting(MemoryObjectStore):
        chunks = 0

        def read_chunks(self, key: str) -> Any:
            for chunk in super().read_chunks(key):
                self.chunks += 1
                yield chunk

    objects = Counting()
    objects.put_bytes(ops.pin_key(JOB), b"{" * (20 * 1024 * 1024))
    with pytest.raises(ops.MalformedPin, match="more than 4096 bytes"):
        ops.read_restore_pin(objects, JOB)
    assert objects.chunks == 1


@given(st.binary(max_size=600))
@PROPS
def test_any_bytes_parse_or_raise_malformed_pin(raw: bytes) -> None:
    with contextlib.suppress(ops.MalformedPin):
        ops.RestorePin.from_json(raw)


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
        pin = ops.RestorePin.from_json(json.dumps(body).encode())
    except ops.MalformedPin:
        return
    assert ops.RestorePin.from_json(pin.to_json()) == pin
    assert (pin.job, pin.step, pin.commit_digest) == (body["job"], body["step"], DIGEST)


JOB_NAMES = st.from_regex(JOB_NAME_PATTERN, fullmatch=True).filter(lambda j: ".." not in j)


@given(JOB_NAMES, JOB_NAMES)
@PROPS
def test_control_and_registry_keys_never_fall_under_a_job_prefix(a: str, b: str) -> None:
    assert not ops.pin_key(a).startswith(f"{b}/")
    assert not REGISTRY_PREFIX.startswith(f"{b}/")


def test_control_can_never_be_a_job() -> None:
    assert not is_job_name("_control")
    assert re.fullmatch(JOB_NAME_PATTERN, "_control") is None
    with pytest.raises(ops.MalformedPin):
        ops.pin_key("_control")


def test_pins_and_registry_are_invisible_to_backups(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100)
    before = backup.committed_steps(JOB)
    ops.write_restore_pin(objects, ops.RestorePin(JOB, 100, 1.0, DIGEST))
    objects.put_bytes(f"{REGISTRY_PREFIX}{JOB}.json", b"{}")
    assert backup.committed_steps(JOB) == before
    assert list(before) == [100]
    assert ops.list_jobs(objects) == [JOB]
    listing = ops.scan_job(objects, JOB)
    assert [s.step for s in listing.steps] == [100]
    assert listing.stray == ()


def test_clear_pin_only_removes_the_expected_one(objects: MemoryObjectStore) -> None:
    first = ops.RestorePin(JOB, 100, 1.0, DIGEST)
    second = ops.RestorePin(JOB, 200, 2.0, DIGEST)
    ops.write_restore_pin(objects, second)
    assert not ops.clear_restore_pin(objects, JOB, expected=first)
    assert ops.read_restore_pin(objects, JOB) == second
    assert ops.clear_restore_pin(objects, JOB, expected=second)
    assert ops.read_restore_pin(objects, JOB) is None
    assert not ops.clear_restore_pin(objects, JOB)


def test_clear_removes_a_malformed_pin_only_when_asked_unconditionally(
    objects: MemoryObjectStore,
) -> None:
    objects.put_bytes(ops.pin_key(JOB), b"garbage")
    assert not ops.clear_restore_pin(objects, JOB, expected=ops.RestorePin(JOB, 1, 1.0, DIGEST))
    assert ops.clear_restore_pin(objects, JOB)
    assert objects.head(ops.pin_key(JOB)) is None


def test_resolve_pin_checks_the_commit_is_the_pinned_one(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=5.0)
    found = ops.read_commit_raw(objects, JOB, 100)
    assert found is not None
    pin = ops.RestorePin(JOB, 100, 9.0, ops.commit_digest(found[1]))
    assert ops.resolve_restore_pin(objects, pin) == found[0]
    # Pruned and uploaded again: a different COMMIT, not what the operator chose.
    objects.delete(commit_key(JOB, 100))
    with pytest.raises(ops.StalePin, match="not committed any more"):
        ops.resolve_restore_pin(objects, pin)
    record = CommitRecord(JOB, 100, found[0].items, 6.0)
    objects.put_bytes(commit_key(JOB, 100), record.to_json())
    with pytest.raises(ops.StalePin, match="committed again"):
        ops.resolve_restore_pin(objects, pin)
    objects.put_bytes(commit_key(JOB, 100), b"not json")
    with pytest.raises(ops.StalePin, match="not JSON"):
        ops.resolve_restore_pin(objects, pin)


# --- listing -------------------------------------------------------------------------------


def test_scan_job_tells_committed_partial_and_invalid_steps_apart(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=500.0)
    upload_step(backup, tmp_path, 200, commit_at=None, ranks=1)
    upload_step(backup, tmp_path, 300, commit_at=None)
    objects.put_bytes(commit_key(JOB, 300), b"{broken")
    objects.put_bytes(f"{JOB}/stray", b"x")
    objects.put_bytes(f"{JOB}/007/x", b"x")  # not a step's spelling
    upload_step(backup, tmp_path, 5, job="other")

    assert ops.list_jobs(objects) == [JOB, "other"]
    listing = ops.scan_job(objects, JOB)
    assert [s.step for s in listing.steps] == [300, 200, 100]
    assert listing.stray == (f"{JOB}/007/x", f"{JOB}/stray")
    invalid, partial, committed = listing.steps
    assert invalid.commit is None
    assert invalid.commit_error is not None
    assert invalid.state(now=1e9) is ops.StepState.INVALID
    assert (partial.items, partial.objects, partial.commit) == (1, 3, None)
    assert partial.bytes == 4000 + len(objects.get_bytes(manifest_key(ItemId(JOB, 200, 0, 0))))
    newest = partial.newest_object_at
    assert partial.state(now=newest + 10, min_age_seconds=60) is ops.StepState.UPLOADING
    assert partial.state(now=newest + 60, min_age_seconds=60) is ops.StepState.PARTIAL
    assert committed.commit is not None
    assert committed.commit.created == 500.0
    assert (committed.items, committed.objects) == (2, 6)
    assert committed.state(now=1e9) is ops.StepState.COMMITTED
    assert ops.scan_job(objects, "nothing").steps == ()


# --- verification --------------------------------------------------------------------------


def test_verify_a_good_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100)
    verdict = verify(objects, 100)
    assert verdict.ok
    assert (verdict.items, verdict.objects_checked, verdict.bytes_checked) == (2, 3, 6000)
    assert verdict.unexpected == ()


def test_verify_finds_a_flipped_byte(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100)
    key = data_key(manifests["0-0"].item, "sub/a")
    data = bytearray(objects.get_bytes(key))
    data[1234] ^= 0x01
    objects.put_bytes(key, bytes(data))
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ops.ProblemKind.CHECKSUM_MISMATCH]
    problem = verdict.problems[0]
    assert (problem.item, problem.key) == ("0-0", key)
    assert "manifest says" in problem.detail


def test_verify_reports_every_problem_of_a_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100, ranks=3)
    objects.delete(data_key(manifests["0-0"].item, "b"))
    objects.put_bytes(data_key(manifests["1-0"].item, ""), b"short")
    # Rank 2's manifest swapped for one that describes other bytes: its digest differs.
    swapped = Manifest(manifests["2-0"].item, ItemKind.FILE, (FileEntry("", 5, 0),))
    objects.put_bytes(manifest_key(manifests["2-0"].item), swapped.to_json())
    objects.put_bytes(f"{JOB}/100/0-0/extra", b"x")
    verdict = verify(objects, 100)
    assert kinds(verdict) == [
        ops.ProblemKind.MANIFEST_DIGEST_MISMATCH,
        ops.ProblemKind.MISSING_OBJECT,
        ops.ProblemKind.SIZE_MISMATCH,
    ]
    assert "5 bytes, manifest says 2000" in verdict.problems[2].detail
    assert verdict.unexpected == (f"{JOB}/100/0-0/extra",)


def test_verify_a_commit_naming_a_missing_manifest(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    committed = backup.try_commit(JOB, 100, ["0-0", "1-0"])
    assert committed is not None
    items = {**committed.items, "7-0": "cd" * 32}
    objects.delete(commit_key(JOB, 100))
    objects.put_bytes(commit_key(JOB, 100), CommitRecord(JOB, 100, items, 1.0).to_json())
    verdict = verify(objects, 100)
    assert kinds(verdict) == [ops.ProblemKind.MISSING_MANIFEST]
    assert verdict.problems[0].item == "7-0"


@pytest.mark.parametrize(
    "commit",
    [
        b"{nope",
        json.dumps({"job": "other", "step": 100, "items": {}, "created": 1}).encode(),
        json.dumps({"job": JOB, "step": 100, "items": {}, "created": 10**400}).encode(),
    ],
)
def test_verify_an_invalid_commit(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path, commit: bytes
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    objects.put_bytes(commit_key(JOB, 100), commit)
    assert kinds(verify(objects, 100)) == [ops.ProblemKind.INVALID_COMMIT]


def test_verify_an_invalid_manifest(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    manifests = upload_step(backup, tmp_path, 100)
    objects.put_bytes(manifest_key(manifests["1-0"].item), b'{"version": 1, "job": "../x"}')
    assert kinds(verify(objects, 100)) == [ops.ProblemKind.INVALID_MANIFEST]


def test_a_partial_step_is_not_verified(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=None)
    assert not ops.plan_verify(objects, JOB, 100).committed
    assert ops.verify_step(objects, JOB, 100) is None


def test_find_newest_verified_walks_down_past_corrupt_steps(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    for step in (100, 200, 300):
        upload_step(backup, tmp_path, step)
    objects.delete(data_key(ItemId(JOB, 300, 1, 0), ""))
    newest, verdicts = ops.find_newest_verified(objects, JOB, [100, 200, 300])
    assert newest == 200
    assert [(v.step, v.ok) for v in verdicts] == [(300, False), (200, True)]


# --- retention policy: examples ----------------------------------------------------------


def decide(
    policy: ops.RetentionPolicy, facts: ops.PruneFacts, now: float = BASE + 100 * DAY
) -> dict[int, tuple[ops.Action, tuple[str, ...]]]:
    return {d.step: (d.action, d.reasons) for d in ops.plan_prune(policy, facts, now)}


def kept(policy: ops.RetentionPolicy, facts: ops.PruneFacts) -> list[int]:
    return sorted(s for s, (a, _) in decide(policy, facts).items() if a is ops.Action.KEEP)


def test_keep_last() -> None:
    facts = ops.PruneFacts({s: BASE + s for s in range(1, 7)})
    assert kept(ops.RetentionPolicy(keep_last=3), facts) == [4, 5, 6]
    assert kept(ops.RetentionPolicy(keep_last=10), facts) == [1, 2, 3, 4, 5, 6]


def test_the_newest_committed_step_is_kept_by_any_policy() -> None:
    facts = ops.PruneFacts({1: BASE, 2: BASE + DAY}, partial={3: BASE + 50 * DAY})
    decisions = decide(ops.RetentionPolicy(keep_weekly=0), facts)
    assert decisions[2] == (ops.Action.KEEP, ("newest committed",))
    assert decisions[1][0] is decisions[3][0] is ops.Action.DELETE


def test_keep_hourly_keeps_the_newest_of_each_hour_that_has_backups() -> None:
    times = {
        1: BASE + 10 * 60,  # 00h
        2: BASE + 50 * 60,  # 00h, newest of the hour
        3: BASE + HOUR + 20 * 60,  # 01h
        4: BASE + 3 * HOUR + 5 * 60,  # 03h (02h has none: it does not count)
        5: BASE + 3 * HOUR + 55 * 60,  # 03h, newest
    }
    assert kept(ops.RetentionPolicy(keep_hourly=2), ops.PruneFacts(times)) == [3, 5]
    assert kept(ops.RetentionPolicy(keep_hourly=3), ops.PruneFacts(times)) == [2, 3, 5]
    reasons = decide(ops.RetentionPolicy(keep_hourly=3), ops.PruneFacts(times))[3][1]
    assert reasons == ("hourly 2023-11-15T01",)


def test_keep_daily_and_weekly_use_utc_days_and_iso_weeks() -> None:
    # BASE is Wednesday 2023-11-15; the ISO week ends on Sunday the 19th.
    times = {
        1: BASE + 1 * HOUR,  # Wed
        2: BASE + 4 * DAY + 23 * HOUR,  # Sun, last of the week 2023-W46
        3: BASE + 5 * DAY,  # Mon, 2023-W47
        4: BASE + 5 * DAY + HOUR,  # Mon, newest
    }
    assert kept(ops.RetentionPolicy(keep_daily=2), ops.PruneFacts(times)) == [2, 4]
    assert kept(ops.RetentionPolicy(keep_weekly=5), ops.PruneFacts(times)) == [2, 4]
    reasons = decide(ops.RetentionPolicy(keep_weekly=5), ops.PruneFacts(times))
    assert reasons[2][1] == ("weekly 2023-W46",)
    assert reasons[4][1] == ("newest committed", "weekly 2023-W47")


def test_rules_add_up() -> None:
    times = {s: BASE + s * DAY for s in range(10)}
    policy = ops.RetentionPolicy(keep_last=2, keep_daily=3, keep_weekly=2)
    # last 2: 9, 8; daily: 9, 8, 7; weekly: 9 (Fri of 2023-W47) and 4 (Sun of 2023-W46).
    assert kept(policy, ops.PruneFacts(times)) == [4, 7, 8, 9]


def test_partial_steps_are_kept_while_young_and_deleted_when_abandoned() -> None:
    now = BASE + DAY
    facts = ops.PruneFacts({1: BASE}, partial={2: now - 59 * 60, 3: now - 61 * 60, 4: now + 30})
    decisions = decide(ops.RetentionPolicy(keep_last=1), facts, now)
    assert decisions[2][0] is ops.Action.KEEP
    assert "may still be uploading (newest object 59m old)" in decisions[2][1]
    assert decisions[3] == (ops.Action.DELETE, ("no COMMIT, newest object 1h1m old",))
    assert decisions[4][0] is ops.Action.KEEP  # written "in the future": clocks differ


def test_pinned_invalid_and_verified_steps_are_kept() -> None:
    facts = ops.PruneFacts(
        {1: BASE, 2: BASE + 1, 3: BASE + 2, 4: BASE + 3},
        partial={5: BASE},
        invalid=[6],
        pinned=1,
        verify_requested=True,
        newest_verified=2,
    )
    decisions = decide(ops.RetentionPolicy(keep_last=1), facts)
    assert decisions[1] == (ops.Action.KEEP, ("restore pin",))
    assert decisions[2] == (ops.Action.KEEP, ("newest verified",))
    assert decisions[3][0] is ops.Action.DELETE
    assert decisions[4] == (ops.Action.KEEP, ("newest committed", "last 1"))
    assert decisions[5][0] is ops.Action.DELETE
    assert decisions[6] == (ops.Action.KEEP, ("COMMIT unreadable: left for inspection",))


def test_nothing_verified_keeps_every_committed_step() -> None:
    facts = ops.PruneFacts({1: BASE, 2: BASE + 1}, verify_requested=True, newest_verified=None)
    assert kept(ops.RetentionPolicy(keep_last=1), facts) == [1, 2]


def test_commit_times_no_calendar_holds_only_miss_the_calendar_rules() -> None:
    facts = ops.PruneFacts({1: math.nan, 2: 1e300, 3: BASE})
    assert kept(ops.RetentionPolicy(keep_daily=5), facts) == [3]
    assert kept(ops.RetentionPolicy(keep_last=3), facts) == [1, 2, 3]


def test_policy_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        ops.RetentionPolicy(keep_last=-1)
    with pytest.raises(ValueError, match="min_age_seconds"):
        ops.RetentionPolicy(min_age_seconds=math.inf)


# --- retention policy: properties --------------------------------------------------------

STEPS = st.integers(0, 10**6)
TIMES = st.floats(BASE - 60 * DAY, BASE + 60 * DAY)
ODD_TIMES = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300])
POLICIES = st.builds(
    ops.RetentionPolicy,
    keep_last=st.integers(0, 6),
    keep_hourly=st.integers(0, 6),
    keep_daily=st.integers(0, 6),
    keep_weekly=st.integers(0, 6),
    min_age_seconds=st.floats(0, 10 * DAY),
)


@st.composite
def prune_facts(draw: st.DrawFn) -> ops.PruneFacts:
    committed = draw(st.dictionaries(STEPS, TIMES | ODD_TIMES, max_size=25))
    partial = draw(st.dictionaries(STEPS, TIMES, max_size=6))
    invalid = draw(st.lists(STEPS, max_size=3))
    for s in committed:
        partial.pop(s, None)
    invalid = [s for s in invalid if s not in committed and s not in partial]
    every = [*committed, *partial, *invalid]
    pinned = draw(st.none() | st.sampled_from(every)) if every else None
    verify_requested = draw(st.booleans())
    newest_verified = draw(st.none() | st.sampled_from(sorted(committed))) if committed else None
    return ops.PruneFacts(committed, partial, invalid, pinned, verify_requested, newest_verified)


def bucket(name: str, t: float) -> str | None:
    try:
        d = datetime.fromtimestamp(t, UTC)
    except (OverflowError, OSError, ValueError):
        return None
    if name == "hourly":
        return d.strftime("%Y-%m-%d %H")
    if name == "daily":
        return d.strftime("%Y-%m-%d")
    return str(d.isocalendar()[:2])


@given(POLICIES, prune_facts(), TIMES)
@PROPS
def test_prune_never_deletes_what_must_stay(
    policy: ops.RetentionPolicy, facts: ops.PruneFacts, now: float
) -> None:
    decisions = ops.plan_prune(policy, facts, now)
    steps = [d.step for d in decisions]
    assert steps == sorted({*facts.committed, *facts.partial, *facts.invalid}, reverse=True)
    action = {d.step: d.action for d in decisions}
    keep = {s for s, a in action.items() if a is ops.Action.KEEP}
    assert all(d.reasons for d in decisions)
    if facts.committed:
        assert max(facts.committed) in keep
    assert set(sorted(facts.committed, reverse=True)[: policy.keep_last]) <= keep
    if facts.pinned is not None:
        assert facts.pinned in keep
    assert set(facts.invalid) <= keep
    for s, t in facts.partial.items():
        if now - t < policy.min_age_seconds:
            assert s in keep
    if facts.verify_requested:
        if facts.newest_verified is not None:
            assert facts.newest_verified in keep
        else:
            assert set(facts.committed) <= keep


@given(POLICIES, prune_facts(), TIMES)
@PROPS
def test_period_rules_keep_the_newest_step_of_the_newest_periods(
    policy: ops.RetentionPolicy, facts: ops.PruneFacts, now: float
) -> None:
    reasons = {d.step: d.reasons for d in ops.plan_prune(policy, facts, now)}
    counts = {"hourly": policy.keep_hourly, "daily": policy.keep_daily}
    counts["weekly"] = policy.keep_weekly
    for name, count in counts.items():
        newest_of: dict[str, int] = {}
        for s, t in facts.committed.items():
            b = bucket(name, t)
            if b is not None:
                newest_of[b] = max(newest_of.get(b, s), s)
        expected = sorted(newest_of.values(), reverse=True)[:count]
        chosen = [s for s in reasons if any(r.startswith(f"{name} ") for r in reasons[s])]
        assert sorted(chosen, reverse=True) == expected


@given(
    POLICIES,
    prune_facts(),
    TIMES,
    st.sampled_from(["keep_last", "keep_hourly", "keep_daily", "keep_weekly"]),
)
@PROPS
def test_keeping_more_never_deletes_more(
    policy: ops.RetentionPolicy, facts: ops.PruneFacts, now: float, rule: str
) -> None:
    def kept_by(p: ops.RetentionPolicy) -> set[int]:
        return {d.step for d in ops.plan_prune(p, facts, now) if d.action is ops.Action.KEEP}

    more = dataclasses.replace(policy, **{rule: getattr(policy, rule) + 1})
    assert kept_by(policy) <= kept_by(more)


# --- prune I/O ----------------------------------------------------------------------------


class DeleteLog(MemoryObjectStore):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def test_delete_step_removes_commit_first_then_manifests_then_data(tmp_path: Path) -> None:
    objects = DeleteLog()
    upload_step(BackupStore(objects), tmp_path, 100)
    upload_step(BackupStore(objects), tmp_path, 1000)
    count, size = ops.delete_step(objects, JOB, 100)
    assert objects.deleted[0] == commit_key(JOB, 100)
    assert set(objects.deleted[1:3]) == {
        manifest_key(ItemId(JOB, 100, 0, 0)),
        manifest_key(ItemId(JOB, 100, 1, 0)),
    }
    assert count == len(objects.deleted) == 6
    assert size > 6000
    assert [i.key for i in objects.list(f"{JOB}/100/")] == []
    assert len(list(objects.list(f"{JOB}/1000/"))) == 6  # step 1000 shares the digits only


def test_apply_prune_deletes_what_the_plan_says(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    for step, at in ((100, BASE), (200, BASE + DAY), (300, BASE + 2 * DAY)):
        upload_step(backup, tmp_path, step, commit_at=at)
    upload_step(backup, tmp_path, 400, commit_at=None)  # memory clock: written "long ago"
    listing = ops.scan_job(objects, JOB)
    policy = ops.RetentionPolicy(keep_last=2, min_age_seconds=60)
    decisions = ops.plan_prune(policy, ops.prune_facts(listing), now=BASE + 3 * DAY)
    assert [(d.step, d.action) for d in decisions] == [
        (400, ops.Action.DELETE),
        (300, ops.Action.KEEP),
        (200, ops.Action.KEEP),
        (100, ops.Action.DELETE),
    ]
    done = ops.apply_prune(objects, JOB, decisions, min_age_seconds=60, now=BASE + 3 * DAY)
    assert [(d.step, d.skipped) for d in done] == [(100, None), (400, None)]
    assert set(backup.committed_steps(JOB)) == {200, 300}
    assert [s.step for s in ops.scan_job(objects, JOB).steps] == [300, 200]


def test_apply_prune_rechecks_each_step(
    objects: MemoryObjectStore, backup: BackupStore, tmp_path: Path
) -> None:
    upload_step(backup, tmp_path, 100, commit_at=BASE)
    upload_step(backup, tmp_path, 200, commit_at=None)
    upload_step(backup, tmp_path, 300, commit_at=None)
    upload_step(backup, tmp_path, 400, commit_at=BASE + DAY)
    listing = ops.scan_job(objects, JOB)
    policy = ops.RetentionPolicy(keep_last=1, min_age_seconds=60)
    decisions = ops.plan_prune(policy, ops.prune_facts(listing), now=BASE + 3 * DAY)
    assert {d.step for d in decisions if d.action is ops.Action.DELETE} == {100, 200, 300}
    # Meanwhile: an operator pins 100, step 200 gets its COMMIT, step 300 a new object.
    ops.write_restore_pin(objects, ops.RestorePin(JOB, 100, 1.0, DIGEST))
    assert backup.try_commit(JOB, 200, ["0-0", "1-0"]) is not None
    newest = max(i.mtime for i in objects.list(""))
    objects.put_bytes(f"{JOB}/300/2-0/late", b"x")
    done = ops.apply_prune(objects, JOB, decisions, min_age_seconds=60, now=newest + 30)
    assert [(d.step, d.objects) for d in done] == [(100, 0), (200, 0), (300, 0)]
    assert all(d.skipped for d in done)
    assert set(backup.committed_steps(JOB)) == {100, 200, 400}


def test_a_hostile_commit_is_listed_as_invalid_not_a_crash(objects: MemoryObjectStore) -> None:
    body = {"job": JOB, "step": 1, "items": {}, "created": 10**400}
    objects.put_bytes(commit_key(JOB, 1), json.dumps(body).encode())
    (step,) = ops.scan_job(objects, JOB).steps
    assert step.state(now=0) is ops.StepState.INVALID
    assert step.commit_error is not None
    assert step.commit_error.startswith("COMMIT has a bad timestamp")


def test_a_v1_backup_lists_verifies_and_prunes(tmp_path: Path) -> None:
    """A step written before layout v2 (no ``<hh>/``, no ``layout`` in its COMMIT), beside
    a v2 step: ``mtc backups`` lists, verifies and prunes both."""
    objects = DeleteLog()
    backup = BackupStore(objects)
    old = upload_v1(backup, tmp_path, 50)
    upload_step(backup, tmp_path, 100)
    steps = {s.step: s for s in ops.scan_job(objects, JOB).steps}
    assert (steps[50].commit, steps[50].manifests) == (old, 2)
    assert steps[100].manifests == 2
    verdict = verify(objects, 50)
    assert verdict.ok
    assert verdict.unexpected == ()
    assert (verdict.items, verdict.objects_checked) == (2, 4)
    key = data_key(ItemId(JOB, 50, 1, 0), "", LAYOUT_V1)
    objects.put_bytes(key, b"x" + objects.get_bytes(key)[1:])
    assert [(p.kind, p.key) for p in verify(objects, 50).problems] == [
        (ops.ProblemKind.CHECKSUM_MISMATCH, key)
    ]
    ops.delete_step(objects, JOB, 50)
    assert objects.deleted[0] == commit_key(JOB, 50)
    assert set(objects.deleted[1:3]) == {
        manifest_key(ItemId(JOB, 50, r, 0), LAYOUT_V1) for r in (0, 1)
    }
    assert list(objects.list(f"{JOB}/50/")) == []
    assert set(backup.committed_steps(JOB)) == {100}


# --- a used pin, when its delete is refused ----------------------------------------------------


class NoDelete(MemoryObjectStore):
    """A bucket whose policy refuses every delete."""

    def delete(self, key: str) -> None:
        raise PermissionDenied(f"delete {key}: 403 AccessDenied")


def _pin_step(backup: BackupStore, tmp_path: Path, step: int, at: float) -> ops.RestorePin:
    raw = backup.read_commit_raw(JOB, step)
    assert raw is not None
    pin = ops.RestorePin(JOB, step, at, ops.commit_digest(raw[1]))
    ops.write_restore_pin(backup.objects, pin)
    return pin


def test_a_pin_whose_delete_is_refused_is_honoured_once(tmp_path: Path) -> None:
    """Before: the pin stayed and every round rolled the job back to it again."""
    objects = NoDelete()
    backup = BackupStore(objects)
    for step in (1, 2):
        upload_step(backup, tmp_path, step)
    failures: list[tuple[str, int, str]] = []
    pins = ops.StorePins(
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
    assert ops.read_restore_pin(objects, JOB) is not None, "the store kept it"
    assert pins.pinned_step(JOB) is None
    # After a daemon restart too: the record is on disk.
    again = ops.StorePins(objects, used=UsedPins(tmp_path / "store"))
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
    pins = ops.StorePins(objects, used=UsedPins(tmp_path), on_failure=lambda *f: failures.append(f))
    _pin_step(backup, tmp_path, 1, 1000.0)
    assert pins.pinned_step(JOB) == 1
    pins.consumed(JOB, 1)
    assert ops.read_restore_pin(objects, JOB) is None
    assert failures == []


def test_an_unreadable_record_of_used_pins_is_ignored(tmp_path: Path) -> None:
    used = UsedPins(tmp_path)
    used.record(JOB, "a" * 64)
    assert used.used(JOB, "a" * 64)
    (tmp_path / "used-pins" / f"{JOB}.json").write_text("{not json")
    assert not used.used(JOB, "a" * 64)
    used.record(JOB, "b" * 64)
    assert used.used(JOB, "b" * 64)
