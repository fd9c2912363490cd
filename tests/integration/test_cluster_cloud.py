"""Four real daemons backing up to real S3 (moto's server) and GCS (the emulator) servers.

The daemons get only the SDKs' standard environment (``AWS_ENDPOINT_URL_S3`` and
credentials, or ``STORAGE_EMULATOR_HOST``) and a ``s3://`` or ``gs://`` URL, which also
serves as the coordinator registry.

The GCS emulator ignores ``ifGenerationMatch=0``, so two ranks finishing their uploads at
once could both write a step's COMMIT, and it once served one writer's bytes with the other's
crc32c. Real GCS refuses the second writer; here ``gcs_create_only`` does, in a proxy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import manifest_key
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.storage.stores import open_object_store
from tests.integration.cluster import NODES, Cluster, assert_restored, running
from tests.storage_servers import Bucket, fault_proxy, gcs_create_only, gcs_env

pytestmark = pytest.mark.integration


@pytest.fixture(params=["s3", "gcs"])
def cloud(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    bucket: Bucket = request.getfixturevalue(f"{request.param}_bucket")
    if request.param != "gcs":
        yield bucket
        return
    with fault_proxy(bucket.endpoint, [gcs_create_only]) as proxy:
        env = gcs_env(proxy.url)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield Bucket(bucket.url, bucket.name, proxy.url, env)


@pytest.fixture
def cloud_cluster(tmp_path: Path, job: str, cloud: Bucket) -> Iterator[Cluster]:
    c = Cluster(tmp_path, job)
    c.backup_url = cloud.url
    c.env = dict(cloud.env)
    with running(c):
        yield c


def test_every_node_wiped_restores_from_the_bucket(cloud_cluster: Cluster) -> None:
    cluster = cloud_cluster
    cluster.keys["backup_interval_steps"] = 1
    cluster.fresh_start()
    cluster.save(3)
    files = cluster.save(5)
    cluster.wait_backup(5)
    cluster.wipe_all()
    cluster.handshake([2, 3, 0, 1])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    assert [cluster.source(r) for r in range(NODES)] == ["backup"] * NODES


def test_an_upload_killed_midway_is_never_restorable_and_is_completed_later(
    cloud_cluster: Cluster,
) -> None:
    cluster = cloud_cluster
    cluster.keys["backup_interval_steps"] = 1
    cluster.fresh_start()
    big = 1  # its upload lasts long enough to be cut off
    files = cluster.write_step(3, sizes={big: 128 << 20})
    cluster.wait_saved(3)
    objects = open_object_store(cluster.backup_url)
    prefix = f"{cluster.job}/3/"
    daemon = cluster.daemon(big)
    deadline = time.monotonic() + 30
    while "backup of step 3 ordered" not in daemon.log():
        assert time.monotonic() < deadline, "no backup order reached the big item's rank"
        time.sleep(0.005)
    daemon.kill()
    uploaded = {o.key for o in objects.list(prefix)}
    assert manifest_key(ItemId(cluster.job, 3, big, 0)) not in uploaded, (
        "the upload was not cut off"
    )
    time.sleep(1.0)
    assert 3 not in cluster.committed_backups(), "a step missing an item was committed"
    # The node comes back; the coordinator's standing order makes it upload again.
    cluster.start(big)
    cluster.wait_backup(3)
    cluster.wipe_all()
    cluster.handshake([0, 1, 2, 3])
    cluster.wait_markers(3)
    assert_restored(cluster, 3, files)
