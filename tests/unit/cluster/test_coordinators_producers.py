"""Which nodes may have produced each item a rank restores (issue 25, item 2): the coordinator
names them on every source from its rank holders' history (``core.coordination``), they cross
the wire checked (``cluster.messages``), and a restarted daemon's coordinator reads the
history back (``cluster.coordinators`` with ``local.holders_file``). No sockets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import (
    MAX_PRODUCERS,
    BadMessage,
    FailedFetch,
    failure_message,
    item_ref,
    item_source,
    round_state,
    status_message,
)
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.coordination import JobCoordinator, Join, Phase, RankStatus
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.rank_holders import SavedHolders
from mtc_replicator.core.restore_plan import Fetch, NodeInventory
from mtc_replicator.local.holders_file import HoldersFile
from tests.unit.cluster.test_messages import ADDRESSES, IDENTITY, JOB, digest, item, planned
from tests.unit.core.test_coordination import VIEW, config, own

# --- on the wire -----------------------------------------------------------------------------


def test_producers_survive_the_round_trip_known_or_not() -> None:
    target = item(2)
    fetches = [
        Fetch(Source.PEER, target, 3, digest(1), producers=("node2", LEGACY, "node7")),
        Fetch(Source.LOCAL, target, 2, digest(1), producers=()),
        Fetch(Source.BACKUP, target, None, digest(1)),
    ]
    status = RankStatus(1, Phase.FETCH, plan_version=1, step=5, assignments={target: fetches})
    wire = pb.RoundStatusResponse.FromString(
        status_message(IDENTITY, status, ADDRESSES).SerializeToString()
    )
    sources = wire.assignments[0].sources
    assert [s.producers_known for s in sources] == [True, True, False]
    assert round_state(wire, JOB, 2).assignments == {target: fetches}


def test_a_coordinator_without_the_field_names_no_producers() -> None:
    """An older coordinator's plan: the restoring side gets None, not an empty list."""
    source = pb.ItemSource(
        kind=pb.ItemSource.PEER,
        item=item_ref(item(2)),
        manifest_digest=digest(1),
        address="10.0.0.4:7000",
        holder_rank=3,
    )
    (fetch,) = round_state(planned([source]), JOB, 2).assignments[item(2)]
    assert fetch.producers is None


@pytest.mark.parametrize(
    ("names", "known", "error"),
    [
        ([f"node{i}" for i in range(MAX_PRODUCERS + 1)], True, "more than 16"),
        (["n" * 254], True, "is not a node name"),
        (["nöde"], True, "is not a node name"),
        (["node\n1"], True, "is not a node name"),
        (["node1"], False, "given but not known"),
    ],
)
def test_hostile_producers_are_refused(names: list[str], known: bool, error: str) -> None:
    source = item_source(Fetch(Source.PEER, item(2), 3, digest(1)), "10.0.0.4:7000")
    source.producers.extend(names)
    source.producers_known = known
    with pytest.raises(BadMessage, match=error):
        round_state(planned([source]), JOB, 2)


def test_the_longest_names_and_a_shared_certificate_are_accepted() -> None:
    names = ("n" * 253, LEGACY, *(f"node{i}" for i in range(MAX_PRODUCERS - 2)))
    fetch = Fetch(Source.BACKUP, item(2), None, digest(1), producers=names)
    (got,) = round_state(planned([item_source(fetch)]), JOB, 2).assignments[item(2)]
    assert got.producers == names


def test_a_failure_report_carries_no_producers() -> None:
    fetch = Fetch(Source.PEER, item(2), 3, digest(1), producers=("node2",))
    message = failure_message(FailedFetch(fetch, corrupt=True), "10.0.0.4:7000")
    assert not message.source.producers_known
    assert not message.source.producers


# --- the coordinator names them ----------------------------------------------------------------


def _join(rank: int, inc: str, node: str | None, items: dict[ItemId, str]) -> Join:
    return Join(rank, inc, VIEW, NodeInventory(rank, f"127.0.0.1:{7000 + rank}", items), node)


def _round(
    c: JobCoordinator,
    inc: str,
    nodes: list[str | None],
    steps: tuple[int, ...] = (),
    backups: dict[int, CommitRecord] | None = None,
) -> None:
    """Every rank joins as incarnation ``inc<rank>`` from ``nodes[rank]`` and is ready."""
    for r, node in enumerate(nodes):
        c.join(_join(r, f"{inc}{r}", node, own(r, *steps)), backups or {})
    for r, node in enumerate(nodes):
        s = c.status(r, f"{inc}{r}")
        c.report_restore(r, f"{inc}{r}", s.round, s.plan_version, ready=True, node=node)
    assert c.phase is Phase.RELEASED


def _producers(c: JobCoordinator, rank: int, inc: str) -> set[tuple[str, ...] | None]:
    status = c.status(rank, inc)
    assert status.assignments
    return {f.producers for fetches in status.assignments.values() for f in fetches}


def _restart(c: JobCoordinator, inc: str, nodes: list[str | None], steps: tuple[int, ...]) -> None:
    """Rank 0 opens a new round (the job restarted): every rank joins holding ``steps``."""
    c.rank0_incarnation = f"{inc}0"
    for r, node in enumerate(nodes):
        c.join(_join(r, f"{inc}{r}", node, own(r, *steps)), {})
    assert c.phase is Phase.FETCH


def _ready(c: JobCoordinator, inc: str, nodes: list[str | None]) -> None:
    for r, node in enumerate(nodes):
        s = c.status(r, f"{inc}{r}")
        c.report_restore(r, f"{inc}{r}", s.round, s.plan_version, ready=True, node=node)
    assert c.phase is Phase.RELEASED


def test_a_fresh_job_names_the_producers_on_every_source_across_restarts() -> None:
    c = JobCoordinator(config(3), VIEW, "a0")
    _round(c, "a", ["node0", "node1", "node2"])  # a fresh start: nothing anywhere
    # The job restarts from step 5; rank 2 comes back on node 7.
    moved: list[str | None] = ["node0", "node1", "node7"]
    _restart(c, "b", moved, (5,))
    assert _producers(c, 0, "b0") == {("node0",)}
    assert _producers(c, 1, "b1") == {("node1",)}
    # Node 7 has produced nothing of rank 2 yet: only node 2 can have made step 5.
    assert _producers(c, 2, "b2") == {("node2",)}
    _ready(c, "b", moved)
    # Node 7 saves step 10 as rank 2; the job restarts again: both nodes count for it.
    _restart(c, "c", moved, (5, 10))
    assert c.status(2, "c2").step == 10
    assert _producers(c, 2, "c2") == {("node2", "node7")}
    assert _producers(c, 0, "c0") == {("node0",)}


def test_a_coordinator_whose_first_round_saw_items_does_not_know_the_producers() -> None:
    c = JobCoordinator(config(3), VIEW, "a0")
    _round(c, "a", ["node0", "node1", "node2"], (5,))  # items from before this coordinator
    assert _producers(c, 1, "a1") == {None}
    _restart(c, "b", ["node0", "node1", "node2"], (5,))
    assert _producers(c, 1, "b1") == {None}


def test_a_committed_backup_is_an_item_whose_producer_is_not_known() -> None:
    c = JobCoordinator(config(2), VIEW, "a0")
    backup = CommitRecord("job", 5, {f"{r}-0": "0" * 64 for r in range(2)}, 0.0)
    _round(c, "a", ["node0", "node1"], backups={5: backup})
    assert not c.holders.known


def test_without_node_identities_nothing_is_known() -> None:
    c = JobCoordinator(config(2), VIEW, "a0")
    _round(c, "a", [None, None])
    _restart(c, "b", [None, None], (5,))
    assert _producers(c, 1, "b1") == {None}


# --- a restarted daemon's coordinator reads the history back -----------------------------------


def _coordinators(store: Path) -> Coordinators:
    host = CoordinatorHost()
    host.host(config(2), VIEW, rank0_incarnation="a0")
    return Coordinators(host, lambda job: {}, holders=HoldersFile(store))


async def _round_through(
    coordinators: Coordinators, inc: str, nodes: list[str], steps: tuple[int, ...]
) -> None:
    for r, node in enumerate(nodes):
        inventory = NodeInventory(r, f"127.0.0.1:{7000 + r}", own(r, *steps))
        await coordinators.join("job", f"{inc}{r}", VIEW, inventory, node=node)


def test_a_restarted_daemon_keeps_the_history_and_its_completeness(tmp_path: Path) -> None:
    first = _coordinators(tmp_path)
    asyncio.run(_round_through(first, "a", ["node0", "node1"], ()))
    c = first.host.get("job")
    assert c is not None
    for r in range(2):
        s = c.coordinator.status(r, f"a{r}")
        first.report_restore(
            "job", r, f"a{r}", s.round, s.plan_version, ready=True, node=f"node{r}"
        )
    assert c.coordinator.phase is Phase.RELEASED
    # Rank 0's daemon restarts, and the job with it; rank 1 comes back on node 5.
    second = _coordinators(tmp_path)
    second_host = second.host.get("job")
    assert second_host is not None
    second_host.coordinator.rank0_incarnation = "b0"
    asyncio.run(_round_through(second, "b", ["node0", "node5"], (5,)))
    assert _producers(second_host.coordinator, 1, "b1") == {("node1",)}
    for r, node in enumerate(["node0", "node5"]):
        s = second_host.coordinator.status(r, f"b{r}")
        second.report_restore("job", r, f"b{r}", s.round, s.plan_version, ready=True, node=node)
    saved = HoldersFile(tmp_path).load("job", 2)
    assert saved is not None
    assert saved.history[1] == {"node1": 0, "node5": 5}  # node 5 produces from step 5
    assert saved.complete
    # Without the record, a coordinator that first sees items knows nothing of them.
    third = _coordinators(tmp_path / "elsewhere")
    third_host = third.host.get("job")
    assert third_host is not None
    third_host.coordinator.rank0_incarnation = "c0"
    asyncio.run(_round_through(third, "c", ["node0", "node5"], (5,)))
    assert _producers(third_host.coordinator, 1, "c1") == {None}


def test_a_rank_a_restarted_coordinator_adopts_is_recorded_at_once(tmp_path: Path) -> None:
    """Restarted in steady state with a record that lacks rank 1 (an older version's, or a
    shared certificate's binding): the node it adopts produces rank 1's next steps, so the
    record names it before another restart could forget it."""
    records = HoldersFile(tmp_path)
    records.save("job", SavedHolders({0: "node0", 1: LEGACY}, {0: {"node0": 0}, 1: {LEGACY: 0}}))
    host = CoordinatorHost()
    host.host(config(2), VIEW, rank0_incarnation="a0", resume_steady=True)
    coordinators = Coordinators(host, lambda job: {}, holders=records)
    asyncio.run(coordinators.report_progress("job", 1, "a1", Progress(5), node="node1"))
    saved = records.load("job", 2)
    assert saved is not None
    assert saved.nodes == {0: "node0", 1: "node1"}
    assert saved.history[1] == {LEGACY: 0, "node1": 0}  # running: it may have made any step
    assert not saved.complete


def test_a_progress_answer_names_the_node_of_each_rank_asked_for() -> None:
    """What a receiver admits pushes by (``core.admission``): the node bound to each rank
    whose address the report asked for, and no other rank's."""
    c = JobCoordinator(config(3), VIEW, "a0")
    _round(c, "a", ["node0", "node1", "node2"])
    answer = c.report_progress(
        1, "a1", Progress(None, address_ranks=frozenset([0, 2])), now=0.0, node="node1"
    )
    assert answer is not None
    assert dict(answer.nodes) == {0: "node0", 2: "node2"}
    assert set(answer.nodes) <= set(answer.addresses)
