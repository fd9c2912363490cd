"""Prometheus metrics, scraped over HTTP from real daemons: the endpoint itself, one node's
ingest, backup and restores, and a cluster's replication and restore from a peer."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from mtc_replicator.obs.metrics import PrometheusMetrics, TransferKind
from mtc_replicator.obs.metrics_endpoint import MetricsError, serve, split_address
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster, assert_restored
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    FAILED,
    config_text,
    make_step,
    payload,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration

METRICS = ("--metrics", "127.0.0.1:0")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    """GET /metrics and parse it the way Prometheus does."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape_daemon(daemon: DaemonProcess) -> Samples:
    assert daemon.metrics is not None, "the daemon was started without --metrics"
    return scrape(daemon.metrics)


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def scrape_until(
    daemon: DaemonProcess, what: str, ok: Callable[[Samples], bool], timeout: float = 20.0
) -> Samples:
    """Scrape ``daemon`` until ``ok`` holds for a scrape; that scrape."""

    def attempt() -> Samples | None:
        got = scrape_daemon(daemon)
        return got if ok(got) else None

    result = wait_until(attempt, what, daemon=daemon, timeout=timeout, interval=0.1)
    assert result is not None
    return result


def size_of(files: dict[str, bytes]) -> int:
    return sum(len(data) for data in files.values())


# --- the endpoint, in this process -------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[PrometheusMetrics, str]]:
    metrics = PrometheusMetrics()
    server = serve(metrics.registry, "127.0.0.1:0")
    try:
        yield metrics, server.address
    finally:
        server.close()


def test_the_endpoint_serves_its_registry(served: tuple[PrometheusMetrics, str]) -> None:
    metrics, address = served
    host, port = split_address(address)
    assert (host, port > 0) == ("127.0.0.1", True)
    metrics.transfer(TransferKind.BACKUP_UPLOAD, 123, 0.5)
    metrics.committed("j", 9)
    got = scrape(address)
    assert sample(got, "mtc_transfer_bytes_total", kind="backup_upload") == 123
    assert sample(got, "mtc_newest_step", mtc_job="j", tier="committed") == 9


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            serve(CollectorRegistry(), f"127.0.0.1:{port}")


def test_close_releases_the_port() -> None:
    server = serve(CollectorRegistry(), "127.0.0.1:0")
    server.close()
    serve(CollectorRegistry(), server.address).close()


# --- one real daemon ---------------------------------------------------------------------------


def test_one_node_ingest_backup_and_restores_are_measured(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir, extra=METRICS)
    assert daemon.metrics is not None
    assert not daemon.metrics.endswith(":0"), "the ready line reports the bound port"
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    files = payload(7, seed=job, size=100_000)
    make_step(ckpt, 7, files)
    wait_ingested(ckpt, job, 7, daemon)

    got = scrape_until(
        daemon,
        "step 7 committed and backed up",
        lambda s: sample(s, "mtc_newest_step", mtc_job=job, tier="backup") == 7,
    )
    assert sample(got, "mtc_transfer_bytes_total", kind="ingest") == size_of(files)
    assert sample(got, "mtc_transfer_seconds_count", kind="ingest") == 1
    assert sample(got, "mtc_transfer_bytes_total", kind="backup_upload") == size_of(files)
    assert sample(got, "mtc_newest_step", mtc_job=job, tier="committed") == 7
    assert sample(got, "mtc_newest_restorable_step", mtc_job=job, tier="local") == 7
    assert sample(got, "mtc_newest_restorable_step", mtc_job=job, tier="backup") == 7
    for tier in ("local", "backup"):
        age = sample(got, "mtc_newest_restorable_age_seconds", mtc_job=job, tier=tier)
        assert age is not None
        assert 0 <= age < 60
    assert sample(got, "mtc_restore_rounds_total", mtc_job=job, outcome="fresh") == 1
    assert sample(got, "mtc_restore_rounds_total", mtc_job=job, outcome="restored") == 0
    assert sample(got, "mtc_errors_total", kind="ingest") == 0
    assert not [name for name, _ in got if name.endswith("_created")]
    # One node: nothing to replicate to, so no replicated tier is claimed.
    assert sample(got, "mtc_newest_step", mtc_job=job, tier="replicated") is None

    # The job restarts: step 7 is restored from the local tier, every byte re-read.
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 7, daemon)
    got = scrape_until(
        daemon,
        "the restore counted",
        lambda s: sample(s, "mtc_restore_rounds_total", mtc_job=job, outcome="restored") == 1,
    )
    assert sample(got, "mtc_transfer_bytes_total", kind="restore_local") == size_of(files)
    assert sample(got, "mtc_restore_seconds_count", outcome="restored") == 1

    # A handshake the daemon rejects counts as a config error.
    write_yaml_atomic(ckpt, config_text(job, nodes=0))
    wait_until((ckpt / FAILED).exists, f"{FAILED} written", daemon=daemon)
    scrape_until(
        daemon, "a config error", lambda s: sample(s, "mtc_errors_total", kind="config") == 1
    )

    # SIGTERM stops the endpoint with the daemon.
    assert daemon.stop() == 0
    with pytest.raises(urllib.error.URLError, match="refused"):
        scrape_daemon(daemon)


# --- a cluster of four ----------------------------------------------------------------------


@pytest.mark.parametrize("cluster_extra", [METRICS])
def test_cluster_replication_and_a_restore_from_a_peer_are_measured(cluster: Cluster) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    lost = 2
    holder = cluster.holder(lost, 5)
    for r in range(NODES):
        got = scrape_until(
            cluster.daemon(r),
            f"rank {r}'s step 5 replicated and restorable in the cluster",
            lambda s: (
                sample(s, "mtc_newest_step", mtc_job=cluster.job, tier="replicated") == 5
                and sample(s, "mtc_newest_restorable_step", mtc_job=cluster.job, tier="cluster")
                == 5
            ),
        )
        own = size_of(files[r])
        assert sample(got, "mtc_transfer_bytes_total", kind="replicate_out") == own
        assert sample(got, "mtc_restore_rounds_total", mtc_job=cluster.job, outcome="fresh") == 1
    received = scrape_daemon(cluster.daemon(holder))
    assert sample(received, "mtc_transfer_bytes_total", kind="replicate_in") == size_of(files[lost])

    # Node 2 loses its RAM disk; the job restarts and rank 2 pulls its step from the holder.
    cluster.wipe(lost)
    cluster.handshake([0, 2, 1, 3])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    got = scrape_until(
        cluster.daemon(lost),
        "rank 2's restore counted",
        lambda s: (
            sample(s, "mtc_restore_rounds_total", mtc_job=cluster.job, outcome="restored") == 1
        ),
    )
    assert sample(got, "mtc_transfer_bytes_total", kind="restore_peer") == size_of(files[lost])
    assert sample(got, "mtc_transfer_seconds_count", kind="restore_peer") == 1
    served = scrape_daemon(cluster.daemon(holder))
    assert sample(served, "mtc_transfer_bytes_total", kind="serve_pull") == size_of(files[lost])
    kept = scrape_daemon(cluster.daemon(0))
    assert sample(kept, "mtc_transfer_bytes_total", kind="restore_local") == size_of(files[0])
