"""``node.wiring`` and the daemon's side jobs in their own modules: the parts wired once, in
the order they can exist, into a frozen set each consumer takes whole; file events
(``node.file_events``), push admission (``node.served``) and the pin reports of threads
(``node.pin_reports``). A real ``Daemon``'s parts on tmp_path, its gRPC server made but
never bound or started: no sockets, no daemon process."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.core.contract import CONFIG_FILE, ERRORS_FILE, parse_config, save_file_name
from mtc_replicator.node.agent import AgentContext
from mtc_replicator.node.daemon import Daemon
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.pin_reports import PinRefusals
from mtc_replicator.node.served import ServedJobs
from mtc_replicator.node.wiring import Wired
from mtc_replicator.obs.metrics import Metrics
from mtc_replicator.transport.grpc_server import RpcServer

ADVERTISE = "10.0.0.7:7070"
TWO_NODES = "job-name: job\nframework: orbax\nnode-rank: 1\nnodes: 2\nbackup-interval-steps: 10\n"


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    made = Daemon(DaemonOptions(checkpoint_dir=ckpt, listen="127.0.0.1:0"))
    try:
        yield made
    finally:
        made.parts.executor.shutdown()


def wired(daemon: Daemon) -> Wired:
    async def body() -> Wired:
        return daemon.wire(RpcServer(), None, ADVERTISE)

    return asyncio.run(body())


# --- the parts, wired once ----------------------------------------------------------------


def test_every_incarnation_is_handed_the_port_bound_parts_whole(daemon: Daemon) -> None:
    """What exists only once the port is bound (the address, the peer client, the hosted
    coordinators' calls) is in the incarnations' context from its making: none of it is a
    None a consumer must check for."""
    w = wired(daemon)
    ctx = w.ctx
    assert ctx.advertise == ADVERTISE
    assert ctx.peers is w.peers
    assert ctx.coordinator_calls is w.coordinator_calls
    assert (ctx.store, ctx.executor, ctx.pacer) == (
        daemon.parts.store,
        daemon.parts.executor,
        daemon.parts.pacer,
    )
    assert w.supervisor.ctx is ctx
    assert daemon.parts.tenancy.root is w.supervisor


def test_the_context_is_never_changed_after_it_is_made(daemon: Daemon) -> None:
    ctx = wired(daemon).ctx
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.advertise = "elsewhere:1"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.peers = None  # type: ignore[misc,assignment]


def test_the_coordinators_hosted_and_their_calls_are_two_objects_under_two_names(
    daemon: Daemon,
) -> None:
    w = wired(daemon)
    assert isinstance(daemon.parts.host, CoordinatorHost)
    assert isinstance(w.coordinator_calls, Coordinators)
    assert w.coordinator_calls.host is daemon.parts.host


def test_a_job_directory_shares_the_nodes_parts_and_keeps_its_own(
    daemon: Daemon, tmp_path: Path
) -> None:
    w = wired(daemon)
    path = tmp_path / "ckpt" / "jobs" / "trial"
    supervisor = w.job_dir("trial", path, daemon.parts.tenancy.beside("trial"))
    ctx: AgentContext = supervisor.ctx
    assert (ctx.checkpoint_dir, ctx.job_dir) == (path, "trial")
    assert ctx.closed_files is not w.ctx.closed_files
    assert (ctx.peers, ctx.coordinator_calls, ctx.advertise) == (
        w.peers,
        w.coordinator_calls,
        ADVERTISE,
    )
    assert supervisor.opts.checkpoint_dir == path


# --- file events --------------------------------------------------------------------------


def test_events_reach_the_directorys_handshake_and_saves_and_wake_the_loop(
    daemon: Daemon,
) -> None:
    w = wired(daemon)
    root = w.supervisor
    on_event = w.events.of(root)
    save = save_file_name("job", 10, 0, 0)
    on_event(save, True, False)
    assert root.ctx.closed_files == {save}
    assert w.events.wake.is_set()
    on_event(save, False, False)  # written to again after its close
    assert root.ctx.closed_files == set()
    on_event(CONFIG_FILE, True, True)
    assert root.handshake.renamed
    on_event("notes.txt", True, False)  # no save: never kept
    assert root.ctx.closed_files == set()


def test_our_own_writes_wake_nothing(daemon: Daemon) -> None:
    w = wired(daemon)
    on_event = w.events.of(w.supervisor)
    for own in (ERRORS_FILE, "job-s10-n0-w0.restore"):
        on_event(own, True, False)
    assert not w.events.wake.is_set()


# --- push admission -----------------------------------------------------------------------


@dataclasses.dataclass
class Member:
    rank_nodes: dict[int, str] = dataclasses.field(default_factory=lambda: {0: "node-a"})
    answered: bool = True


@dataclasses.dataclass
class Running:
    config: Any
    owner: str = "team-a"
    member: Any = None


def test_a_push_is_admitted_against_the_job_served_and_the_coordinators_word(
    daemon: Daemon,
) -> None:
    running = Running(parse_config(TWO_NODES))
    jobs = ServedJobs(
        lambda job: running if job == "job" else None,  # type: ignore[arg-type,return-value]
        daemon.parts.store,
        daemon.parts.grants,
        None,
    )
    assert jobs.served("other") is None
    before = jobs.served("job")
    assert before is not None
    assert (before.holders, before.bound) == ({}, False)  # no answer from the coordinator yet
    running.member = Member()
    after = jobs.served("job")
    assert after is not None
    assert (after.holders, after.bound, after.owner) == ({0: "node-a"}, True, "team-a")
    assert jobs.readers("job") is None  # no grant: any node of the CA reads


# --- pin reports from threads -------------------------------------------------------------


class Refused(Metrics):
    def __init__(self) -> None:
        self.jobs: list[str] = []
        self.threads: list[str] = []

    def pin_refused(self, job: str) -> None:
        self.jobs.append(job)
        self.threads.append(threading.current_thread().name)


def test_a_pin_refusal_heard_in_a_worker_thread_is_handled_in_the_loop() -> None:
    metrics = Refused()
    refusals = PinRefusals(metrics)

    async def body() -> str:
        _, on_refused = refusals.from_threads(asyncio.get_running_loop())
        await asyncio.to_thread(on_refused, "job", "not an operator's pin")
        for _ in range(10):
            if metrics.jobs:
                break
            await asyncio.sleep(0)
        return threading.current_thread().name

    loop_thread = asyncio.run(body())
    assert metrics.jobs == ["job"]
    assert metrics.threads == [loop_thread]
