"""The restore timeline (``core.timeline``), from real daemons: the INFO line of every
phase's seconds, the DEBUG span per phase and item, and ``mtc_restore_phase_seconds`` on
``/metrics``: a cluster whose node lost its RAM disk and pulls from a peer, and one node
that lost its RAM disk and downloads from the backup."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mtc_replicator.core.timeline import RestorePhase
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import Cluster, assert_restored
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_tree,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_metrics import METRICS, sample, scrape_until

pytestmark = pytest.mark.integration

_SUMMARY = re.compile(
    r"INFO \S+: restore timeline: (total=.*?) job=(\S+) rank=(\d+)(?: step=(\d+))?$", re.M
)
_SPAN = re.compile(
    r"DEBUG \S+: restore timeline: \+(\S+)s (\S+)s (\w+)(?: (.*?))? job=\S+ rank=\d+"
    r"(?: step=(\d+))?$",
    re.M,
)


def summaries(log: str, step: int | None) -> list[dict[str, float]]:
    """The INFO lines of the restores of ``step`` (None: fresh starts), as {phase or
    'total': seconds}."""
    found = []
    for m in _SUMMARY.finditer(log):
        if (None if m.group(4) is None else int(m.group(4))) == step:
            found.append({k: float(v) for k, v in (kv.split("=") for kv in m.group(1).split())})
    return found


def summary_of(daemon: DaemonProcess, step: int | None) -> dict[str, float]:
    """The one INFO line of ``step``'s restore, once the round's last line is logged: the
    daemon logs the timeline after it writes the markers, so a test that saw the markers
    can read the log before the lines (and its DEBUG spans) are there."""
    wait_until(
        lambda: f"restore round done: step={step} " in daemon.log(),
        f"the restore round of step {step} logged",
        daemon=daemon,
    )
    (found,) = summaries(daemon.log(), step)
    return found


def spans(log: str, step: int | None) -> list[tuple[float, float, str, str]]:
    """The DEBUG spans of the restores of ``step``: (start, seconds, phase, detail)."""
    return [
        (float(m.group(1)), float(m.group(2)), m.group(3), m.group(4) or "")
        for m in _SPAN.finditer(log)
        if (None if m.group(5) is None else int(m.group(5))) == step
    ]


@pytest.mark.parametrize("cluster_extra", [(*METRICS, "--log-level", "debug")])
def test_a_peer_restore_logs_and_exports_its_timeline(cluster: Cluster) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    lost = 2
    holder = cluster.holder(lost, 5)
    cluster.wipe(lost)
    cluster.handshake([0, 2, 1, 3])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)

    # Rank 2: one INFO line naming every phase; the time went to settling, the round, the
    # pull from its holder and the markers; the phases add up to the total.
    summary = summary_of(cluster.daemon(lost), 5)
    log = cluster.daemon(lost).log()
    assert list(summary) == ["total", *(p.value for p in RestorePhase)]
    assert summary["peer"] > 0
    assert (summary["local"], summary["backup"]) == (0, 0)
    phases = sum(v for k, v in summary.items() if k != "total")
    assert phases == pytest.approx(summary["total"], abs=0.01)
    # At DEBUG every span, in order from the handshake, the pull naming item and holder.
    restored = spans(log, 5)
    pulls = [s for s in restored if s[2] == "peer"]
    assert pulls
    assert all(f"from rank {holder}" in s[3] for s in pulls)
    assert any(f"s5/n{lost}-w0" in s[3] for s in pulls)
    order = [s[2] for s in restored]
    assert order[:3] == ["settle", "ingest", "join"]
    assert order.index("join") < order.index("peer")
    assert order[-1] == "markers"
    assert [s[0] for s in restored] == sorted(s[0] for s in restored)

    # A surviving rank verified its own copy: the local phase, no pull.
    kept = summary_of(cluster.daemon(0), 5)
    assert kept["peer"] == 0
    verified = [s[3] for s in spans(cluster.daemon(0).log(), 5) if s[2] == "local"]
    assert verified == [f"{cluster.job}/s5/n0-w0"]

    # /metrics: the wiped node's daemon restarted: its one restore pulled; nothing was
    # verified or downloaded there, and every phase is exported.
    got = scrape_until(
        cluster.daemon(lost),
        "rank 2's restore phases exported",
        lambda s: sample(s, "mtc_restore_phase_seconds_count", phase="peer") == 1,
    )
    assert sample(got, "mtc_restore_phase_seconds_count", phase="join") == 1
    assert sample(got, "mtc_restore_phase_seconds_count", phase="markers") == 1
    assert sample(got, "mtc_restore_phase_seconds_count", phase="backup") == 0
    assert sample(got, "mtc_restore_phase_seconds_count", phase="local") == 0
    assert sample(got, "mtc_restore_phase_seconds_sum", phase="peer") == pytest.approx(
        summary["peer"], abs=0.002
    )
    survivor = scrape_until(
        cluster.daemon(0),
        "rank 0's local verification exported",
        lambda s: sample(s, "mtc_restore_phase_seconds_count", phase="local") == 1,
    )
    # Rank 0's daemon ran both restores (the fresh start and this one).
    assert sample(survivor, "mtc_restore_phase_seconds_count", phase="join") == 2
    assert sample(survivor, "mtc_restore_phase_seconds_count", phase="peer") == 0


def test_a_backup_restore_logs_and_exports_the_download(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir, extra=(*METRICS, "--log-level", "debug"))
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    files = payload(7, seed=job, size=300_000)
    make_step(ckpt, 7, files)
    wait_ingested(ckpt, job, 7, daemon)
    scrape_until(
        daemon,
        "step 7 backed up",
        lambda s: sample(s, "mtc_newest_step", mtc_job=job, tier="backup") == 7,
    )
    fresh = summary_of(daemon, None)  # the first incarnation's: nothing to fetch
    assert (fresh["local"], fresh["peer"], fresh["backup"]) == (0, 0, 0)

    # The node loses its RAM disk and its daemon; the job restarts on a new daemon.
    daemon.stop()
    for entry in ckpt.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.rmtree(store_root(ckpt))
    daemon = start_daemon(backup=backup_dir, extra=(*METRICS, "--log-level", "debug"))
    write_yaml_atomic(ckpt, yaml_text)
    marker = wait_markers(ckpt, job, 7, daemon)
    assert read_tree(marker[0]) == files

    summary = summary_of(daemon, 7)
    assert summary["backup"] > 0
    assert (summary["local"], summary["peer"]) == (0, 0)
    downloads = [s for s in spans(daemon.log(), 7) if s[2] == "backup"]
    assert [d[3] for d in downloads] == [f"{job}/s7/n0-w0"]
    got = scrape_until(
        daemon,
        "the download's phase exported",
        lambda s: sample(s, "mtc_restore_phase_seconds_count", phase="backup") == 1,
    )
    assert sample(got, "mtc_restore_phase_seconds_count", phase="settle") == 1
    assert sample(got, "mtc_restore_phase_seconds_count", phase="local") == 0
