"""A throttled backup in progress is finished, never restarted, while newer steps arrive.

Four real daemons back up to moto's S3 server through a proxy that records every request,
at ``--max-transfer-rate 1MiB``: the backup of step 3 takes several seconds. Steps 4 and 5
are saved meanwhile and replicated to their peers (replication goes first; the backup goes
on, at a trickle while a replication is in flight), retention would drop step 3 but keeps
it while it is being uploaded, and then step 3's backup commits with each of its objects
written exactly once, and the next backup names a newer step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from mtc_replicator.storage.probe import PROBE_KEY
from tests.integration.cluster import NODES, Cluster, running
from tests.integration.helpers import wait_until
from tests.storage_servers import Bucket, FaultProxy, fault_proxy

pytestmark = pytest.mark.integration

RATE = "1MiB"
ITEM = 6 << 20
"""A rank's big array (its item is about 8 MiB): some 7 s of upload at ``RATE``."""


@pytest.fixture
def recorded(s3_bucket: Bucket) -> Iterator[FaultProxy]:
    with fault_proxy(s3_bucket.endpoint) as proxy:
        yield proxy


@pytest.fixture
def s3_cluster(
    tmp_path: Path, job: str, s3_bucket: Bucket, recorded: FaultProxy
) -> Iterator[Cluster]:
    c = Cluster(tmp_path, job, ("--max-transfer-rate", RATE))
    c.backup_url = s3_bucket.url
    c.env = {**s3_bucket.env, "AWS_ENDPOINT_URL_S3": recorded.url}
    c.keys["backup_interval_steps"] = 1
    with running(c):
        yield c


def writes(proxy: FaultProxy, bucket: Bucket, job: str, step: int) -> Counter[str]:
    """Object writes (PUTs, a multipart upload's parts each) below ``step``, by key."""
    prefix = f"/{bucket.name}/backups/{job}/{step}/"
    found: Counter[str] = Counter()
    for req in proxy.requests("PUT"):
        parts = urlsplit(req.path)
        if parts.path.startswith(prefix):
            part = req.query.get("partNumber", [""])[0]
            found[parts.path.removeprefix(prefix) + (f"#{part}" if part else "")] += 1
    return found


def test_a_throttled_backup_is_finished_not_restarted_while_newer_steps_replicate(
    s3_cluster: Cluster, s3_bucket: Bucket, recorded: FaultProxy
) -> None:
    cluster = s3_cluster
    big = dict.fromkeys(range(NODES), ITEM)
    cluster.fresh_start()
    cluster.write_step(3, sizes=big)
    cluster.wait_saved(3)
    wait_until(
        lambda: any(k.endswith(".bin") for k in writes(recorded, s3_bucket, cluster.job, 3)),
        "the upload of step 3's data",
        daemon=cluster.daemon(0),
        timeout=30,
    )

    # The job goes on while the backup is in flight: its newest steps are replicated.
    cluster.write_step(4, sizes=big)
    cluster.write_step(5, sizes=big)
    cluster.wait_saved(5)
    assert 3 not in cluster.committed_backups(), "the backup was over before step 5 was safe"

    cluster.wait_backup(3)
    newer = wait_until(
        lambda: {s for s in cluster.committed_backups() if s > 3},
        "a backup of a newer step",
        daemon=cluster.daemon(0),
        timeout=60,
    )
    assert newer <= {4, 5}

    written = writes(recorded, s3_bucket, cluster.job, 3)
    data = {k: n for k, n in written.items() if not k.endswith((".manifest.json", "COMMIT"))}
    assert len(data) == 5 * NODES, sorted(written)  # the five files of every rank's item
    # Never restarted: a restart writes every object of an item again. A single request the
    # SDK sent twice (a read timed out on a loaded box, and botocore retried the PUT) is not
    # a restart: at most a couple of those, never a whole item's worth.
    by_item: dict[str, list[int]] = {}
    for key, n in data.items():
        by_item.setdefault("/".join(key.split("/")[:2]), []).append(n)  # <hh>/<rank>-<worker>
    assert all(min(counts) == 1 for counts in by_item.values()), f"step 3 written again: {data}"
    assert sum(data.values()) <= len(data) + 2, f"objects of step 3 written again: {data}"
    manifests = [k for k in written if k.endswith(".manifest.json")]
    assert len(manifests) == NODES
    assert all(written[k] == 1 for k in manifests), written
    # No retries, so once really is once. Not the start-up probes: each daemon's
    # create-only write of _mtc-probe/writable, which all but the first find there (412).
    statuses = Counter(r.status for r in recorded.requests("PUT") if PROBE_KEY not in r.path)
    assert set(statuses) == {200}, statuses
