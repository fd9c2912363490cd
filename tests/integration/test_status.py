"""``mtc status`` against four real daemons with mutual TLS: held steps, progress, peers and
their reachability (a killed peer shows unreachable within a bound, in the metric too), and
the errors an operator meets (no certificate, a stranger's, nobody listening)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.node.status import PROBE_EVERY
from mtc_replicator.tools import certs
from mtc_replicator.transport.peer_client import PROBE_SECONDS
from tests.integration.cluster import NODES, Cluster
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    backup_commits,
    config_text,
    make_step,
    payload,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_metrics import sample, scrape_daemon
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration

KILLED_SEEN_WITHIN = PROBE_EVERY + PROBE_SECONDS + 20.0
"""A probe round, its timeout, and slack for a busy test machine."""


def mtc_status(
    address: str, *args: str, tls: NodeTls | None = None
) -> subprocess.CompletedProcess[str]:
    files = tls.files if tls is not None else None
    flags = (
        ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))
        if files is not None
        else ()
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTC_")}
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", "status", "--address", address,
         *flags, *args],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip


def status_of(cluster: Cluster, rank: int) -> dict[str, Any]:
    out = mtc_status(cluster.daemon(rank).address, "--json", tls=cluster.tls[rank])
    assert out.returncode == 0, out.stdout + out.stderr
    body: dict[str, Any] = json.loads(out.stdout)
    return body


def job_of(cluster: Cluster, rank: int) -> dict[str, Any]:
    jobs = [j for j in status_of(cluster, rank)["jobs"] if j["job"] == cluster.job]
    assert len(jobs) == 1
    return jobs[0]


def peers_of(cluster: Cluster, rank: int) -> dict[int, dict[str, Any]]:
    return {p["rank"]: p for p in job_of(cluster, rank)["peers"]}


@pytest.mark.parametrize("cluster_extra", [("--metrics", "127.0.0.1:0")])
def test_status_shows_steps_progress_and_peers(cluster: Cluster) -> None:
    """Peers are the ranks this one replicates to (their addresses come from the
    coordinator): two each here, so one can die while another stays."""
    cluster.keys["peers_per_node"] = 2
    cluster.fresh_start()
    cluster.save(100)
    cluster.wait_backup(100)
    me = 1
    wait_until(
        lambda: all(p["reachable"] for p in peers_of(cluster, me).values()),
        "rank 1 reached every peer",
        daemon=cluster.daemon(me),
        timeout=KILLED_SEEN_WITHIN,
    )
    wait_until(
        lambda: job_of(cluster, me)["last_replicated"] == 100,
        "rank 1 reports step 100 replicated",
        daemon=cluster.daemon(me),
    )
    job = job_of(cluster, me)
    assert job["active"] is True
    assert (job["rank"], job["nodes"], job["phase"]) == (me, NODES, "steady")
    # A tag of the incarnation, never its id: the coordinator takes the id as the rank's
    # proof in its reports, and any node certificate may call Status.
    log_text = cluster.daemon(me).log()
    ids = re.findall(r"accepted replicator.yaml: .* incarnation=([0-9a-f]+)", log_text)
    assert ids
    assert job["incarnation"] == hashlib.sha256(ids[-1].encode()).hexdigest()[:12]
    assert ids[-1] not in json.dumps(status_of(cluster, me))
    assert job["coordinator"] == cluster.daemon(0).advertise
    assert 100 in job["local_steps"]
    held_here = {(c["rank"], s) for c in job["peer_copies"] for s in c["steps"]}
    on_disk = {(int(key.split("-")[0]), step) for step, key in cluster.held(me)}
    assert held_here == {(r, s) for r, s in on_disk if r != me}
    assert held_here  # some other rank's copy lives here
    peers = peers_of(cluster, me)
    assert len(peers) == 2
    assert me not in peers
    for r, p in peers.items():
        assert p["address"] == cluster.daemon(r).advertise
        assert p["reachable"] is True
        assert p["last_answer_at"] is not None
        assert p["error"] is None
    # Some rank uploads step 100 and says so.
    wait_until(
        lambda: any(job_of(cluster, r)["last_backed_up"] == 100 for r in range(NODES)),
        "a rank reports step 100 backed up",
        daemon=cluster.daemon(0),
    )

    table = mtc_status(cluster.daemon(me).address, tls=cluster.tls[me])
    assert table.returncode == 0, table.stderr
    assert f"job {cluster.job}: rank {me}/{NODES}, steady" in table.stdout
    for r in peers:
        assert cluster.daemon(r).advertise in table.stdout
    assert "NO" not in table.stdout

    # A peer dies: its neighbours see it within a probe round, in status and the metric.
    dead = min(peers)
    dead_address = cluster.daemon(dead).advertise
    cluster.daemon(dead).kill()
    wait_until(
        lambda: peers_of(cluster, me)[dead]["reachable"] is False,
        "rank 1 sees its dead peer unreachable",
        daemon=cluster.daemon(me),
        timeout=KILLED_SEEN_WITHIN,
    )
    gone = peers_of(cluster, me)[dead]
    assert "UNAVAILABLE" in gone["error"] or "DEADLINE" in gone["error"], gone
    assert gone["last_answer_at"] is not None  # it did answer before
    assert all(p["reachable"] for r, p in peers_of(cluster, me).items() if r != dead)
    samples = scrape_daemon(cluster.daemon(me))
    assert sample(samples, "mtc_peer_reachable", peer=dead_address) == 0.0
    alive = cluster.daemon(max(peers)).advertise
    assert sample(samples, "mtc_peer_reachable", peer=alive) == 1.0
    assert (sample(samples, "mtc_peer_last_contact_timestamp_seconds", peer=alive) or 0) > 0
    table = mtc_status(cluster.daemon(me).address, tls=cluster.tls[me])
    assert "NO" in table.stdout
    assert "Traceback" not in table.stderr


def test_status_errors(cluster: Cluster) -> None:
    cluster.fresh_start()
    address = cluster.daemon(0).address

    # With TLS on, a caller without a certificate, or with one from another CA, is refused.
    plain = mtc_status(address, "--timeout", "5")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert "mtc status: error:" in plain.stderr
    assert "--tls-cert" in plain.stderr
    assert plain.stdout == ""
    stranger = node_tls(cluster.root / "stranger", certs.new_ca("stranger CA"))
    refused = mtc_status(address, "--timeout", "5", tls=stranger)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "mtc status: error:" in refused.stderr
    assert refused.stdout == ""

    # Nobody listening.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{s.getsockname()[1]}"
    nobody = mtc_status(free, "--timeout", "5", tls=cluster.tls[0])
    assert nobody.returncode == 1
    assert f"cannot reach the daemon at {free}" in nobody.stderr
    assert "Traceback" not in nobody.stderr

    # A job the node does not have; a bad address is a usage error.
    nope = mtc_status(address, "--job", "nope", tls=cluster.tls[0])
    assert nope.returncode == 1
    assert "job nope is not on the node" in nope.stderr
    bad = mtc_status("no-port", tls=cluster.tls[0])
    assert bad.returncode == 2
    assert "argument --address: must be HOST:PORT" in bad.stderr
    ok = mtc_status(address, "--job", cluster.job, "--json", tls=cluster.tls[0])
    assert ok.returncode == 0, ok.stderr
    assert [j["job"] for j in json.loads(ok.stdout)["jobs"]] == [cluster.job]


def test_a_restarted_daemon_shows_the_backups_newest_step(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    """Before: after a restart ``mtc status`` said ``last backed up -`` (``null``) while
    ``mtc_newest_step{tier="backup"}`` said 3 and the bucket held it: the status read this
    rank's own upload, which a restarted daemon has not made."""
    metrics = ("--metrics", "127.0.0.1:0")
    daemon = start_daemon(backup=backup_dir, extra=metrics)
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 3, payload(3, seed=job))
    wait_ingested(ckpt, job, 3, daemon)
    wait_until(lambda: 3 in backup_commits(backup_dir, job), "step 3 committed", daemon=daemon)
    assert daemon.stop() == 0

    again = start_daemon(backup=backup_dir, extra=metrics)
    labels = {"mtc_job": job, "tier": "backup"}
    wait_until(
        lambda: sample(scrape_daemon(again), "mtc_newest_step", **labels) == 3.0,
        "the metric says step 3 is in the backup",
        daemon=again,
    )

    def backed_up() -> object:
        out = mtc_status(again.address, "--json", "--job", job)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)["jobs"][0]["last_backed_up"]

    assert backed_up() == 3
    table = mtc_status(again.address, "--job", job)
    assert "last backed up 3" in table.stdout, table.stdout


def test_a_tls_failure_is_one_clear_line(
    ckpt: Path, tmp_path: Path, start_daemon: StartDaemon
) -> None:
    """Before: gRPC's core wrote its own raw line on stderr ("I1128 ...
    ssl_transport_security.cc:2563] Handshake failed with error SSL_ERROR_SSL ...") above
    ours, and a certificate the daemon refused read "Socket closed; is mtc-replicator
    running there?"."""
    ours = node_tls(tmp_path / "ours", certs.new_ca())
    daemon = start_daemon(extra=ours.args())
    stranger = node_tls(tmp_path / "stranger", certs.new_ca("stranger CA"))

    wrong_ca = mtc_status(daemon.address, "--timeout", "5", tls=stranger)
    assert wrong_ca.returncode == 1
    assert wrong_ca.stdout == ""
    (line,) = wrong_ca.stderr.splitlines()
    assert line.startswith(f"mtc status: error: TLS handshake with the daemon at {daemon.address}")
    assert f"not issued by the CA in --tls-ca {stranger.files.ca}" in line

    # The right CA, a certificate the daemon does not trust: it hangs up in the handshake.
    files = stranger.files
    refused = mtc_status(
        daemon.address, "--timeout", "5", "--tls-cert", str(files.cert), "--tls-key",
        str(files.key), "--tls-ca", str(ours.files.ca),
    )  # fmt: skip
    assert refused.returncode == 1
    (line,) = refused.stderr.splitlines()
    assert f"did not accept the certificate {files.cert}" in line
