"""The controller's decisions, without an API server (tests/controller runs them against one)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mtc_replicator.controller import plan
from mtc_replicator.tools.render import render
from mtc_replicator.tools.render_config import RenderError


def cr(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "checkpointing.mtc.dev/v1",
        "kind": "CheckpointConfiguration",
        "metadata": {
            "name": "pool-a",
            "namespace": "mtc-system",
            "uid": "1234",
            "generation": 3,
            "resourceVersion": "99",
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
        },
        "spec": {"backupUrl": "gs://bucket/x", "inMemoryVolumeSize": "8Gi", **spec},
        "status": {"observedGeneration": 2},
    }


def test_desired_is_mtc_render_plus_owner_references() -> None:
    want = plan.desired(cr())
    rendered = [o for o in render(cr()) if o["kind"] != "Namespace"]
    assert [o["kind"] for o in want.shared + want.owned] == sorted(
        (o["kind"] for o in rendered), key=[*plan.SHARED_KINDS, *plan.OWNED_KINDS].index
    )
    for obj in want.owned:
        ref = obj["metadata"].pop("ownerReferences")
        assert ref == [
            {
                "apiVersion": "checkpointing.mtc.dev/v1",
                "kind": "CheckpointConfiguration",
                "name": "pool-a",
                "uid": "1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    ds = next(o for o in want.owned if o["kind"] == "DaemonSet")
    fixed = json.loads(ds["metadata"]["annotations"].pop(plan.FIXED_ANNOTATION))
    assert fixed == {
        "spec.runAsGroup": 65532,
        "spec.runAsUser": 65532,
        "spec.tls.perNodeCertificates": False,
    }
    assert not ds["metadata"]["annotations"]
    ds["metadata"].pop("annotations")
    # Otherwise the very objects `mtc render` prints.
    assert sorted(map(json.dumps, want.shared + want.owned)) == sorted(map(json.dumps, rendered))


def test_an_invalid_spec_names_its_field() -> None:
    with pytest.raises(RenderError) as err:
        plan.desired(cr(cloudStorageBucketName="other"))
    assert err.value.field == "spec.backupUrl"


def test_a_fixed_field_changed_is_refused_naming_it() -> None:
    old = plan.fixed_values(plan.desired(cr()).config)
    assert (
        plan.changed_fixed(old, plan.desired(cr(image="x:2", inMemoryVolumeSize="9Gi")).fixed)
        is None
    )
    refusal = plan.changed_fixed(old, plan.desired(cr(runAsGroup=1000)).fixed)
    assert refusal is not None
    assert refusal.reason == plan.FIXED
    assert refusal.message.startswith("spec.runAsGroup cannot change in place (65532 to 1000)")
    assert plan.changed_fixed(None, old) is None  # nothing runs yet


def peer(name: str, created: str, **selector: str) -> plan.Peer:
    return plan.Peer("ns", name, created, {"kubernetes.io/os": "linux", **selector})


def test_the_newer_of_two_overlapping_configurations_is_refused() -> None:
    a = peer("a", "2026-01-01T00:00:00Z", pool="gpu")
    b = peer("b", "2026-01-02T00:00:00Z", pool="gpu", zone="z1")
    # b's selector includes all of a's: every node b selects, a selects too.
    refusal = plan.conflict(b, [a, b], [])
    assert refusal is not None
    assert refusal.reason == plan.CONFLICT
    assert "CheckpointConfiguration ns/a" in refusal.message
    assert plan.conflict(a, [a, b], []) is None  # the older one keeps its nodes


def test_selectors_that_overlap_only_on_a_real_node_conflict_there() -> None:
    a = peer("a", "2026-01-01T00:00:00Z", pool="gpu")
    b = peer("b", "2026-01-02T00:00:00Z", zone="z1")
    assert plan.conflict(b, [a], []) is None
    nodes = [("n1", {"kubernetes.io/os": "linux", "pool": "gpu", "zone": "z1"})]
    refusal = plan.conflict(b, [a], nodes)
    assert refusal is not None
    assert "nodes n1" in refusal.message
    c = peer("c", "2026-01-03T00:00:00Z", pool="tpu")
    assert plan.conflict(c, [a, b], [("n2", {"kubernetes.io/os": "linux", "pool": "tpu"})]) is None


def _by_type(conds: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


@pytest.mark.parametrize(
    ("counts", "ready", "progressing", "degraded"),
    [
        (
            plan.Counts(3, 3, 3, 3),
            ("True", "AllNodesReady"),
            ("False", "RolledOut"),
            ("False", "AsExpected"),
        ),
        (
            plan.Counts(3, 2, 1, 2),
            ("False", "RollingOut"),
            ("True", "RollingOut"),
            ("False", "AsExpected"),
        ),
        (
            plan.Counts(3, 3, 3, 3, current=False),
            ("False", "RollingOut"),
            ("True", "RollingOut"),
            ("False", "AsExpected"),
        ),
        (
            plan.Counts(3, 1, 3, 1),
            ("False", "NodesNotReady"),
            ("False", "RolledOut"),
            ("True", "NodesNotReady"),
        ),
        (
            plan.Counts(),
            ("False", "NoMatchingNodes"),
            ("False", "RolledOut"),
            ("False", "AsExpected"),
        ),
    ],
)
def test_conditions_from_the_daemonset(
    counts: plan.Counts,
    ready: tuple[str, str],
    progressing: tuple[str, str],
    degraded: tuple[str, str],
) -> None:
    got = _by_type(plan.conditions(None, counts))
    assert got == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}


def test_a_refusal_wins_over_the_counts_and_is_remembered_per_generation() -> None:
    refusal = plan.Refusal(plan.INVALID, "spec.s3: only for s3:// backup or registry URLs")
    st = plan.status(4, refusal, plan.Counts(2, 2, 2, 2), [], "T1")
    assert _by_type(st["conditions"])["Degraded"] == ("True", plan.INVALID)
    assert _by_type(st["conditions"])["Ready"] == ("False", plan.INVALID)
    assert st["observedGeneration"] == 4
    assert st["nodes"] == {
        "desired": 2,
        "ready": 2,
        "updated": 2,
        "available": 2,
        "notReady": [],
    }
    assert plan.refusal_in(st, 4) == refusal
    assert plan.refusal_in(st, 5) is None  # a new spec is judged anew


def test_last_transition_time_moves_only_with_the_status() -> None:
    first = plan.status(1, None, plan.Counts(2, 1, 2, 1), [], "T1")
    same = plan.status(1, None, plan.Counts(2, 1, 2, 1), first["conditions"], "T2")
    assert [c["lastTransitionTime"] for c in same["conditions"]] == ["T1"] * 3
    better = plan.status(1, None, plan.Counts(2, 2, 2, 2), same["conditions"], "T3")
    times = {c["type"]: c["lastTransitionTime"] for c in better["conditions"]}
    assert times == {"Ready": "T3", "Progressing": "T1", "Degraded": "T3"}


def test_counts_read_a_daemonsets_status() -> None:
    ds = {
        "metadata": {"generation": 4},
        "status": {
            "observedGeneration": 3,
            "desiredNumberScheduled": 5,
            "numberReady": 4,
            "updatedNumberScheduled": 2,
            "numberAvailable": 4,
        },
    }
    assert plan.counts(ds) == plan.Counts(5, 4, 2, 4, current=False)
    assert plan.counts(None) == plan.Counts()


def test_a_running_stack_keeps_its_nodes_against_one_made_in_the_same_second() -> None:
    # creationTimestamp has whole seconds: two made at once tie, and the running one wins.
    running = plan.Peer("ns", "zeta", "2026-01-01T00:00:00Z", {"pool": "gpu"}, holding=True)
    fresh = plan.Peer("ns", "alpha", "2026-01-01T00:00:00Z", {"pool": "gpu"})
    refusal = plan.conflict(fresh, [running, fresh], [])
    assert refusal is not None
    assert "ns/zeta" in refusal.message
    assert plan.conflict(running, [running, fresh], []) is None


def _pod(node: str | None, *, ready: bool, **status: Any) -> dict[str, Any]:
    spec: dict[str, Any] = (
        {"nodeName": node}
        if node
        else {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": ["n9"]}
                                ]
                            }
                        ]
                    }
                }
            }
        }
    )
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {"name": f"pod-{node}"},
        "spec": spec,
        "status": {"conditions": conditions, **status},
    }


def test_not_ready_names_each_node_and_kubelets_reason() -> None:
    waiting = {
        "name": "replicator",
        "ready": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
    }
    running = {"name": "replicator", "ready": False, "state": {"running": {}}}
    pods = [
        _pod("n1", ready=True),
        _pod("n2", ready=False, containerStatuses=[waiting]),
        _pod("n3", ready=False, containerStatuses=[running]),
        _pod(None, ready=False, phase="Pending"),
    ]
    assert plan.not_ready(pods, now="T0") == [
        {"node": "n2", "reason": "replicator: CrashLoopBackOff: back-off 5m0s", "since": "T0"},
        {"node": "n3", "reason": "replicator: running, readiness probe not passing", "since": "T0"},
        {"node": "n9", "reason": "pod Pending", "since": "T0"},
    ]
    many = [_pod(f"n{i:02d}", ready=False) for i in range(30)]
    assert len(plan.not_ready(many)) == plan.MAX_NOT_READY


def test_a_node_not_ready_long_enough_is_reported_once_per_spell() -> None:
    pods = [_pod("n1", ready=False), _pod("n2", ready=False)]
    first = plan.not_ready(pods, [], "2026-01-01T00:00:00Z")
    assert plan.overdue(first, "2026-01-01T00:04:59Z", 300) == []
    # n1 has been on the list since 00:00; n2 came back after being ready a while.
    later = plan.not_ready(pods, first[:1], "2026-01-01T00:05:00Z")
    assert [e["since"] for e in later] == ["2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"]
    due = plan.overdue(later, "2026-01-01T00:05:00Z", 300)
    assert [e["node"] for e in due] == ["n1"]
    assert later[0]["reported"] is True
    # Still not ready an hour on: not reported again.
    again = plan.not_ready(pods, later, "2026-01-01T01:05:00Z")
    assert [e["node"] for e in plan.overdue(again, "2026-01-01T01:05:00Z", 300)] == ["n2"]


def test_the_release_annotation_is_the_one_the_plugin_reads() -> None:
    from mtc_replicator.csi.release import RELEASE_ANNOTATION

    assert plan.RELEASE_ANNOTATION == RELEASE_ANNOTATION
