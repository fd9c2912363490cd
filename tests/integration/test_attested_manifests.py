"""Attested manifests against real daemons: every item is signed at ingest by the node that
produced it, for the job's owner (``core.attestation``), and nothing unattested, attested
by another node than it names, or attested for another owner is taken.

- A pod of namespace B, on another node, names namespace A's one-node job in its
  ``replicator.yaml``: before attestations its daemon restored A's newest step byte for
  byte from the shared bucket (one-node jobs have no registry to check the owner).
- A node certificate holder pushes items to a rank's holder: unsigned, signed by itself
  but naming another node as the producer, or for another owner. Each is refused with
  PERMISSION_DENIED before a byte is staged; a push attested as the rules want is taken.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from mtc_replicator.core.attestation import statement
from mtc_replicator.core.manifest import Attestation, ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import MANIFEST_FILE, LocalStore
from mtc_replicator.tools import certs
from mtc_replicator.transport.peer_client import PeerClient, PeerError
from mtc_replicator.transport.signing import NodeSigner
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES, Cluster, assert_restored
from tests.integration.grants import grant_receiver
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAST_ARGS,
    RECEIVER,
    config_text,
    item_dir,
    make_step,
    payload,
    read_text,
    receiver_args,
    running_daemon,
    store_root,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_job_owner import THIEF, VICTIM, write_owner
from tests.integration.test_tls import accept_job
from tests.tls import NodeTls, node_tls

pytestmark = pytest.mark.integration


def _bytes_anywhere(root: Path, wanted: set[bytes]) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.read_bytes() in wanted]


def test_another_namespace_naming_a_one_node_job_restores_nothing_of_it(tmp_path: Path) -> None:
    ca = certs.new_ca()
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    job = "victim-train"
    yaml_text = config_text(job, backup_interval_steps=1)

    def node(name: str, namespace: str) -> DaemonProcess:
        ckpt = tmp_path / name / "checkpoint"
        ckpt.mkdir(parents=True)
        owner = tmp_path / name / "owner.json"
        write_owner(owner, namespace)
        tls = node_tls(tmp_path / name / "tls", ca, node=name)
        return DaemonProcess(
            ckpt,
            backup=bucket.as_uri(),
            extra_args=(*FAST_ARGS, *tls.args()),
            env={"MTC_OWNER_FILE": str(owner)},
        ).start()

    victim = node("node-a", VICTIM)
    try:
        write_yaml_atomic(victim.checkpoint_dir, yaml_text)
        wait_markers(victim.checkpoint_dir, job, 0, victim)
        for step in (1, 2):
            make_step(victim.checkpoint_dir, step, payload(step, seed=job))
            wait_ingested(victim.checkpoint_dir, job, step, victim)
        wait_until((bucket / job / "2" / "COMMIT").exists, "COMMIT of step 2", daemon=victim)
    finally:
        assert victim.stop() == 0
    # The COMMIT names the owner its items' attestations name, inside its signed body.
    assert json.loads((bucket / job / "2" / "COMMIT").read_bytes())["owner"] == VICTIM
    secret = {b for s in (1, 2) for b in payload(s, seed=job).values() if b}

    thief = node("node-b", THIEF)
    try:
        write_yaml_atomic(thief.checkpoint_dir, yaml_text)
        wait_until(
            lambda: not (thief.checkpoint_dir / CONFIG).exists(), "the yaml taken", daemon=thief
        )
        # Before attestations: step 2's markers, with A's bytes behind them.
        wait_markers(thief.checkpoint_dir, job, 0, thief)
        errors = read_text(thief.checkpoint_dir / ERRORS)
        assert f"belongs to owner '{VICTIM}'" in errors, errors
        leaked = _bytes_anywhere(thief.checkpoint_dir, secret) + _bytes_anywhere(
            store_root(thief.checkpoint_dir), secret
        )
        assert leaked == [], f"A's bytes on B's node: {leaked}"
    finally:
        thief.stop()


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, NodeTls]]:
    """A daemon (owner VICTIM) that takes pushes of rank 0's items, and a node certificate
    of its CA (``mallory``) to push with: mtc-controller's grant puts rank 0 on mallory's
    node (no rank 0 ever runs, and a push from a named node is taken only once its rank's
    node is known), so what is refused below is refused for its attestation alone."""
    root = tmp_path_factory.mktemp("attested")
    ca = certs.new_ca()
    ckpt = root / "ckpt"
    ckpt.mkdir()
    owner = root / "owner.json"
    write_owner(owner, VICTIM)
    tls = node_tls(root / "tls", ca, node="node-1")
    with running_daemon(
        ckpt, extra=(*tls.args(), *receiver_args(ckpt)), env={"MTC_OWNER_FILE": str(owner)}
    ) as daemon:
        pod = json.loads(owner.read_text())["pod_uid"]
        grant_receiver(daemon, ca, root, "shared-job", holders=("mallory", "node-1"), pod_uid=pod)
        accept_job(ckpt, daemon, "shared-job", **RECEIVER)
        yield daemon, node_tls(root / "mallory", ca, node="mallory")


def _attested_as(manifest: Manifest, signer: NodeTls, owner: str, producer: str) -> Manifest:
    """``manifest`` attested for ``owner``, naming ``producer``, signed by ``signer``."""
    now = time.time()
    sig = NodeSigner(signer.material()).sign(statement(manifest, owner, producer, now))
    att = Attestation(owner, producer, now, sig.certificates, sig.value)
    return replace(manifest, attestation=att)


CASES = ["unsigned", "names another producer", "another owner", "altered after signing"]


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("unsigned", "not signed by its producer"),
        ("names another producer", "says node 'node-0' produced it, but node 'mallory' signed"),
        ("another owner", f"belongs to owner '{THIEF}'"),
        ("altered after signing", "altered after signing"),
    ],
)
def test_a_push_not_attested_for_this_job_is_refused_before_a_byte_is_staged(
    receiver: tuple[DaemonProcess, NodeTls], tmp_path: Path, case: str, refusal: str
) -> None:
    daemon, mallory = receiver
    step = 10 + CASES.index(case)
    data = tmp_path / "data"
    data.mkdir()
    (data / "state.bin").write_bytes(b"forged" * 1000)
    manifest = build_manifest(ItemId("shared-job", step, 0, 0), data)
    if case == "names another producer":
        manifest = _attested_as(manifest, mallory, VICTIM, "node-0")
    elif case == "another owner":
        manifest = mallory.attest(manifest, THIEF)
    elif case == "altered after signing":
        att = mallory.attest(manifest, VICTIM).attestation
        assert att is not None
        manifest = replace(manifest, attestation=replace(att, created=att.created + 1))

    async def push(m: Manifest) -> None:
        async with PeerClient(timeout=10.0, tls=mallory.material()) as client:
            await client.push_item(daemon.address, m, data)

    with pytest.raises(PeerError) as refused:
        asyncio.run(push(manifest))
    assert "PERMISSION_DENIED" in str(refused.value), refused.value
    assert refusal in str(refused.value), refused.value
    assert not item_dir(daemon.checkpoint_dir, "shared-job", step, rank=0).exists()

    # The same bytes, attested by mallory as itself for the job's owner: taken (the rule is
    # about who says what, not about the bytes).
    good = mallory.attest(build_manifest(ItemId("shared-job", step + 100, 0, 0), data), VICTIM)
    asyncio.run(push(good))
    held = item_dir(daemon.checkpoint_dir, "shared-job", step + 100, rank=0)
    wait_until(held.exists, "the attested push committed", daemon=daemon)
    stored = Manifest.from_json((held / MANIFEST_FILE).read_bytes())
    assert stored.attestation == good.attestation


def test_a_node_certificate_pushes_no_rank_it_does_not_hold(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The red team's push: one node certificate of the CA ("mallory", no member of the
    job) pushed a forged step of every rank to the node holding that rank's copies, and
    after a job restart the whole job restored it. Now a receiver takes a rank's pushes
    only from the node the coordinator bound the rank to (``core.admission``), once its
    progress reports have told it which (the first few seconds of steady state)."""
    job = cluster.job
    cluster.fresh_start()
    cluster.save(10)
    assert cluster.ca is not None
    mallory = node_tls(tmp_path / "mallory", cluster.ca, node="mallory")
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / "weights.bin").write_bytes(b"chosen by mallory" * 100)
    holder = cluster.holder(0, 10)
    tried: list[str] = []

    async def push(step: int) -> str:
        manifest = mallory.attest(build_manifest(ItemId(job, step, 0, 0), forged))
        async with PeerClient(timeout=10.0, tls=mallory.material()) as client:
            try:
                await client.push_item(cluster.daemon(holder).address, manifest, forged)
            except PeerError as exc:
                return str(exc)
        return "taken"

    def refused() -> bool:
        tried.append(asyncio.run(push(20 + len(tried))))
        return tried[-1] != "taken"

    wait_until(refused, "mallory's push refused", daemon=cluster.daemon(holder), interval=0.5)
    assert "PERMISSION_DENIED" in tried[-1], tried
    assert "rank 0 is held by node 'node0', not 'mallory'" in tried[-1], tried


def _plant(ckpt: Path, job: str, step: int, signer: NodeTls) -> None:
    """Commit a forged item of every rank of ``step`` in the store beside ``ckpt``, each
    attested by ``signer`` as itself, as its daemon would have after taking pushes."""
    store = LocalStore(ckpt)
    store.open()
    try:
        for rank in range(NODES):
            staged = store.new_staging()
            data = staged / "data"
            data.mkdir()
            (data / "weights.bin").write_bytes(b"chosen by mallory" * (100 + rank))
            manifest = signer.attest(build_manifest(ItemId(job, step, rank, 0), data))
            store.commit_staged(staged, manifest)
    finally:
        store.close()


def test_a_certificate_holder_in_a_free_rank_cannot_make_the_job_restore_its_steps(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The red team's join: with node 2 down, a certificate holder ("mallory") joined as
    rank 2 claiming a step 25 of every rank; the plan chose 25 and every rank restored
    its bytes, while the real newest step was 10. Now the coordinator names each item's
    possible producers (the nodes that held its rank by its step, ``core.rank_holders``)
    and mallory is none of them: every rank restores step 10, rank 2 on mallory's node
    from its peer."""
    job = cluster.job
    cluster.fresh_start()
    files = cluster.save(10)
    assert cluster.ca is not None
    cluster.daemon(2).kill()
    cluster.clear(2)  # node 2 is gone with its RAM disk; mallory's node takes the rank
    mallory = node_tls(tmp_path / "mallory", cluster.ca, node="mallory")
    cluster.tls[2] = mallory
    _plant(cluster.dirs[2], job, 25, mallory)
    cluster.start(2)

    cluster.handshake(list(range(NODES)))
    cluster.wait_markers(10)  # before: every rank's step-25 marker, mallory's bytes
    assert_restored(cluster, 10, files)
    refusals = "".join(cluster.errors(r) for r in range(NODES))
    assert "produced by node 'mallory', which never held rank" in refusals, refusals
