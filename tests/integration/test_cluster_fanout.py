"""Fan-out restore from the bucket: four real daemons, four data-parallel replicas, S3.

Every RAM disk is lost; the committed backup holds replica 0's item only. The plan has
one rank download it and the other three pull it from that rank over the peer plane
(``core.restore_plan._fan_out``), so the bucket serves each object once, not four times.
moto's S3 server sits behind ``FaultProxy``, which records every request the daemons make.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import NODES, Cluster, assert_restored, running
from tests.integration.helpers import make_step, payload
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Request,
    corrupt_reply,
    fault_proxy,
    s3_env,
)

pytestmark = pytest.mark.integration

STEP = 5


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[FaultProxy]:
    with fault_proxy(s3_bucket.endpoint) as p:
        yield p


@pytest.fixture
def replicas(tmp_path: Path, job: str, s3_bucket: Bucket, proxy: FaultProxy) -> Iterator[Cluster]:
    """4 nodes, ``assume-data-parallelism: 4`` (a rank per replica), backups via ``proxy``."""
    c = Cluster(tmp_path, job)
    c.backup_url = s3_bucket.url
    c.env = s3_env(proxy.url)
    c.keys = {"assume_data_parallelism": NODES, "backup_interval_steps": 1, "peers_per_node": 1}
    with running(c):
        yield c


def save_replicated(cluster: Cluster, step: int) -> dict[int, dict[str, bytes]]:
    """Every replica saves the same bytes (data parallelism); wait for its backup."""
    files = payload(step, seed="model", size=64 << 10)
    for r in range(NODES):
        make_step(cluster.dirs[r], step, files)
    cluster.wait_saved(step, copies=False)
    cluster.wait_backup(step)
    return dict.fromkeys(range(NODES), files)


def item_of(req: Request, job: str) -> str | None:
    """The ``<rank>-<worker>`` of an item data object a GET read, else None."""
    path = req.path.split("?", 1)[0]
    if req.method != "GET" or job not in path or "?" in req.path:
        return None
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part.count("-") == 1 and all(x.isdigit() for x in part.split("-")):
            return part if i + 1 < len(parts) else None
    return None


def data_gets(proxy: FaultProxy, job: str) -> Counter[str]:
    """Object key -> how many GETs read it, for item data objects only."""
    return Counter(
        r.path for r in proxy.requests("GET") if item_of(r, job) is not None and r.status < 300
    )


def test_four_replicas_download_each_object_once(replicas: Cluster, proxy: FaultProxy) -> None:
    cluster = replicas
    cluster.fresh_start()
    files = save_replicated(cluster, STEP)
    cluster.wipe_all()
    with proxy.lock:
        proxy.seen.clear()
    cluster.handshake([2, 3, 0, 1])
    cluster.wait_markers(STEP)
    assert_restored(cluster, STEP, files)  # verified bytes, the same step everywhere
    assert [cluster.source(r) for r in range(NODES)] == ["backup"] * NODES
    gets = data_gets(proxy, cluster.job)
    assert gets, "no data object was read from the bucket"
    # One GET per data object of the one unique item (rank 0's), not one per replica.
    assert set(gets.values()) == {1}, gets
    assert {item_of(r, cluster.job) for r in proxy.requests("GET")} - {None} == {"0-0"}
    # Ranks 1-3 pulled it from rank 0, which downloaded it and served it three times.
    for r in range(1, NODES):
        assert "ready from peer 0" in cluster.daemon(r).log(), f"rank {r} did not pull from 0"
    assert "ready from backup" in cluster.daemon(0).log()
    assert cluster.daemon(0).log().count(f"sent {cluster.job}/s{STEP}/n0-w0 to") == NODES - 1


def test_a_failed_download_sends_the_pullers_to_the_backup(
    replicas: Cluster, proxy: FaultProxy
) -> None:
    cluster = replicas
    cluster.fresh_start()
    files = save_replicated(cluster, STEP)
    cluster.wipe_all()
    big = "state/array_0.bin"
    # The downloader's first read of the big object comes back with one byte flipped.
    proxy.reply_rules.append(
        corrupt_reply(times=1, match=lambda r: item_of(r, cluster.job) == "0-0" and big in r.path)
    )
    with proxy.lock:
        proxy.seen.clear()
    cluster.handshake([2, 3, 0, 1])
    # Within wait_markers' 60 s: had rank 0 not said it gave up, the pullers would have
    # waited for it up to PENDING_WAIT_SECONDS (cluster.sources).
    cluster.wait_markers(STEP)
    assert_restored(cluster, STEP, files)  # nobody exposed the corrupt bytes
    assert "corrupt" in cluster.errors(0)
    # The pullers went to the backup themselves as soon as rank 0 gave up, not after a
    # timeout; rank 0 then took a puller's verified copy.
    for r in range(1, NODES):
        assert "ready from backup" in cluster.daemon(r).log(), f"rank {r}"
        # The pending pull is reported unavailable (the holder gave up), never corrupt.
        assert "cannot use the peer copy" in cluster.daemon(r).log(), f"rank {r}"
        assert "could not obtain it" in cluster.daemon(r).log(), f"rank {r}"
        assert "corrupt" not in cluster.errors(r), f"rank {r}"
    assert "ready from peer" in cluster.daemon(0).log()
    gets = data_gets(proxy, cluster.job)
    assert gets[next(k for k in gets if big in k)] == NODES  # 1 corrupt + 3 fallbacks
