"""``prune --verify-newest`` under ``--tls-ca`` must judge a step as a restore does,
attestations included, or it keeps a step no daemon restores and deletes the one it would."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from mtc_replicator.core.attestation import Attested, ManifestTrust, Unattested
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.signed import OPEN
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.tools import prune_cli

NOW = 1_700_000_000.0
DAY = 86400.0


class _RefusesStep300(ManifestTrust):
    """Stands in for ``--tls-ca``: step 300's manifest lost its attestation (a bucket
    writer stripped it: it is outside the digest the COMMIT pins), so a restore refuses it."""

    def check(self, manifest: Manifest, owner: str, producers: Any = None) -> Attested:
        if manifest.item.step == 300:
            raise Unattested(f"{manifest.item}: its manifest is not signed by its producer")
        return Attested.VERIFIED


def test_verify_newest_checks_attestations_and_keeps_the_newest_restorable_step(
    tmp_path: Path,
) -> None:
    store = MemoryObjectStore()
    backups = BackupStore(store)
    for step, age in ((100, 2 * DAY), (200, DAY), (300, DAY / 2)):
        src = tmp_path / str(step)
        src.mkdir()
        (src / "weights").write_bytes(os.urandom(1024))
        manifest = build_manifest(ItemId("j", step, 0, 0), src)
        backups.upload_item(manifest, src)
        assert backups.try_commit("j", step, [manifest.item.key], now=NOW - age) is not None
    args = argparse.Namespace(
        job="j", all_jobs=False, keep_last=1, keep_hourly=0, keep_daily=0, keep_weekly=0,
        min_age_minutes=60.0, verify_newest=True, apply=True, json=True, trust=OPEN,
        attested=_RefusesStep300(), progress=False, ca_label=None,
    )  # fmt: skip
    prune_cli.run(args, store, NOW)
    # Step 300 does not restore (unattested): 200 is the newest a restore takes; keep it.
    assert 200 in BackupStore(store).committed_steps("j")
