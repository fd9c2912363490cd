"""``tools.prune_cli``: ``mtc backups prune`` over an in-memory store, its exit codes, its
JSON body and its text (the real CLI in a subprocess: ``tests/integration/test_backups_cli``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.core.attestation import Attested, ManifestTrust, Unattested
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.signed import OPEN
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.storage.restore_pins import pin_key
from mtc_replicator.tools import prune_cli

NOW = 1_700_000_000.0
DAY = 86400.0


@pytest.fixture
def objects(tmp_path: Path) -> MemoryObjectStore:
    """Job ``j`` with steps 100, 200, 300 committed two, one and a half days ago."""
    store = MemoryObjectStore()
    backups = BackupStore(store)
    for step, age in ((100, 2 * DAY), (200, DAY), (300, DAY / 2)):
        src = tmp_path / str(step)
        src.mkdir()
        (src / "weights").write_bytes(os.urandom(1024))
        manifest = build_manifest(ItemId("j", step, 0, 0), src)
        backups.upload_item(manifest, src)
        assert backups.try_commit("j", step, [manifest.item.key], now=NOW - age) is not None
    return store


def args(**kw: Any) -> argparse.Namespace:
    defaults: dict[str, Any] = {
        "job": "j", "all_jobs": False, "keep_last": 1, "keep_hourly": 0, "keep_daily": 0,
        "keep_weekly": 0, "min_age_minutes": 60.0, "verify_newest": False, "apply": False,
        "json": False, "trust": OPEN, "progress": False, "ca_label": None,
    }  # fmt: skip
    return argparse.Namespace(**(defaults | kw))


def test_a_dry_run_says_what_it_would_delete(
    objects: MemoryObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(i.key for i in objects.list(""))
    assert prune_cli.run(args(), objects, NOW) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing is deleted" in out
    assert "would delete 2 steps:" in out
    assert sorted(i.key for i in objects.list("")) == before


def test_apply_deletes_and_the_json_says_so(
    objects: MemoryObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prune_cli.run(args(apply=True, json=True), objects, NOW) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["apply"] is True
    assert body["policy"]["keep_last"] == 1
    assert {s["step"]: s["action"] for s in body["steps"]} == {
        300: "keep",
        200: "delete",
        100: "delete",
    }
    assert sorted(d["step"] for d in body["deleted"]) == [100, 200]
    assert body["skipped"] == []
    assert sorted(BackupStore(objects).committed_steps("j")) == [300]


def test_no_policy_is_bad_usage(
    objects: MemoryObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prune_cli.run(args(keep_last=0), objects, NOW) == 2
    assert "give a retention policy" in capsys.readouterr().err


def test_a_malformed_pin_stops_the_prune(
    objects: MemoryObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    objects.put_bytes(pin_key("j"), b"not json")
    assert prune_cli.run(args(apply=True), objects, NOW) == 1
    assert "before pruning" in capsys.readouterr().err
    assert sorted(BackupStore(objects).committed_steps("j")) == [100, 200, 300]


def test_a_job_with_nothing_stored_fails(
    objects: MemoryObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    assert prune_cli.run(args(job="other"), objects, NOW) == 1
    assert "no backups of job other" in capsys.readouterr().err


class _RefusesStep300(ManifestTrust):
    """Stands in for ``--tls-ca``: step 300's manifest lost its attestation (a bucket
    writer stripped it: it is outside the digest the COMMIT pins), so a restore refuses it."""

    def check(self, manifest: Manifest, owner: str, producers: Any = None) -> Attested:
        if manifest.item.step == 300:
            raise Unattested(f"{manifest.item}: its manifest is not signed by its producer")
        return Attested.VERIFIED


def test_verify_newest_checks_attestations_and_keeps_the_newest_restorable_step(
    objects: MemoryObjectStore,
) -> None:
    # ``--verify-newest`` under ``--tls-ca`` judges a step as a restore does, attestations
    # included: step 300 does not restore, so 200 is the newest verified, and kept.
    prune_cli.run(
        args(verify_newest=True, apply=True, json=True, attested=_RefusesStep300()), objects, NOW
    )
    assert 200 in BackupStore(objects).committed_steps("j")
