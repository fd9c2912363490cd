"""Signed records against real daemons: a bucket writer forges a COMMIT or a registry entry.

The daemons run with mutual TLS (certificates from one throwaway CA, ``tests/tls.py``) and
a ``file://`` bucket. The attacker is this test process with write access to the bucket,
and in the registry case also a coordinator with a genuine node certificate: what stops it
is the signature, not the TLS handshake. Each forgery is refused, said in
``replicator.errors``, and nothing committed changes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.cluster.registry import RegistryEntry
from mtc_replicator.core.backup_layout import CommitRecord, commit_key
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.grpc_server import RpcServer
from mtc_replicator.transport.signing import record_trust
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    ERRORS,
    backup_commits,
    config_text,
    item_dir,
    make_step,
    payload,
    ram_disk,
    read_prerestore,
    read_text,
    read_tree,
    running_daemon,
    sha256_tree,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration
FORGED_STEP = 9


def stranger_signature(tmp_path: Path, body: dict[str, object]) -> dict[str, str]:
    """A well-formed signature block by a node certificate of another CA."""
    stranger = node_tls(tmp_path / "stranger-tls", certs.new_ca("stranger CA"))
    key = serialization.load_pem_private_key(stranger.files.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return {
        "certificates": stranger.files.cert.read_text(),
        "value": base64.b64encode(key.sign(text, ec.ECDSA(hashes.SHA256()))).decode(),
    }


def forge_step(tmp_path: Path, backup_dir: Path, job: str, how: str) -> bytes:
    """What someone with write access to the bucket can do: upload a step of their own
    (valid manifests, real bytes) and a COMMIT for it that is valid JSON. Its bytes."""
    data = make_step(tmp_path, FORGED_STEP, payload(FORGED_STEP, seed="attacker"))
    item = ItemId(job, FORGED_STEP, 0, 0)
    manifest = build_manifest(item, data)
    objects = FileObjectStore(backup_dir)
    BackupStore(objects).upload_item(manifest, data)
    record = CommitRecord(job, FORGED_STEP, {item.key: manifest.digest}, time.time())
    body = record.body()
    if how == "stranger-signed":
        body["signature"] = stranger_signature(tmp_path, record.body())
    elif how == "tampered":
        # A genuine node's signed COMMIT of another step, relabelled: the signature no
        # longer fits the fields.
        genuine = json.loads(objects.get_bytes(commit_key(job, 2)))
        body["signature"] = genuine["signature"]
    raw = json.dumps(body, sort_keys=True).encode()
    objects.put_bytes(commit_key(job, FORGED_STEP), raw)
    return raw


@pytest.mark.parametrize("how", ["unsigned", "stranger-signed", "tampered"])
def test_a_forged_commit_for_a_newer_step_is_never_restored(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon, tmp_path: Path, how: str
) -> None:
    tls = node_tls(tmp_path / "tls", certs.new_ca()).args()
    daemon = start_daemon(backup=backup_dir, extra=tls)
    yaml_text = config_text(job, backup_interval_steps=1)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    for step in (1, 2):
        make_step(ckpt, step, payload(step, seed=job))
        wait_ingested(ckpt, job, step, daemon)
        wait_until(
            lambda s=step: s in backup_commits(backup_dir, job), f"COMMIT {step}", daemon=daemon
        )
    assert daemon.stop() == 0
    committed = {s: (backup_dir / job / str(s) / "COMMIT").read_bytes() for s in (1, 2)}
    assert all(b'"signature"' in raw for raw in committed.values()), "COMMITs are signed"

    forged = forge_step(tmp_path / "attacker", backup_dir, job, how)
    shutil.rmtree(store_root(ckpt))  # the node lost its RAM disk: only the backup is left
    before = sha256_tree(backup_dir / job)

    daemon = start_daemon(backup=backup_dir, extra=tls)
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, 2, daemon)
    assert read_prerestore(ckpt) == {"restore-step": 2, "restore-source": "backup"}
    assert read_tree(marker) == payload(2, seed=job)
    assert not item_dir(ckpt, job, FORGED_STEP).exists(), "the forged step was fetched"
    errors = read_text(ckpt / ERRORS)
    assert f"COMMIT of job {job} step {FORGED_STEP} refused" in errors
    assert "never restored" in errors
    # Nothing in the bucket changed: the real COMMITs, and the forgery left for the operator.
    assert sha256_tree(backup_dir / job) == before
    assert {s: (backup_dir / job / str(s) / "COMMIT").read_bytes() for s in (1, 2)} == committed
    assert (backup_dir / job / str(FORGED_STEP) / "COMMIT").read_bytes() == forged


def test_an_unsigned_commit_is_restored_only_under_the_migration_flag(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """A bucket written by a version before signed records: refused by default (the job
    starts fresh and is told why), restored with --accept-unsigned-records (said in the log)."""
    tls = node_tls(tmp_path / "tls", certs.new_ca()).args()
    forge_step(tmp_path / "old-version", backup_dir, job, "unsigned")
    yaml_text = config_text(job, backup_interval_steps=1000)
    daemon = start_daemon(backup=backup_dir, extra=tls)
    write_yaml_atomic(ckpt, yaml_text)
    wait_markers(ckpt, job, 0, daemon)
    assert f"COMMIT of job {job} step {FORGED_STEP} refused" in read_text(ckpt / ERRORS)
    assert daemon.stop() == 0

    (ckpt / ERRORS).unlink()
    daemon = start_daemon(backup=backup_dir, extra=(*tls, "--accept-unsigned-records"))
    assert "--accept-unsigned-records is on" in daemon.log()
    write_yaml_atomic(ckpt, yaml_text)
    (marker,) = wait_markers(ckpt, job, FORGED_STEP, daemon)
    assert read_tree(marker) == payload(FORGED_STEP, seed="attacker")


# --- the registry ----------------------------------------------------------------------------


@pytest.fixture
def rogue_coordinator(
    tmp_path: Path,
) -> Iterator[Callable[[NodeTls, str], tuple[str, CoordinatorHost]]]:
    """A coordinator in this process, for job J, with the certificate it is given: a
    genuine node certificate passes the TLS handshake, so only the signature can stop it."""
    stops: list[Callable[[], None]] = []
    threads: list[threading.Thread] = []

    def start(node: NodeTls, job: str) -> tuple[str, CoordinatorHost]:
        config = JobConfig(job, Framework.ORBAX, node_rank=0, nodes=2, peers_per_node=1)
        host = CoordinatorHost()
        host.host(config, cluster_view_json(config))
        address: list[str] = []
        started = threading.Event()

        async def serve() -> None:
            rpc = RpcServer()
            servicer = CoordinatorServicer(Coordinators(host, lambda j: {}))
            rpc.add_service("mtc.v1.Coordinator", servicer.register)
            address.append(rpc.bind("127.0.0.1:0", node.material().server_credentials()))
            await rpc.start()
            done = asyncio.Event()
            loop = asyncio.get_running_loop()
            stops.append(lambda: loop.call_soon_threadsafe(done.set))
            started.set()
            await done.wait()
            await rpc.stop(0.1)

        thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        thread.start()
        threads.append(thread)
        assert started.wait(10)
        return address[0], host

    yield start
    for stop in stops:
        stop()
    for thread in threads:
        thread.join(10)


@pytest.mark.parametrize("how", ["unsigned", "stranger-signed"])
def test_a_forged_registry_entry_is_refused_and_reported(
    tmp_path: Path,
    rogue_coordinator: Callable[[NodeTls, str], tuple[str, CoordinatorHost]],
    how: str,
) -> None:
    ca = certs.new_ca()
    job = f"victim-{uuid.uuid4().hex[:6]}"
    registry_dir = tmp_path / "registry"
    registry_dir.mkdir()
    address, host = rogue_coordinator(node_tls(tmp_path / "rogue-tls", ca), job)
    entry = RegistryEntry(job, address, "rogue01", time.time())
    body = entry.body()
    if how == "stranger-signed":
        body["signature"] = stranger_signature(tmp_path, entry.body())
    (registry_dir / "_registry").mkdir()
    (registry_dir / "_registry" / f"{job}.json").write_text(json.dumps(body))
    with (
        ram_disk(tmp_path / "rank1", "32m") as ckpt,
        running_daemon(
            ckpt,
            extra=("--registry", registry_dir.as_uri(), *node_tls(tmp_path / "r1", ca).args()),
        ) as rank1,
    ):
        write_yaml_atomic(ckpt, config_text(job, rank=1, nodes=2, peers_per_node=1))
        wait_until(
            lambda: "refused the registry entry" in read_text(ckpt / ERRORS),
            "the forged entry reported",
            daemon=rank1,
        )
        time.sleep(1.0)  # lookups go on with backoff; none may reach the rogue coordinator
        hosted = host.get(job)
        assert hosted is not None
        assert hosted.coordinator.members == {}, "a rank joined the forged entry's coordinator"
        assert not list(ckpt.glob("*.restore"))


# --- mtc backups ---------------------------------------------------------------------------


def test_mtc_backups_shows_and_checks_each_commits_signature(tmp_path: Path) -> None:
    ca = certs.new_ca()
    node = node_tls(tmp_path / "tls", ca)
    bucket = tmp_path / "bucket"
    job = "signedjob"
    signed = BackupStore(FileObjectStore(bucket), record_trust(node.material()))
    data = make_step(tmp_path, 2, payload(2, seed=job))
    manifest = node.attest(build_manifest(ItemId(job, 2, 0, 0), data))  # as a daemon does
    signed.upload_item(manifest, data)
    assert signed.try_commit(job, 2, ["0-0"]) is not None
    forge_step(tmp_path / "attacker", bucket, job, "unsigned")

    def mtc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", *args],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    ca_flag = ("--tls-ca", str(node.files.ca))
    out = mtc("list", bucket.as_uri(), "--job", job, "--json", *ca_flag)
    assert out.returncode == 0, out.stderr
    steps = {s["step"]: s for s in json.loads(out.stdout)["jobs"][0]["steps"]}
    assert steps[2]["signature"] == "verified"
    assert steps[2]["state"] == "committed"
    assert steps[FORGED_STEP]["signature"] == "refused"
    assert steps[FORGED_STEP]["state"] == "invalid"
    assert "not signed" in steps[FORGED_STEP]["commit_error"]
    without_ca = mtc("list", bucket.as_uri(), "--job", job, "--json")
    assert {s["signature"] for s in json.loads(without_ca.stdout)["jobs"][0]["steps"]} == {
        "unchecked"
    }

    out = mtc("verify", bucket.as_uri(), "--job", job, "--json", *ca_flag)
    assert out.returncode == 1, out.stdout + out.stderr
    verdicts = {v["step"]: v for v in json.loads(out.stdout)["steps"]}
    assert verdicts[2]["status"] == "OK"
    assert [p["kind"] for p in verdicts[FORGED_STEP]["problems"]] == ["untrusted_commit"]
    out = mtc(
        "restore", bucket.as_uri(), "--job", job, "--step", str(FORGED_STEP), "--yes", *ca_flag
    )
    assert out.returncode == 1
    assert "not signed" in out.stderr
    assert not (bucket / "_control").exists(), "a pin to the forged step was written"


def test_mtc_backups_verify_says_per_step_whether_signatures_were_checked(
    tmp_path: Path,
) -> None:
    """Before: ``verify --tls-ca`` printed the same lines as without it, so nothing said the
    signatures were checked, nor against which CA."""
    ca = certs.new_ca("verify test CA")
    node = node_tls(tmp_path / "tls", ca)
    bucket = tmp_path / "bucket"
    job = "signedjob"
    signed = BackupStore(FileObjectStore(bucket), record_trust(node.material()))
    data = make_step(tmp_path, 2, payload(2, seed=job))
    signed.upload_item(node.attest(build_manifest(ItemId(job, 2, 0, 0), data)), data)
    assert signed.try_commit(job, 2, ["0-0"]) is not None
    forge_step(tmp_path / "attacker", bucket, job, "unsigned")

    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", "verify",
             bucket.as_uri(), "--job", job, *args],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip

    ca_file = str(node.files.ca)
    checked = verify("--tls-ca", ca_file)
    assert checked.returncode == 1, checked.stdout + checked.stderr  # the forged step
    by_step = re.split(rf"^job {job} step ", checked.stdout, flags=re.M)
    good = next(s for s in by_step if s.startswith("2: OK"))
    assert f"signatures: checked against the CA {ca_file} (CN=verify test CA" in good
    assert "COMMIT verified, 1 manifest verified" in good
    forged = next(s for s in by_step if s.startswith(f"{FORGED_STEP}: CORRUPT"))
    assert "COMMIT refused" in forged

    unchecked = verify()
    assert "signatures: not checked (no --tls-ca)" in unchecked.stdout
    assert "signatures: checked" not in unchecked.stdout

    as_json = verify("--tls-ca", ca_file, "--json")
    steps = {v["step"]: v["signatures"] for v in json.loads(as_json.stdout)["steps"]}
    assert steps[2]["checked"] is True
    assert steps[2]["ca"].startswith(f"{ca_file} (CN=verify test CA")
    assert (steps[2]["commit"], steps[2]["manifests"]) == ("verified", {"verified": 1})
    assert steps[FORGED_STEP]["commit"] == "refused"
    plain = {v["step"]: v["signatures"] for v in json.loads(verify("--json").stdout)["steps"]}
    assert plain[2] == {"checked": False, "ca": None, "commit": "unchecked",
                        "manifests": {"unchecked": 1}}  # fmt: skip
