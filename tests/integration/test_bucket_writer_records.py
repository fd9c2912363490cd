"""A keyless bucket writer against real daemons and a real bucket (moto's S3 server): a
restore pin it writes, and junk it writes over a job's registry entry.

Four daemons with mutual TLS (one throwaway CA, ``tests/tls.py``) back up to and register
in an ``s3://`` bucket. The attacker is this test process with write access to the bucket
and no key: its pin is refused and said (log, metric, the job's ``replicator.errors``), and
the job restores its newest step with every copy kept; its junk blocks the job name for
everyone, another namespace included, until an operator releases it with ``mtc registry
release``, and then the job's own rank 0 registers and the job restores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.cluster.registry import entry_key, open_registry
from mtc_replicator.core.contract import FAILED_FILE
from mtc_replicator.storage.backup_audit import read_commit_raw
from mtc_replicator.storage.restore_pins import RestorePin, commit_digest, pin_key
from mtc_replicator.storage.stores import open_object_store
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import FAST, NODES, Cluster, assert_restored, running
from tests.integration.helpers import (
    config_text,
    read_text,
    store_root,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_job_owner import THIEF, VICTIM, write_owner
from tests.integration.test_metrics import sample, scrape_until
from tests.storage_servers import Bucket
from tests.tls import node_tls, operator_flags

pytestmark = pytest.mark.integration


def mtc(*args: str) -> subprocess.CompletedProcess[str]:
    """The operator's ``mtc``, with this process's environment (the bucket's endpoint)."""
    return subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        env=dict(os.environ),
    )


def pin_signature(cluster: Cluster, *flags: str) -> str:
    """What ``mtc backups list`` says of the job's restore pin's signature."""
    done = mtc("backups", "list", cluster.backup_url, "--job", cluster.job, "--json", *flags)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["jobs"][0]["restore_pin_signature"])


@pytest.fixture
def s3_cluster(tmp_path: Path, job: str, s3_bucket: Bucket) -> Iterator[Cluster]:
    c = Cluster(tmp_path, job, ("--metrics", "127.0.0.1:0"))
    c.backup_url = s3_bucket.url
    c.env = dict(s3_bucket.env)
    for r in range(NODES):
        owner = tmp_path / "owners" / f"node{r}.json"
        write_owner(owner, VICTIM, pod=f"trainer-{r}")
        c.node_env[r] = {"MTC_OWNER_FILE": str(owner)}
    with running(c):
        yield c


def test_an_unsigned_restore_pin_rolls_nothing_back(s3_cluster: Cluster, tmp_path: Path) -> None:
    """Before: every rank rolled back from step 20 to 10 and dropped its step-20 copies."""
    cluster = s3_cluster
    cluster.keys["backup_interval_steps"] = 1
    cluster.fresh_start()
    old = cluster.save(10)
    cluster.wait_backup(10)
    new = cluster.save(20)
    cluster.wait_backup(20)
    held = {r: cluster.held(r) for r in range(NODES)}

    # The attacker reads COMMIT 10 and pins it, well formed, with no key to sign it.
    objects = open_object_store(cluster.backup_url)
    found = read_commit_raw(objects, cluster.job, 10)
    assert found is not None
    forged = RestorePin(cluster.job, 10, time.time(), commit_digest(found[1]), "ops@host")
    objects.put_bytes(pin_key(cluster.job), forged.to_json())

    cluster.handshake([1, 2, 3, 0])  # the job restarts
    cluster.wait_markers(20)
    assert_restored(cluster, 20, new)
    for r in range(NODES):
        assert held[r] <= cluster.held(r), f"rank {r} lost committed copies"
    errors = wait_until(
        lambda: "refused the restore pin" in cluster.errors(0) and cluster.errors(0),
        "rank 0's replicator.errors says the pin was refused",
        daemon=cluster.daemon(0),
    )
    assert "not signed" in errors, errors
    assert "mtc backups pin --operator-cert" in errors, errors
    scrape_until(
        cluster.daemon(0),
        "mtc_pins_refused_total",
        lambda s: sample(s, "mtc_pins_refused_total", mtc_job=cluster.job) == 1.0,
    )
    assert objects.get_bytes(pin_key(cluster.job)) == forged.to_json(), "left for the operator"
    tls = cluster.tls[0]
    assert tls is not None
    ca = ("--tls-ca", str(tls.files.ca))
    assert pin_signature(cluster, *ca) == "refused"

    # An operator's pin, signed with an operator certificate of the CA, is honoured.
    assert cluster.ca is not None
    done = mtc(
        "backups",
        "restore",
        cluster.backup_url,
        "--job",
        cluster.job,
        "--step",
        "10",
        "--yes",
        *ca,
        *operator_flags(tmp_path / "alice", cluster.ca),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "signed by operator alice" in done.stdout
    assert pin_signature(cluster, *ca) == "verified"
    cluster.handshake([0, 3, 2, 1])
    cluster.wait_markers(10)
    assert_restored(cluster, 10, old)


def test_junk_over_a_registry_entry_blocks_the_name_until_an_operator_releases_it(
    s3_cluster: Cluster, tmp_path: Path
) -> None:
    """Before: junk counted as nobody's, another namespace's rank 0 took the job name, and
    the owner's restart was refused ("registered to another owner") for good."""
    cluster = s3_cluster
    job = cluster.job
    cluster.fresh_start()
    files = cluster.save(5)
    objects = open_object_store(cluster.backup_url)
    junk = b'{"version": 1, "job": "' + job.encode() + b'", "address": "nowhere"}'
    objects.put_bytes(entry_key(job), junk)

    # Another namespace's rank 0, a node of the stack (its certificate from the same CA).
    thief_dir = tmp_path / "thief"
    thief_dir.mkdir()
    owner = tmp_path / "owners" / "thief.json"
    write_owner(owner, THIEF, pod="miner-0")
    assert cluster.ca is not None
    thief = DaemonProcess(
        thief_dir,
        backup=cluster.backup_url,
        extra_args=(*FAST, *node_tls(tmp_path / "tls" / "thief", cluster.ca).args()),
        env={**cluster.env, "MTC_OWNER_FILE": str(owner)},
        log_path=tmp_path / "thief.log",
    )
    with thief:
        write_yaml_atomic(thief_dir, config_text(job, rank=0, nodes=NODES, **cluster.keys))
        wait_until(
            lambda: (thief_dir / FAILED_FILE).exists() or objects.get_bytes(entry_key(job)) != junk,
            "the thief's handshake judged",
            daemon=thief,
        )
        assert objects.get_bytes(entry_key(job)) == junk, "the thief registered over the junk"
        text = read_text(thief_dir / FAILED_FILE)
        assert "mtc registry release" in text, text
        assert not (store_root(thief_dir) / "items" / job).exists()

    # The owner's own rank 0 cannot prove the junk was its entry: refused too, told why.
    write_yaml_atomic(cluster.dirs[0], config_text(job, rank=0, nodes=NODES, **cluster.keys))
    failed = cluster.dirs[0] / FAILED_FILE
    wait_until(failed.exists, "rank 0's handshake refused", daemon=cluster.daemon(0))
    assert "mtc registry release" in read_text(failed)
    assert objects.get_bytes(entry_key(job)) == junk
    for r in range(NODES):
        assert (5, f"{r}-0") in cluster.held(r), f"rank {r} lost its step 5"

    # The operator looks, then releases the name; the job restarts and is its own again.
    tls = cluster.tls[0]
    assert tls is not None
    ca = ("--tls-ca", str(tls.files.ca))
    shown = mtc("registry", "show", cluster.backup_url, "--job", job, *ca)
    assert shown.returncode == 0, shown.stderr
    assert "blocked" in shown.stdout
    released = mtc("registry", "release", cluster.backup_url, "--job", job, "--yes", *ca)
    assert released.returncode == 0, released.stdout + released.stderr
    cluster.handshake([0, 3, 1, 2])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    entry = open_registry(cluster.backup_url).lookup(job)
    assert entry is not None
    assert entry.owner == VICTIM
    # A valid entry is not released without --force: a running job holds the name.
    kept = mtc("registry", "release", cluster.backup_url, "--job", job, "--yes", *ca)
    assert kept.returncode == 1
    assert "--force" in kept.stderr
