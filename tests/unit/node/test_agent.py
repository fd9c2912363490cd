"""``node.agent`` without a daemon: the saved incarnation's round trip, and a one-node job's
``Incarnation`` run through its real restore round against an in-process coordinator
(``LocalFinder``): the markers it publishes in CHECKPOINT_DIR, a step it ingests, and what
it tells the workload when it cannot go on. A real ``LocalStore`` on tmp_path, a small
thread pool; no sockets, and each wait ends on an event of the incarnation's own metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.core.contract import (
    ERRORS_FILE,
    FAILED_FILE,
    PRERESTORE_FILE,
    marker_name,
    parse_config,
)
from mtc_replicator.core.drain import Drained
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.agent import AgentContext, Incarnation, restore_saved
from mtc_replicator.node.saved_incarnation import (
    STATE_FILE,
    IncarnationPhase,
    SavedIncarnation,
    forget_every_state,
    load_state,
    new_incarnation_id,
    save_state,
    state_file,
)
from mtc_replicator.obs.metrics import ErrorKind, Metrics, TransferKind
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore
from mtc_replicator.transport.peer_client import PeerClient

ONE_NODE = "job-name: job\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-steps: 10\n"
TWO_NODES = ONE_NODE.replace("nodes: 1", "nodes: 2")
DEADLINE = 5.0
"""Seconds any one wait of these tests may take (each is well under one here)."""


class Events(Metrics):
    """The incarnation's metrics, as events a test waits on instead of sleeping."""

    def __init__(self) -> None:
        self.restored = asyncio.Event()
        self.restored_step: int | None = None
        self.failed = asyncio.Event()
        self.committed_steps: list[int | None] = []
        self.new_step = asyncio.Event()
        self.transfers: list[TransferKind] = []
        self.errors: list[ErrorKind] = []

    def restore_done(self, job: str, step: int | None, seconds: float) -> None:
        self.restored_step = step
        self.restored.set()

    def restore_failed(self, job: str, seconds: float) -> None:
        self.failed.set()

    def committed(self, job: str, step: int | None) -> None:
        self.committed_steps.append(step)
        self.new_step.set()

    def transfer(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        self.transfers.append(kind)

    def error(self, kind: ErrorKind) -> None:
        self.errors.append(kind)


class Node:
    """One node's CHECKPOINT_DIR and store, and the coordinators its daemon would host."""

    def __init__(self, tmp_path: Path, executor: ThreadPoolExecutor) -> None:
        self.dir = tmp_path / "checkpoint"
        self.dir.mkdir()
        self.store = LocalStore(self.dir, tmp_path / "store")
        self.store.open()
        self.tmp_path = tmp_path
        self.host = CoordinatorHost()
        self.executor = executor

    def context(self, metrics: Metrics, *, backups: BackupStore | None = None) -> AgentContext:
        return AgentContext(
            checkpoint_dir=self.dir,
            store=self.store,
            backups=backups,
            executor=self.executor,
            peers=PeerClient(executor=self.executor),  # no job here has peers: never dialled
            coordinator_calls=Coordinators(self.host, lambda job: {}),
            advertise="127.0.0.1:7070",
            rescan_seconds=0.05,
            metrics=metrics,
        )

    def commit(self, step: int) -> ItemId:
        """A step of the job held in the store, as a previous incarnation left it."""
        item = ItemId("job", step, 0, 0)
        data = self.tmp_path / f"src-{step}"
        (data / "state").mkdir(parents=True)
        (data / "state" / "shard").write_bytes(os.urandom(1000))
        manifest = build_manifest(item, data)
        staged = self.store.new_staging()
        os.rename(data, staged / "data")
        self.store.commit_staged(staged, manifest)
        return item

    def incarnation(self, text: str, metrics: Metrics, **kw: Any) -> Incarnation:
        """What the daemon's handshake does: host rank 0's coordinator, then the incarnation."""
        config = parse_config(text)
        incarnation = Incarnation(config, self.context(metrics, **kw), config_text=text)
        self.host.host(config, cluster_view_json(config), rank0_incarnation=incarnation.id)
        return incarnation


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-io") as executor:
        yield Node(tmp_path, executor)


async def until(event: asyncio.Event) -> None:
    async with asyncio.timeout(DEADLINE):
        await event.wait()


# --- what survives a daemon restart -------------------------------------------------------


def test_the_saved_incarnation_round_trips(node: Node) -> None:
    assert load_state(node.store) is None
    for phase in IncarnationPhase:
        saved = SavedIncarnation(ONE_NODE, "0123456789abcdef", phase)
        save_state(node.store, saved)
        assert load_state(node.store) == saved
    save_state(node.store, None)
    assert not (node.store.root / STATE_FILE).exists()
    assert load_state(node.store) is None
    save_state(node.store, None)  # nothing to remove: no error


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b'{"config": "x", "id": "y"}',
        b'{"config": "x", "id": "y", "phase": "?"}',
        b"[]",
    ],
    ids=["garbled", "no-phase", "unknown-phase", "not-an-object"],
)
def test_an_unreadable_saved_state_is_ignored(node: Node, body: bytes) -> None:
    (node.store.root / STATE_FILE).write_bytes(body)
    assert load_state(node.store) is None


def test_incarnation_ids_are_16_hex_digits_and_new_each_time() -> None:
    ids = {new_incarnation_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 16 and int(i, 16) >= 0 for i in ids)


@pytest.mark.parametrize("phase", list(IncarnationPhase))
def test_a_restarted_daemon_resumes_the_saved_incarnation(
    node: Node, phase: IncarnationPhase
) -> None:
    save_state(node.store, SavedIncarnation(ONE_NODE, "0123456789abcdef", phase))
    resumed = restore_saved(node.context(Metrics()))
    assert resumed is not None
    assert resumed.id == "0123456789abcdef"
    assert resumed.config == parse_config(ONE_NODE)
    assert resumed.config_text == ONE_NODE
    assert resumed.phase is phase  # a restore not finished is done again


def test_nothing_saved_or_a_config_no_longer_valid_resumes_nothing(node: Node) -> None:
    ctx = node.context(Metrics())
    assert restore_saved(ctx) is None
    save_state(
        node.store, SavedIncarnation("nodes: many", "0123456789abcdef", IncarnationPhase.STEADY)
    )
    assert restore_saved(ctx) is None


def test_a_saved_config_expands_only_the_allowed_variables(node: Node) -> None:
    text = ONE_NODE.replace("job-name: job", "job-name: $JOB")
    save_state(node.store, SavedIncarnation(text, "0123456789abcdef", IncarnationPhase.STEADY))
    ctx = node.context(Metrics())
    assert restore_saved(ctx) is None  # $JOB is not among ctx.env
    resumed = restore_saved(dataclasses.replace(ctx, env={"JOB": "job"}))
    assert resumed is not None
    assert resumed.config.job_name == "job"


# --- a one-node job's incarnation, end to end in process ----------------------------------


def test_a_fresh_job_restores_nothing_and_publishes_empty_markers(node: Node) -> None:
    metrics = Events()

    async def body() -> Incarnation:
        incarnation = node.incarnation(ONE_NODE, metrics)
        incarnation.start()
        try:
            await until(metrics.restored)
        finally:
            await incarnation.stop()
        return incarnation

    incarnation = asyncio.run(body())
    assert metrics.restored_step is None
    assert (node.dir / PRERESTORE_FILE).read_text() == "{}\n"
    marker = node.dir / marker_name("job", 0, 0, 0)
    assert marker.is_file()
    assert not marker.is_symlink()
    assert marker.stat().st_size == 0
    assert incarnation.phase is IncarnationPhase.STEADY
    # Persisted: a restarted daemon resumes ingesting, not restoring.
    assert load_state(node.store) == SavedIncarnation(
        ONE_NODE, incarnation.id, IncarnationPhase.STEADY
    )
    assert not (node.dir / FAILED_FILE).exists()


def test_the_newest_step_held_here_is_restored_through_a_marker_to_its_view(node: Node) -> None:
    node.commit(10)
    item = node.commit(20)
    metrics = Events()

    async def body() -> Incarnation:
        incarnation = node.incarnation(ONE_NODE, metrics)
        incarnation.start()
        try:
            await until(metrics.restored)
        finally:
            await incarnation.stop()
        return incarnation

    asyncio.run(body())
    assert metrics.restored_step == 20
    assert (node.dir / PRERESTORE_FILE).read_text() == "restore-step: 20\nrestore-source: local\n"
    marker = node.dir / marker_name("job", 20, 0, 0)
    assert marker.is_symlink()
    # The marker opens the item's bytes, as committed.
    assert (marker / "state" / "shard").read_bytes() == (
        node.store.data_path(item) / "state" / "shard"
    ).read_bytes()
    assert not (node.dir / marker_name("job", 10, 0, 0)).exists()
    assert TransferKind.RESTORE_LOCAL in metrics.transfers


def test_a_step_the_job_writes_is_ingested(node: Node) -> None:
    metrics = Events()

    async def body() -> None:
        incarnation = node.incarnation(ONE_NODE, metrics)
        incarnation.start()
        try:
            await until(metrics.restored)
            step = node.dir / "30"  # what Orbax renames in when step 30 is saved
            (step / "state").mkdir(parents=True)
            (step / "state" / "shard").write_bytes(b"weights")
            metrics.new_step.clear()
            incarnation.wake()
            while 30 not in metrics.committed_steps:
                await until(metrics.new_step)
                metrics.new_step.clear()
        finally:
            await incarnation.stop()

    asyncio.run(body())
    held = node.store.get(ItemId("job", 30, 0, 0))
    assert held is not None
    assert (node.store.data_path(held.item) / "state" / "shard").read_bytes() == b"weights"
    assert TransferKind.INGEST in metrics.transfers


def test_a_step_that_cannot_be_kept_is_told_and_dropped(node: Node) -> None:
    metrics = Events()

    async def body() -> None:
        incarnation = node.incarnation(ONE_NODE, metrics)
        incarnation.start()
        try:
            await until(metrics.restored)
            step = node.dir / "30"
            step.mkdir()
            (step / "escape").symlink_to("/etc/passwd")  # never followed, never kept
            metrics.new_step.clear()
            incarnation.wake()
            async with asyncio.timeout(DEADLINE):
                while ErrorKind.INGEST not in metrics.errors:
                    await until(metrics.new_step)
                    metrics.new_step.clear()
        finally:
            await incarnation.stop()

    asyncio.run(body())
    assert node.store.get(ItemId("job", 30, 0, 0)) is None
    assert node.store.pending_ingest() == []
    told = (node.dir / ERRORS_FILE).read_text()
    assert "step 30: cannot keep 30" in told
    assert "'escape' is neither a regular file nor a directory" in told


def test_a_drain_backs_up_the_newest_step_held_here(node: Node) -> None:
    node.commit(20)
    backups = BackupStore(MemoryObjectStore())
    metrics = Events()

    async def body() -> Drained | None:
        incarnation = node.incarnation(ONE_NODE, metrics, backups=backups)
        assert await incarnation.drain() is None  # not restored yet: nothing to drain
        incarnation.start()
        try:
            await until(metrics.restored)
            async with asyncio.timeout(DEADLINE):
                return await incarnation.drain()
        finally:
            await incarnation.stop()

    drained = asyncio.run(body())
    assert drained is not None
    plan = drained.plan
    # One node: no peer to push to; the bucket lacks step 20: upload and commit it.
    assert (plan.step, plan.push, plan.upload) == (20, False, True)
    assert (drained.committed, drained.upload_failed) == (True, False)
    assert backups.read_commit("job", 20) is not None


# --- what the workload is told when it cannot go on ---------------------------------------


def test_a_job_of_many_nodes_without_a_registry_fails_and_says_why(node: Node) -> None:
    metrics = Events()

    async def body() -> None:
        incarnation = node.incarnation(TWO_NODES, metrics)
        incarnation.start()
        try:
            await until(metrics.failed)
        finally:
            await incarnation.stop()

    asyncio.run(body())
    failed = (node.dir / FAILED_FILE).read_text()
    assert "job job rank 0 failed: RestoreBlocked" in failed
    assert "--registry" in failed
    assert "restart the job" in failed
    assert not (node.dir / PRERESTORE_FILE).exists()


def test_what_the_config_assumed_is_told_to_the_workload(node: Node) -> None:
    text = ONE_NODE.replace("framework: orbax\n", "")  # assumed: orbax, with a warning
    config = parse_config(text)
    assert config.assumed  # the premise: this yaml makes the parser assume something
    metrics = Events()

    async def body() -> None:
        incarnation = node.incarnation(text, metrics)
        incarnation.start()
        try:
            await until(metrics.restored)
        finally:
            await incarnation.stop()

    asyncio.run(body())
    told = (node.dir / ERRORS_FILE).read_text()
    for assumption in config.assumed:
        assert assumption in told
    assert "job=job rank=0" in told
    assert ErrorKind.CONFIG in metrics.errors


def test_a_handoff_forgets_every_directorys_incarnation(node: Node) -> None:
    """The root's record and each job directory's (``jobs/<job>/``) go at a node handoff;
    nothing else in the store does."""
    saved = SavedIncarnation("job-name: j\n", "inc", IncarnationPhase.STEADY)
    for name in (STATE_FILE, state_file("trial-a"), state_file("trial-b")):
        save_state(node.store, saved, name)
    (node.store.root / "incarnations.txt").write_text("not ours")
    forget_every_state(node.store)
    for name in (STATE_FILE, state_file("trial-a"), state_file("trial-b")):
        assert load_state(node.store, name) is None
    assert (node.store.root / "incarnations.txt").exists()
