"""A used operator pin put back by a bucket writer after every RAM disk was lost (issue 39,
finding 4): real daemons with mutual TLS, a real ``file://`` bucket, the operator's real
signed pin.

The pin of step 10 is honoured once, legitimately; the job goes on to step 30; a bucket
writer copies the same signed pin back, and every node loses its RAM disk and store. The
restart restores step 30 on every rank, and rank 0's ``replicator.errors`` and
``mtc_pins_refused_total`` say the pin was used already. Before: the used pins were
recorded only in rank 0's store, so every rank restored step 10.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtc_replicator.storage.restore_pins import pin_key
from tests.integration.cluster import Cluster, assert_restored, running
from tests.integration.helpers import wait_until
from tests.integration.test_metrics import sample, scrape_until
from tests.tls import operator_flags

pytestmark = pytest.mark.integration


def mtc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_a_used_pin_put_back_after_every_ram_disk_was_lost_rolls_nothing_back(
    tmp_path: Path, job: str
) -> None:
    cluster = Cluster(tmp_path, job, ("--metrics", "127.0.0.1:0"), nodes=2)
    cluster.keys["backup_interval_steps"] = 1
    with running(cluster):
        cluster.fresh_start()
        old = cluster.save(10)
        cluster.wait_backup(10)
        cluster.save(20)
        cluster.wait_backup(20)

        # The operator pins step 10, signed; the job restarts and is rolled back to it.
        tls, ca = cluster.tls[0], cluster.ca
        assert tls is not None
        assert ca is not None
        ca_file = str(tls.files.ca)
        done = mtc(
            "backups",
            "pin",
            cluster.backup_url,
            "--job",
            job,
            "--step",
            "10",
            "--yes",
            "--tls-ca",
            ca_file,
            *operator_flags(tmp_path / "alice", ca),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        pin = cluster.backup / pin_key(job)
        signed = pin.read_bytes()
        cluster.handshake([1, 0])
        cluster.wait_markers(10)
        assert_restored(cluster, 10, old)
        wait_until(lambda: not pin.exists(), "the used pin deleted", daemon=cluster.daemon(0))

        # The job goes on to step 30.
        newest = cluster.save(30)
        cluster.wait_backup(30)

        # A bucket writer puts the same signed pin back; every RAM disk and store is lost.
        pin.write_bytes(signed)
        cluster.wipe_all()
        cluster.handshake([1, 0])
        cluster.wait_markers(30)
        assert_restored(cluster, 30, newest)
        errors = wait_until(
            lambda: "used already" in cluster.errors(0) and cluster.errors(0),
            "rank 0's replicator.errors says the pin was used already",
            daemon=cluster.daemon(0),
        )
        assert "refused the restore pin" in errors, errors
        assert "step 10" in errors, errors
        scrape_until(
            cluster.daemon(0),
            "mtc_pins_refused_total",
            lambda s: sample(s, "mtc_pins_refused_total", mtc_job=job) == 1.0,
        )
        assert pin.read_bytes() == signed, "left for the operator to see"
        listed = mtc(
            "backups", "list", cluster.backup_url, "--job", job, "--json", "--tls-ca", ca_file
        )
        assert listed.returncode == 0, listed.stderr
        shown = json.loads(listed.stdout)["jobs"][0]
        assert shown["restore_pin_signature"] == "verified"
        assert "used already" in shown["restore_pin_error"], shown
