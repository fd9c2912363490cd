"""The coordinator's messages: our types to proto and back, and the checks on hostile input.

No sockets: handlers are called directly with a stand-in for the gRPC context, so the
status a request gets is the one the servicer would send.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer, status_for
from mtc_replicator.cluster.coordinators import Coordinators, NotInReleasedRound
from mtc_replicator.cluster.hosting import CoordinatorHost, NotHosted
from mtc_replicator.cluster.messages import (
    MAX_ITEMS,
    MAX_JOIN_STEPS,
    BadMessage,
    FailedFetch,
    RoundState,
    check_address,
    check_incarnation,
    check_job,
    cluster_view_json,
    failure_message,
    held_items,
    inventory_items,
    item_ref,
    item_source,
    join_item_limit,
    round_state,
    source_keys,
    status_message,
)
from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.coordination import JoinRejected, Phase, RankStatus
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch, SourceKey

JOB = "train"
IDENTITY = pb.CoordinatorIdentity(job=JOB, coordinator_id="c1")
ADDRESSES = {0: "10.0.0.1:7000", 1: "node-1.local:7000", 2: "[::1]:7002", 3: "10.0.0.4:7000"}


def digest(n: int) -> str:
    return f"{n:064x}"


def item(rank: int, step: int = 5, worker: int = 0) -> ItemId:
    return ItemId(JOB, step, rank, worker)


def assignments_of_rank_2() -> dict[ItemId, tuple[Fetch, ...]]:
    target = item(2)
    other = item(2, worker=1)
    return {
        target: (
            Fetch(Source.LOCAL, target, 2, digest(1)),
            Fetch(Source.PEER, target, 3, digest(1)),
            Fetch(Source.PEER, item(0), 0, digest(2), equivalent=True),
            Fetch(Source.BACKUP, target, None, digest(1)),
            Fetch(Source.BACKUP, item(0), None, digest(2), equivalent=True),
        ),
        other: (
            Fetch(Source.LOCAL, item(0, worker=1), 2, digest(3), equivalent=True),
            Fetch(Source.PEER, other, 1, digest(4)),
        ),
    }


def through_the_wire(message: pb.RoundStatusResponse) -> pb.RoundStatusResponse:
    return pb.RoundStatusResponse.FromString(message.SerializeToString())


# --- round trips -----------------------------------------------------------------------------


def test_assignments_survive_the_round_trip() -> None:
    status = RankStatus(7, Phase.FETCH, plan_version=3, step=5, assignments=assignments_of_rank_2())
    wire = through_the_wire(status_message(IDENTITY, status, ADDRESSES))
    state = round_state(wire, JOB, 2)
    assert state.round == 7
    assert state.phase is Phase.FETCH
    assert state.plan_version == 3
    assert state.step == 5
    assert state.assignments == {t: list(f) for t, f in assignments_of_rank_2().items()}
    assert state.addresses == ADDRESSES
    assert state.key == (7, pb.RoundStatusResponse.FETCH, 3)
    peer = wire.assignments[0].sources[1]
    assert (peer.kind, peer.holder_rank, peer.address) == (pb.ItemSource.PEER, 3, ADDRESSES[3])


def test_a_fresh_start_is_not_step_zero() -> None:
    released = RankStatus(2, Phase.RELEASED, plan_version=1, step=None)
    wire = through_the_wire(status_message(IDENTITY, released, ADDRESSES))
    assert wire.fresh_start
    assert round_state(wire, JOB, 0).step is None
    step_zero = RankStatus(2, Phase.RELEASED, plan_version=1, step=0)
    wire = through_the_wire(status_message(IDENTITY, step_zero, ADDRESSES))
    assert not wire.fresh_start
    assert round_state(wire, JOB, 0).step == 0


def test_waiting_and_rejoin_carry_no_plan() -> None:
    waiting = RankStatus(1, Phase.WAITING, missing=(1, 3), message="waiting for ranks 1, 3")
    state = round_state(through_the_wire(status_message(IDENTITY, waiting, ADDRESSES)), JOB, 0)
    assert (state.phase, state.missing, state.message) == (Phase.WAITING, (1, 3), waiting.message)
    assert state.step is None
    assert state.addresses == {}  # only a plan publishes the members' addresses
    rejoin = RankStatus(4, None, message="not a member")
    wire = status_message(IDENTITY, rejoin, ADDRESSES)
    assert wire.state == pb.RoundStatusResponse.REJOIN
    assert round_state(wire, JOB, 0).phase is None


def test_inventories_and_failures_round_trip() -> None:
    items = {item(0): digest(1), item(1, step=9): digest(2)}
    assert inventory_items(JOB, held_items(items)) == items
    failures = [
        FailedFetch(Fetch(Source.PEER, item(2), 3, digest(1)), corrupt=True, detail="x" * 5000),
        FailedFetch(Fetch(Source.BACKUP, item(2), None, digest(1)), corrupt=False),
        FailedFetch(Fetch(Source.LOCAL, item(0), 2, digest(2), equivalent=True), corrupt=True),
    ]
    wire = [failure_message(f, "10.0.0.4:7000") for f in failures]
    assert len(wire[0].detail) == 1024
    assert source_keys(wire, JOB, 2, 4) == [f.fetch.key for f in failures]
    assert source_keys(wire[1:2], JOB, 2, 4) == [SourceKey(None, item(2))]


def test_cluster_view_is_canonical_json() -> None:
    config = JobConfig(JOB, Framework.ORBAX, 0, 4, peers_per_node=1)
    view = cluster_view_json(config)
    assert view.startswith('{"assume-data-parallelism":null,"backup-interval-minutes":30,')
    assert " " not in view
    other_rank = JobConfig(JOB, Framework.ORBAX, 3, 4, peers_per_node=2)
    assert cluster_view_json(other_rank) == view  # rank and peers are not cluster-wide


# --- field checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job", ["", "../etc", "a/b", ".hidden", "-x", "a..b", "x" * 128, "job\n", "jöb"]
)
def test_unsafe_job_names_are_refused(job: str) -> None:
    with pytest.raises(BadMessage, match="unsafe job name"):
        check_job(job)


@pytest.mark.parametrize(
    "address",
    ["nohost", "host:0", "host:70000", "a b:1", "[::1:80", ":80", "host:08", "x" * 300 + ":1"],
)
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(BadMessage, match="address"):
        check_address(address)


@pytest.mark.parametrize("incarnation", ["", "x" * 129, "../a", "a b", "-a"])
def test_bad_incarnation_ids_are_refused(incarnation: str) -> None:
    with pytest.raises(BadMessage, match="incarnation_id"):
        check_incarnation(incarnation)


@pytest.mark.parametrize("bad", ["", "ab", "A" * 64, "g" * 64, digest(1) + "0", " " + "a" * 63])
def test_bad_digests_are_refused(bad: str) -> None:
    held = [pb.HeldItem(item=item_ref(item(0)), manifest_digest=bad)]
    with pytest.raises(BadMessage, match="64 lowercase hex"):
        inventory_items(JOB, held)


def test_inventories_are_bounded_and_of_one_job() -> None:
    one = pb.HeldItem(item=item_ref(item(0)), manifest_digest=digest(1))
    with pytest.raises(BadMessage, match=f"at most {MAX_ITEMS}"):
        inventory_items(JOB, [one] * (MAX_ITEMS + 1))
    foreign = pb.HeldItem(item=item_ref(ItemId("other", 5, 0, 0)), manifest_digest=digest(1))
    with pytest.raises(BadMessage, match="job 'other'"):
        inventory_items(JOB, [foreign])
    twice = pb.HeldItem(item=item_ref(item(0)), manifest_digest=digest(2))
    with pytest.raises(BadMessage, match="listed twice"):
        inventory_items(JOB, [one, twice])
    assert inventory_items(JOB, [one, one]) == {item(0): digest(1)}


def test_a_joins_items_are_bounded_by_its_jobs_size() -> None:
    """Every rank's workers at ``MAX_JOIN_STEPS`` steps, at most ``MAX_ITEMS``: a 4-node job's
    join of 257 items is refused before any is converted."""
    small = JobConfig(JOB, Framework.ORBAX, 0, 4, peers_per_node=1, workers_per_node=2)
    assert join_item_limit(small) == 4 * 2 * MAX_JOIN_STEPS
    huge = JobConfig(JOB, Framework.ORBAX, 0, 4096, peers_per_node=1, workers_per_node=8)
    assert join_item_limit(huge) == MAX_ITEMS
    # A whole held set of a real node fits: its own and three peers' items of 64 steps.
    held = [
        pb.HeldItem(item=item_ref(ItemId(JOB, s, r, w)), manifest_digest=digest(1))
        for s in range(MAX_JOIN_STEPS)
        for r in range(4)
        for w in range(2)
    ]
    assert len(inventory_items(JOB, held, join_item_limit(small))) == len(held)
    bad = [pb.HeldItem(item=item_ref(item(0)), manifest_digest="not a digest")] * (len(held) + 1)
    with pytest.raises(BadMessage, match=f"{len(held) + 1} entries, at most {len(held)}"):
        inventory_items(JOB, bad, join_item_limit(small))  # counted before any is checked


def test_failures_name_real_sources() -> None:
    unspecified = pb.FailedSource(source=pb.ItemSource(item=item_ref(item(0))))
    with pytest.raises(BadMessage, match="unknown source kind"):
        source_keys([unspecified], JOB, 0, 4)
    far = failure_message(FailedFetch(Fetch(Source.PEER, item(0), 9, digest(1)), corrupt=False))
    with pytest.raises(BadMessage, match="holder rank 9"):
        source_keys([far], JOB, 0, 4)
    with pytest.raises(BadMessage, match="at most"):
        source_keys([far] * (MAX_ITEMS + 1), JOB, 0, 16)


# --- hostile answers -------------------------------------------------------------------------


def planned(sources: list[pb.ItemSource], target: ItemId | None = None) -> pb.RoundStatusResponse:
    return pb.RoundStatusResponse(
        coordinator=IDENTITY,
        round=1,
        state=pb.RoundStatusResponse.FETCH,
        step=5,
        plan_version=1,
        assignments=[pb.ItemAssignment(target=item_ref(target or item(2)), sources=sources)],
    )


def good_peer() -> pb.ItemSource:
    return item_source(Fetch(Source.PEER, item(2), 3, digest(1)), "10.0.0.4:7000")


def test_an_answer_with_a_well_formed_plan_is_accepted() -> None:
    state = round_state(planned([good_peer()]), JOB, 2)
    assert state.assignments == {item(2): [Fetch(Source.PEER, item(2), 3, digest(1))]}
    assert state.addresses == {3: "10.0.0.4:7000"}


@pytest.mark.parametrize(
    ("change", "target", "error"),
    [
        ({"kind": pb.ItemSource.KIND_UNSPECIFIED}, None, "unknown source kind"),
        ({"manifest_digest": "f" * 63}, None, "64 lowercase hex"),
        ({"address": "evil"}, None, "needs host:port"),
        ({"holder_rank": 2}, None, "sent to itself as a peer"),
        ({"equivalent": True}, None, "is not an equivalent"),
        ({"item": item_ref(item(0))}, None, "is not the item itself"),
        ({"item": item_ref(item(2, step=4))}, None, "is not the item itself"),
        ({"item": item_ref(ItemId("other", 5, 2, 0))}, None, "job 'other'"),
        ({}, item(1), "not for rank 2"),
        ({}, item(2, step=6), "not for rank 2, step 5"),
        ({"kind": pb.ItemSource.BACKUP, "after_restore": True}, None, "backup source cannot"),
        ({"kind": pb.ItemSource.LOCAL, "after_restore": True}, None, "local source cannot"),
    ],
)
def test_hostile_plans_are_refused(
    change: Mapping[str, Any], target: ItemId | None, error: str
) -> None:
    source = good_peer()
    for name, value in change.items():
        if name == "item":
            source.item.CopyFrom(value)
        else:
            setattr(source, name, value)
    with pytest.raises(BadMessage, match=error):
        round_state(planned([source], target), JOB, 2)


def test_a_pending_peer_source_round_trips() -> None:
    pending = Fetch(Source.PEER, item(0), 0, digest(1), equivalent=True, pending=True)
    backup = Fetch(Source.BACKUP, item(0), None, digest(1), equivalent=True)
    message = planned([item_source(pending, "10.0.0.1:7000"), item_source(backup)])
    assert message.assignments[0].sources[0].after_restore
    assert not message.assignments[0].sources[1].after_restore
    state = round_state(message, JOB, 2)
    assert state.assignments == {item(2): [pending, backup]}
    # A failed pending pull is reported as the copy it is: the holder's, of that item.
    keys = source_keys([failure_message(FailedFetch(pending, corrupt=False))], JOB, 2, 4)
    assert keys == [SourceKey(0, item(0))]


def test_an_answer_giving_a_rank_two_addresses_is_refused() -> None:
    answer = planned([good_peer()])
    answer.addresses[3] = "10.0.0.9:7000"
    with pytest.raises(BadMessage, match="two addresses"):
        round_state(answer, JOB, 2)
    with pytest.raises(BadMessage, match="no source"):
        round_state(planned([]), JOB, 2)


def test_round_state_key_tracks_what_a_long_poll_compares() -> None:
    assert RoundState(3, None).key == (3, pb.RoundStatusResponse.REJOIN, 0)
    assert RoundState(3, Phase.WAITING).key != RoundState(3, Phase.FETCH).key


# --- the servicer's checks, without sockets --------------------------------------------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Context:
    """What the handlers use of ``grpc.aio.ServicerContext``."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)


CONFIG = JobConfig(JOB, Framework.ORBAX, 0, 4, peers_per_node=1, backup_interval=BackupInterval())


def servicer(hosted: bool = True) -> tuple[CoordinatorServicer, list[str]]:
    listed: list[str] = []

    def backups_for(job: str) -> dict[int, CommitRecord]:
        listed.append(job)
        return {}

    host = CoordinatorHost()
    if hosted:
        host.host(CONFIG, cluster_view_json(CONFIG))
    return CoordinatorServicer(Coordinators(host, backups_for)), listed


def join_request(**change: Any) -> pb.JoinRequest:
    request = pb.JoinRequest(
        job=JOB,
        rank=1,
        incarnation_id="inc1",
        cluster_view=cluster_view_json(CONFIG),
        address="10.0.0.2:7000",
        items=held_items({item(1): digest(1)}),
    )
    for name, value in change.items():
        if name == "items":
            del request.items[:]
            request.items.extend(value)
        else:
            setattr(request, name, value)
    return request


def call_join(s: CoordinatorServicer, request: pb.JoinRequest) -> Aborted | pb.JoinResponse:
    async def go() -> pb.JoinResponse:
        return await s.Join(request, Context())  # type: ignore[arg-type]

    try:
        return asyncio.run(go())
    except Aborted as exc:
        return exc


HUGE = [
    pb.HeldItem(item=item_ref(item(1, step=s)), manifest_digest=digest(s)) for s in range(70000)
]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"items": HUGE}, f"at most {4 * MAX_JOIN_STEPS}"),  # 4 nodes, 1 worker each
        ({"items": [pb.HeldItem(item=item_ref(item(1)), manifest_digest="0" * 63)]}, "digest"),
        ({"job": "../../etc"}, "unsafe job name"),
        ({"job": ""}, "unsafe job name"),
        ({"address": "10.0.0.2"}, "host:port"),
        ({"address": "10.0.0.2:99999"}, "port 1-65535"),
        ({"incarnation_id": ""}, "incarnation_id"),
        ({"incarnation_id": "i" * 4096}, "incarnation_id"),
        ({"cluster_view": "v" * 5000}, "cluster_view"),
        ({"rank": 4}, "rank 4 is out of range for job "),
    ],
)
def test_hostile_joins_get_invalid_argument_before_anything_runs(
    change: Mapping[str, Any], error: str
) -> None:
    s, listed = servicer()
    answer = call_join(s, join_request(**change))
    assert isinstance(answer, Aborted)
    assert answer.code is grpc.StatusCode.INVALID_ARGUMENT, answer
    assert error in answer.details
    assert listed == []  # refused before the backups were listed
    assert s.host.get(JOB) is not None
    coordinator = s.host.get(JOB)
    assert coordinator is not None
    assert coordinator.coordinator.members == {}


def test_a_bad_request_for_an_unhosted_job_is_invalid_before_not_found() -> None:
    s, _ = servicer(hosted=False)
    bad = call_join(s, join_request(address="nope"))
    assert isinstance(bad, Aborted)
    assert bad.code is grpc.StatusCode.INVALID_ARGUMENT
    good = call_join(s, join_request())
    assert isinstance(good, Aborted)
    assert good.code is grpc.StatusCode.NOT_FOUND
    assert f"job {JOB}" in good.details


def test_a_valid_join_is_admitted() -> None:
    s, listed = servicer()
    answer = call_join(s, join_request())
    assert isinstance(answer, pb.JoinResponse)
    assert answer.round == 1
    assert answer.coordinator.job == JOB
    assert answer.coordinator.coordinator_id == s.host.coordinator_id(JOB)
    assert listed == [JOB]


def test_one_function_maps_errors_to_status_codes() -> None:
    assert status_for(BadMessage("x"))[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert status_for(NotHosted("x"))[0] is grpc.StatusCode.NOT_FOUND
    assert status_for(JoinRejected("x"))[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(NotInReleasedRound("x"))[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(RuntimeError())[0] is grpc.StatusCode.INTERNAL
    assert status_for(RuntimeError())[1] == "RuntimeError"


def test_a_report_of_more_failures_than_a_join_may_list_is_refused_first() -> None:
    """A plan gives a rank at most a few sources per item: a report of 257 failed copies
    in a 4-node job is refused before any is converted, and nothing is listed."""
    s, listed = servicer()
    failure = failure_message(FailedFetch(Fetch(Source.PEER, item(1), 2, digest(1)), corrupt=False))
    request = pb.ReportRestoreRequest(
        job=JOB,
        rank=1,
        incarnation_id="inc1",
        round=1,
        plan_version=1,
        failures=[failure] * (4 * MAX_JOIN_STEPS + 1),
    )

    async def go() -> pb.ReportRestoreResponse:
        return await s.ReportRestore(request, Context())  # type: ignore[arg-type]

    with pytest.raises(Aborted) as refused:
        asyncio.run(go())
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"failures: {4 * MAX_JOIN_STEPS + 1} entries, at most {4 * MAX_JOIN_STEPS}" in (
        refused.value.details
    )
    assert listed == []


def test_node_names_from_a_progress_answer_are_checked() -> None:
    from mtc_replicator.cluster.messages import BadMessage, node_map

    assert node_map({1: "node-1", 2: ""}) == {1: "node-1", 2: ""}
    for bad in ({1: "x" * 300}, {1: "node\n1"}, {1: "nöde"}):
        with pytest.raises(BadMessage, match="not a node name"):
            node_map(bad)
