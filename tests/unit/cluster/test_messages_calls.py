"""The servicer's requests checked whole in ``cluster.messages`` (pure: no sockets), and the
ReportProgress answer on the wire. The conversions both ways and each field's check are in
``test_coordinator_convert.py``."""

from __future__ import annotations

import pytest

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2
from mtc_replicator.cluster.messages import (
    MAX_CLUSTER_VIEW_CHARS,
    BadMessage,
    FailedFetch,
    Identity,
    failure_message,
    held_items,
    identity_message,
    join_call,
    progress_call,
    progress_message,
    restore_report_call,
    status_call,
)
from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.coordination import ProgressAnswer
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.policy import LastBackup, Source
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import Fetch, NodeInventory, SourceKey

JOB = "train"
INCARNATION = "inc-1"
ADDRESS = "10.0.0.2:7070"
CONFIG = JobConfig(JOB, Framework.ORBAX, 0, 4, peers_per_node=1)


def digest(n: int) -> str:
    return f"{n:064x}"


def join_request(**fields: object) -> pb.JoinRequest:
    base: dict[str, object] = {
        "job": JOB,
        "rank": 1,
        "incarnation_id": INCARNATION,
        "cluster_view": "{}",
        "address": ADDRESS,
        "items": held_items({ItemId(JOB, 5, 1, 0): digest(1)}),
        "owner": "team-a",
    }
    return pb.JoinRequest(**{**base, **fields})  # type: ignore[arg-type]


def test_a_join_is_checked_into_our_types() -> None:
    asked: list[str] = []

    def limit(owner: str) -> int:
        asked.append(owner)
        return 10

    call = join_call(join_request(address_ranks=[0, 2], address_ranks_given=True), JOB, limit)
    assert asked == ["team-a"]
    assert (call.incarnation, call.cluster_view, call.owner) == (INCARNATION, "{}", "team-a")
    assert call.inventory == NodeInventory(1, ADDRESS, {ItemId(JOB, 5, 1, 0): digest(1)})
    assert call.address_ranks == frozenset({0, 2})
    assert join_call(join_request(), JOB, lambda _: 10).address_ranks is None


def test_a_join_owner_is_judged_before_its_items_are_read() -> None:
    class Foreign(Exception):
        pass

    def refuse(owner: str) -> int:
        raise Foreign(owner)

    hostile = join_request(items=[pb.HeldItem(item=peer_pb2.ItemRef(job="../x"))])
    with pytest.raises(Foreign):
        join_call(hostile, JOB, refuse)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"incarnation_id": ""}, BadMessage),
        ({"address": "not an address"}, BadMessage),
        ({"cluster_view": ""}, BadMessage),
        ({"cluster_view": "x" * (MAX_CLUSTER_VIEW_CHARS + 1)}, BadMessage),
        ({"owner": "Not_A_Namespace"}, BadOwner),
    ],
)
def test_a_hostile_join_is_refused(fields: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        join_call(join_request(**fields), JOB, lambda _: 10)


def test_a_joins_items_over_its_limit_are_refused() -> None:
    with pytest.raises(BadMessage):
        join_call(join_request(), JOB, lambda _: 0)


def test_a_status_request_is_checked_into_our_types() -> None:
    request = pb.RoundStatusRequest(
        job=JOB,
        rank=1,
        incarnation_id=INCARNATION,
        round=3,
        seen_state=pb.RoundStatusResponse.FETCH,
        seen_plan_version=2,
    )
    call = status_call(request)
    assert (call.incarnation, call.seen, call.address_ranks) == (
        INCARNATION,
        (3, pb.RoundStatusResponse.FETCH, 2),
        None,
    )
    with pytest.raises(BadMessage):
        status_call(pb.RoundStatusRequest(job=JOB, incarnation_id="../x"))


def test_a_restore_report_is_checked_against_its_jobs_config() -> None:
    target = ItemId(JOB, 5, 1, 0)
    failure = failure_message(
        FailedFetch(Fetch(Source.PEER, target, 2, digest(1)), corrupt=False), ADDRESS
    )
    request = pb.ReportRestoreRequest(
        job=JOB, rank=1, incarnation_id=INCARNATION, failures=[failure]
    )
    call = restore_report_call(request, JOB, lambda: CONFIG)
    assert call.incarnation == INCARNATION
    assert call.failed == [SourceKey(2, target)]
    assert call.address_ranks is None


def test_a_restore_reports_incarnation_is_checked_before_its_job_is_looked_up() -> None:
    def never() -> JobConfig:
        raise AssertionError("looked up")

    request = pb.ReportRestoreRequest(job=JOB, rank=1, incarnation_id="")
    with pytest.raises(BadMessage):
        restore_report_call(request, JOB, never)


def test_a_progress_report_is_checked_into_our_types() -> None:
    request = pb.ReportProgressRequest(
        job=JOB,
        rank=1,
        incarnation_id=INCARNATION,
        replicated_step=4,
        held_steps=[3, 4],
        reports_holdings=True,
    )
    incarnation, progress = progress_call(request)
    assert incarnation == INCARNATION
    assert progress == Progress(replicated_step=4, held=frozenset({3, 4}))
    bare = pb.ReportProgressRequest(job=JOB, incarnation_id=INCARNATION, address=ADDRESS)
    assert progress_call(bare)[1] == Progress(replicated_step=None, address=ADDRESS)
    with pytest.raises(BadMessage):
        progress_call(pb.ReportProgressRequest(incarnation_id=INCARNATION, address="nope"))


def test_a_progress_answer_goes_on_the_wire_with_only_what_it_has() -> None:
    identity = Identity(JOB, "c1")
    full = ProgressAnswer(
        restorable_step=4,
        backup_step=4,
        addresses={2: ADDRESS},
        keep_steps=frozenset({4, 3}),
        report_every=5,
        last_backup=LastBackup(2, 1000.5),
    )
    wire = progress_message(identity, full)
    assert wire.coordinator == identity_message(identity)
    assert (wire.restorable_step, wire.backup_step, list(wire.keep_steps)) == (4, 4, [3, 4])
    assert (dict(wire.addresses), wire.report_every_seconds) == ({2: ADDRESS}, 5)
    assert (wire.committed_backup_step, wire.committed_backup_at) == (2, 1000.5)
    empty = progress_message(identity, ProgressAnswer(None, None, {}, frozenset(), 30))
    assert not empty.HasField("restorable_step")
    assert not empty.HasField("backup_step")
    assert not empty.HasField("committed_backup_step")
