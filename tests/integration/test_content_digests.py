"""Content digests against real daemons: a bucket writer without any key swaps a file of the
newest committed step for other bytes of the same size and crc32c (``tests/forge.py``).

The daemon runs with mutual TLS and signed COMMITs, on a ``file://`` bucket and on S3
(moto's server, ``tests/storage_servers.py``). The attacker is this test process with write
access to the bucket and nothing else: the COMMIT and the manifest stay genuine, only one
data object changes, and every check but the BLAKE3 digest of the manifest passes (size,
crc32c, the object store's own crc32c). Once the RAM disk is lost the forged copy must be
refused, said in ``replicator.errors``, and the job restores the step before it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import data_key, manifest_key
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.storage.objectstore import FileObjectStore, ObjectStore
from mtc_replicator.storage.s3 import S3ObjectStore
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.forge import same_crc32c
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAST_ARGS,
    config_text,
    item_dir,
    make_step,
    marker_names,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.storage_servers import Bucket
from tests.tls import node_tls

pytestmark = pytest.mark.integration


@pytest.fixture(params=["file", "s3"])
def bucket(request: pytest.FixtureRequest, backup_dir: Path) -> tuple[str, ObjectStore]:
    """The daemon's backup URL and the attacker's handle on the same bucket."""
    if request.param == "file":
        return backup_dir.as_uri(), FileObjectStore(backup_dir)
    s3: Bucket = request.getfixturevalue("s3_bucket")
    return s3.url, S3ObjectStore.from_url(s3.url)


@pytest.fixture
def daemons(ckpt: Path) -> Iterator[list[DaemonProcess]]:
    started: list[DaemonProcess] = []
    yield started
    for daemon in started:
        if daemon.running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.stop(timeout=10)
    if started:
        print(f"--- daemon log ---\n{started[-1].log()[-20000:]}")


def commits(objects: ObjectStore, job: str) -> set[int]:
    return {int(o.key.split("/")[1]) for o in objects.list(f"{job}/") if o.key.endswith("/COMMIT")}


def forge_a_file(objects: ObjectStore, item: ItemId) -> tuple[str, bytes]:
    """Replace the item's largest file in the bucket with same-size, same-crc32c bytes;
    its path and the forged bytes. Nothing else in the bucket changes."""
    manifest = Manifest.from_json(objects.get_bytes(manifest_key(item)))
    entry = max(manifest.files, key=lambda f: f.size)
    key = data_key(item, entry.path)
    original = objects.get_bytes(key)
    forged = same_crc32c(original)
    objects.put_bytes(key, forged)
    assert objects.get_bytes(key) == forged, "the bucket took the forged object"
    return entry.path, forged


def test_a_same_crc_forgery_in_the_bucket_is_refused_and_the_step_before_restored(
    ckpt: Path,
    job: str,
    tmp_path: Path,
    bucket: tuple[str, ObjectStore],
    daemons: list[DaemonProcess],
) -> None:
    url, objects = bucket
    tls = node_tls(tmp_path / "tls", certs.new_ca()).args()

    def start() -> DaemonProcess:
        daemon = DaemonProcess(ckpt, backup=url, extra_args=(*FAST_ARGS, *tls))
        daemons.append(daemon)
        return daemon.start()

    daemon = start()
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    for step in (1, 2):
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
        wait_until(lambda s=step: s in commits(objects, job), f"COMMIT {step}", daemon=daemon)
    assert daemon.stop() == 0

    path, forged = forge_a_file(objects, ItemId(job, 2, 0, 0))
    shutil.rmtree(store_root(ckpt))  # the node lost its RAM disk: only the backup is left

    daemon = start()
    write_yaml_atomic(ckpt, yaml_text)
    # Any step's markers (the earlier run's went when the yaml was taken): the old code's,
    # of step 2, fail the test at once, not at a timeout.
    wait_until(lambda: not (ckpt / CONFIG).exists(), "replicator.yaml taken", daemon=daemon)
    wait_until(lambda: bool(marker_names(ckpt)), "the restore's markers", daemon=daemon)
    assert read_prerestore(ckpt) == {"restore-step": 1, "restore-source": "backup"}, (
        "the step with a forged file was restored"
    )
    (marker,) = wait_markers(ckpt, job, 1, daemon)
    assert read_tree(marker) == payload(1, seed=job)
    errors = read_text(ckpt / ERRORS)
    assert "backup copy of" in errors, errors
    assert "content digest" in errors, errors
    assert path in errors
    held = item_dir(ckpt, job, 2)
    assert not held.exists() or forged not in {
        p.read_bytes() for p in held.rglob("*") if p.is_file()
    }
