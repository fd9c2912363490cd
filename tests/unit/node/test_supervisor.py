"""``node.supervisor`` without a daemon: how it judges the handshakes written in a real
CHECKPOINT_DIR, empties the store when the node changes hands, and resumes the incarnation
a restart interrupted. A real ``LocalStore``, owner file and handshake file on tmp_path, the
one-node job's coordinator in process; no sockets, and no wait but on the job's own events.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.core.contract import CONFIG_FILE, FAILED_FILE, JobConfig, marker_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.settle import SettleRules
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.local.store_owner import read_store_owner, write_store_owner
from mtc_replicator.node.agent import AgentContext, restore_saved
from mtc_replicator.node.bucket_probes import BucketProbes
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.reclaim import ForeignItems
from mtc_replicator.node.saved_incarnation import (
    IncarnationPhase,
    SavedIncarnation,
    load_state,
    save_state,
)
from mtc_replicator.node.supervisor import HANDED, Supervisor
from mtc_replicator.obs.metrics import ErrorKind, Metrics
from mtc_replicator.transport.peer_client import PeerClient

ONE_NODE = "job-name: job\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-steps: 10\n"
INVALID = ONE_NODE.replace("nodes: 1", "nodes: many")
OWNER = "team-a"
DEADLINE = 5.0
"""Seconds any one wait of these tests may take (each is well under one here)."""
T = TypeVar("T")


class Events(Metrics):
    """The metrics the supervisor and its incarnation count, as events to wait on."""

    def __init__(self) -> None:
        self.restored = asyncio.Event()
        self.errors: list[ErrorKind] = []

    def restore_done(self, job: str, step: int | None, seconds: float) -> None:
        self.restored.set()

    def error(self, kind: ErrorKind) -> None:
        self.errors.append(kind)


class Beside:
    """The job directories beside this one: a refusal to give, and the handoffs seen."""

    def __init__(self, refusal: tuple[str, str] | None = None) -> None:
        self._refusal = refusal
        self.ended = 0

    def refusal(self, config: JobConfig) -> tuple[str, str] | None:
        return self._refusal

    def views(self) -> Collection[str]:
        return ()

    def jobs(self) -> Collection[str]:
        return ()

    async def end(self) -> None:
        self.ended += 1


class Node:
    """One node's CHECKPOINT_DIR, store and owner file, and what its daemon hands a
    supervisor."""

    def __init__(self, tmp_path: Path, executor: ThreadPoolExecutor) -> None:
        self.dir = tmp_path / "checkpoint"
        self.dir.mkdir()
        self.store = LocalStore(self.dir, tmp_path / "store")
        self.store.open()
        self.owner_file = tmp_path / "csi" / "owner.json"
        self.tmp_path = tmp_path
        self.executor = executor
        self.host = CoordinatorHost()
        self.metrics = Events()
        self.foreign = ForeignItems(self.store, None)
        self.beside = Beside()
        self.ctx = AgentContext(
            checkpoint_dir=self.dir,
            store=self.store,
            backups=None,
            executor=executor,
            peers=PeerClient(executor=executor),  # no job here has peers: never dialled
            coordinator_calls=Coordinators(self.host, lambda job: {}),
            advertise="127.0.0.1:7070",
            rescan_seconds=0.05,
            metrics=self.metrics,
            foreign=self.foreign,
        )

    def supervisor(self) -> Supervisor:
        """Called in the event loop, as the daemon does. The settle times are zero: a file
        is judged at its first read (``core.settle`` has its own tests)."""
        opts = DaemonOptions(
            checkpoint_dir=self.dir,
            listen="127.0.0.1:0",
            owner_file=self.owner_file,
            settle_seconds=0.0,
            config_wait_seconds=0.0,
            drain_seconds=0.0,
        )
        supervisor = Supervisor(
            opts,
            self.ctx,
            foreign=self.foreign,
            buckets=BucketProbes(None, None),
            host=self.host,
            registry=None,
            advertise=lambda: None,
            stop=asyncio.Event(),
            neighbours=self.beside,
        )
        supervisor.settle_rules = SettleRules(0.0, 0.0, valid_settle=0.0, invalid_settle=0.0)
        return supervisor

    def publish_owner(self, namespace: str) -> None:
        """What the CSI plugin writes at NodePublishVolume (atomically)."""
        body = {
            "namespace": namespace,
            "pod": "trainer-0",
            "pod_uid": "0f5e3a9c-1d2b-4c3d-9e8f-7a6b5c4d3e2f",
            "service_account": "default",
            "published_at": time.time(),
        }
        self.owner_file.parent.mkdir(exist_ok=True)
        tmp = self.owner_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.rename(self.owner_file)

    def hand_over(self, supervisor: Supervisor, text: str) -> None:
        """A client's handshake: renamed into place, as the watcher then tells it."""
        tmp = self.dir / f"{CONFIG_FILE}.tmp"
        tmp.write_text(text)
        tmp.rename(self.dir / CONFIG_FILE)
        supervisor.handshake.event(finished=True, renamed=True)

    def commit(self, step: int, job: str = "job") -> ItemId:
        """A step held in the store, as a previous incarnation left it."""
        item = ItemId(job, step, 0, 0)
        data = self.tmp_path / f"src-{job}-{step}"
        (data / "state").mkdir(parents=True)
        (data / "state" / "shard").write_bytes(os.urandom(1000))
        manifest = build_manifest(item, data)
        staged = self.store.new_staging()
        os.rename(data, staged / "data")
        self.store.commit_staged(staged, manifest)
        return item

    def items(self) -> set[ItemId]:
        return {item for job in ("job", "other") for item in self.store.manifests(job)}

    def failed(self) -> str:
        return (self.dir / FAILED_FILE).read_text()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="test-io") as executor:
        node = Node(tmp_path, executor)
        node.publish_owner(OWNER)
        yield node


def run(node: Node, body: Callable[[Supervisor], Awaitable[T]]) -> T:
    """``body`` with a new supervisor, its running job stopped after, whatever happened."""

    async def main() -> T:
        supervisor = node.supervisor()
        try:
            return await body(supervisor)
        finally:
            await supervisor.end_incarnation()

    return asyncio.run(main())


async def until(event: asyncio.Event) -> None:
    async with asyncio.timeout(DEADLINE):
        await event.wait()


async def accepted(node: Node, supervisor: Supervisor) -> None:
    """A handshake accepted and its one-node restore round done."""
    node.hand_over(supervisor, ONE_NODE)
    await supervisor.check_config()
    assert supervisor.incarnation is not None
    await until(node.metrics.restored)


# --- judging a handshake ------------------------------------------------------------------


def test_a_handshake_is_accepted_persisted_consumed_and_its_coordinator_hosted(
    node: Node,
) -> None:
    async def body(supervisor: Supervisor) -> None:
        await accepted(node, supervisor)
        running = supervisor.incarnation
        assert running is not None
        assert running.config.job_name == "job"
        assert running.owner == OWNER  # read from the owner file at the handshake
        assert node.host.get("job") is not None  # rank 0 of a one-node job: in process
        assert not (node.dir / CONFIG_FILE).exists()  # consumed: the client's cue
        assert (node.dir / marker_name("job", 0, 0, 0)).is_file()  # the fresh start's marker
        assert load_state(node.store, node.ctx.state_name) == SavedIncarnation(
            ONE_NODE, running.id, IncarnationPhase.STEADY
        )

    run(node, body)
    assert load_state(node.store, node.ctx.state_name) is None  # ended: nothing to resume
    assert node.foreign.configs.load("job") == ONE_NODE  # kept for `mtc upload`
    assert not (node.dir / FAILED_FILE).exists()


def test_an_invalid_handshake_is_refused_and_nothing_committed_is_touched(node: Node) -> None:
    held = node.commit(10)

    async def body(supervisor: Supervisor) -> None:
        node.hand_over(supervisor, INVALID)
        await supervisor.check_config()
        assert supervisor.incarnation is None

    run(node, body)
    failed = node.failed()
    assert "nodes" in failed
    assert f"Fix {CONFIG_FILE} and write it again" in failed
    assert "committed checkpoints on this node were not touched" in failed
    assert not (node.dir / CONFIG_FILE).exists()
    assert node.items() == {held}
    assert node.metrics.errors == [ErrorKind.CONFIG]
    assert node.host.get("job") is None


def test_a_handshake_that_is_a_symlink_is_refused_unread_and_removed(node: Node) -> None:
    target = node.tmp_path / "elsewhere.yaml"
    target.write_text(ONE_NODE)

    async def body(supervisor: Supervisor) -> None:
        (node.dir / CONFIG_FILE).symlink_to(target)
        supervisor.handshake.event(finished=True, renamed=True)
        await supervisor.check_config()
        assert supervisor.incarnation is None

    run(node, body)
    assert f"{CONFIG_FILE} is a symlink, not a regular file" in node.failed()
    assert not (node.dir / CONFIG_FILE).is_symlink()
    assert target.read_text() == ONE_NODE  # what it named is not the daemon's to remove


def test_the_same_handshake_after_the_markers_is_a_restart(node: Node) -> None:
    """Once its markers are out, the job's handshake again is the workload restarting
    (``core.repeats``): a new incarnation, which restores again; the first one stops."""

    async def body(supervisor: Supervisor) -> None:
        await accepted(node, supervisor)
        first = supervisor.incarnation
        assert first is not None
        node.metrics.restored.clear()
        node.hand_over(supervisor, ONE_NODE)
        await supervisor.check_config()
        second = supervisor.incarnation
        assert second is not None
        assert second.id != first.id
        assert not first.repeats.alive
        await until(node.metrics.restored)
        assert load_state(node.store, node.ctx.state_name) == SavedIncarnation(
            ONE_NODE, second.id, IncarnationPhase.STEADY
        )

    run(node, body)
    assert not (node.dir / FAILED_FILE).exists()


def test_an_empty_handshake_ends_the_running_job(node: Node) -> None:
    async def body(supervisor: Supervisor) -> None:
        await accepted(node, supervisor)
        node.hand_over(supervisor, "")  # client.finish_job
        await supervisor.check_config()
        assert supervisor.incarnation is None
        assert not (node.dir / CONFIG_FILE).exists()  # the client's cue that it is over
        assert load_state(node.store, node.ctx.state_name) is None

    run(node, body)


def test_a_handshake_the_node_refuses_is_refused_with_its_remedy(node: Node) -> None:
    node.beside = Beside(("job job runs in jobs/job/ already", "Use another job name"))

    async def body(supervisor: Supervisor) -> None:
        node.hand_over(supervisor, ONE_NODE)
        await supervisor.check_config()
        assert supervisor.incarnation is None

    run(node, body)
    assert node.failed().startswith("job job runs in jobs/job/ already.\nUse another job name;")
    assert node.host.get("job") is None  # refused before rank 0's coordinator was hosted


# --- a node that changes hands ------------------------------------------------------------


def test_the_first_owner_is_recorded_and_keeps_the_store(node: Node) -> None:
    held = node.commit(10)
    owner = run(node, lambda supervisor: supervisor.owner_now())
    assert owner == OWNER
    assert read_store_owner(node.store.root) == OWNER
    assert node.items() == {held}
    assert node.beside.ended == 0


def test_a_node_handed_to_another_namespace_ends_the_job_and_empties_the_store(
    node: Node,
) -> None:
    node.commit(10, "other")

    async def body(supervisor: Supervisor) -> str:
        await accepted(node, supervisor)
        marker = node.dir / marker_name("job", 0, 0, 0)
        assert marker.exists()
        node.commit(20)
        node.publish_owner("team-b")
        owner = await supervisor.owner_now()
        assert supervisor.incarnation is None
        assert not marker.exists()  # nothing of the old owner's stays reachable
        return owner

    assert run(node, body) == "team-b"
    assert node.items() == set()  # every job's items, the running one's and the others'
    assert load_state(node.store, node.ctx.state_name) is None
    assert read_store_owner(node.store.root) == "team-b"  # recorded last, once emptied
    assert node.beside.ended == 1  # the job directories beside it ended first


def test_an_unreadable_owner_file_touches_nothing(node: Node) -> None:
    held = node.commit(10)
    write_store_owner(node.store.root, OWNER)
    node.owner_file.write_text("{not json")

    async def body(supervisor: Supervisor) -> None:
        with pytest.raises(BadOwner, match="malformed"):
            await supervisor.owner_now()

    run(node, body)
    assert node.items() == {held}
    assert read_store_owner(node.store.root) == OWNER


def test_a_handshake_on_an_unreadable_owner_file_is_refused(node: Node) -> None:
    node.owner_file.unlink()

    async def body(supervisor: Supervisor) -> None:
        node.hand_over(supervisor, ONE_NODE)
        await supervisor.check_config()
        assert supervisor.incarnation is None

    run(node, body)
    assert "cannot tell which namespace this node's pod belongs to" in node.failed()
    assert not (node.dir / CONFIG_FILE).exists()


# --- resuming after a restart -------------------------------------------------------------


def saved(node: Node, phase: IncarnationPhase = IncarnationPhase.STEADY) -> None:
    save_state(
        node.store, SavedIncarnation(ONE_NODE, "0123456789abcdef", phase), node.ctx.state_name
    )


def test_a_saved_incarnation_is_resumed_with_its_coordinator(node: Node) -> None:
    write_store_owner(node.store.root, OWNER)
    saved(node)

    async def body(supervisor: Supervisor) -> None:
        resumed = restore_saved(node.ctx)
        assert resumed is not None
        await supervisor.resume(resumed)
        assert supervisor.incarnation is resumed
        assert resumed.id == "0123456789abcdef"
        assert resumed.owner == OWNER
        assert node.host.get("job") is not None

    run(node, body)


def test_no_resume_once_the_node_changed_hands_while_the_daemon_was_down(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    write_store_owner(node.store.root, "team-b")
    node.commit(10)
    saved(node)

    async def body(supervisor: Supervisor) -> None:
        resumed = restore_saved(node.ctx)
        assert resumed is not None
        await supervisor.resume(resumed)
        assert supervisor.incarnation is None

    run(node, body)
    assert HANDED in caplog.text
    assert node.items() == set()
    assert load_state(node.store, node.ctx.state_name) is None
    assert node.host.get("job") is None
    assert not (node.dir / FAILED_FILE).exists()  # the new owner's pod did nothing wrong


def test_no_resume_on_an_unreadable_owner_file_and_the_workload_is_told(node: Node) -> None:
    write_store_owner(node.store.root, OWNER)
    held = node.commit(10)
    saved(node)
    node.owner_file.write_text("{not json")

    async def body(supervisor: Supervisor) -> None:
        resumed = restore_saved(node.ctx)
        assert resumed is not None
        await supervisor.resume(resumed)
        assert supervisor.incarnation is None

    run(node, body)
    assert node.failed().startswith("mtc-replicator: not resuming job job: ")
    assert "Restart the job" in node.failed()
    assert load_state(node.store, node.ctx.state_name) is None  # not tried again at each start
    assert node.items() == {held}
