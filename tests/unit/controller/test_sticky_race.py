"""A plan made from kopf's index while it lags the controller's own annotations.

The controller annotates a job's pods (plan 1), then the events of those annotations come
in one by one; at the first one the index still shows the other pods unannotated. Planning
again from that view (plan 2) writes other ranks under the same assignment id (a hash of
the pods' uids), while the queued events of plan 1 still carry plan 1's ranks and get
delivered: nodes end up told ranks from two plans (two nodes one rank) and the pods'
annotations disagree with what their nodes were told.
"""

from __future__ import annotations

import copy
from typing import Any

import grpc
import pytest

from mtc_replicator.controller import jobpods, rank_handlers

NS = "ml"
NODES = 3


def _pod(i: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"train-{i}",
            "namespace": NS,
            "uid": f"uid-{i}",
            "labels": {
                jobpods.NODES_LABEL: str(NODES),
                "batch.kubernetes.io/job-name": "train",
                "batch.kubernetes.io/job-completion-index": str(i),
            },
            "annotations": {},
        },
        "spec": {"nodeName": f"n{i}"},
        "status": {"phase": "Running", "podIP": f"10.0.1.{i}"},
    }


def _stack_pod(i: int) -> dict[str, Any]:
    return {
        "metadata": {"name": f"mtc-node-{i}", "namespace": "mtc-system"},
        "spec": {
            "nodeName": f"n{i}",
            "containers": [
                {"name": "replicator", "ports": [{"name": "grpc", "containerPort": 7000}]}
            ],
        },
        "status": {"phase": "Running", "podIP": f"10.0.0.{i}"},
    }


class FakeKube:
    def __init__(self) -> None:
        self.store = {f"train-{i}": _pod(i) for i in range(NODES)}

    def node_stack_pods(self) -> list[dict[str, Any]]:
        return [_stack_pod(i) for i in range(NODES)]

    def job_pods(self, namespace: str) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(p) for p in self.store.values() if p["metadata"]["namespace"] == namespace
        ]

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        self.store[name]["metadata"]["annotations"].update(annotations)

    def view(self, name: str) -> jobpods.JobPod:
        member = jobpods.job_pod(copy.deepcopy(self.store[name]))
        assert member is not None
        return member


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"


class FakeReplicators:
    def __init__(self) -> None:
        self.reachable = True
        self.refuse_assign: set[str] = set()
        self.told: dict[str, int] = {}  # node address -> the rank it was told last

    def status(self, address: str, job: str) -> tuple[str, dict[int, set[int]]]:
        if not self.reachable:
            raise Unavailable()
        i = int(address.split(".")[3].split(":", maxsplit=1)[0])
        return "", {(i + 1) % NODES: {5}}  # node i holds rank i+1 at step 5

    def assign(self, address: str, request: Any) -> list[str]:
        if address in self.refuse_assign:
            raise Unavailable()
        self.told[address] = request.rank
        return []


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeKube, FakeReplicators]:
    k, r = FakeKube(), FakeReplicators()
    monkeypatch.setattr(rank_handlers, "kube", lambda: k)
    monkeypatch.setattr(rank_handlers, "_replicators", r)
    return k, r


def test_a_lagging_index_does_not_make_a_second_plan(
    world: tuple[FakeKube, FakeReplicators],
) -> None:
    k, r = world
    fresh = [k.view(f"train-{i}") for i in range(NODES)]
    rank_handlers.settle(fresh[0], fresh)  # plan 1, by holdings
    plan1 = {n: k.view(n).rank for n in k.store}
    assert sorted(plan1.values()) == [0, 1, 2]
    assert plan1 == {"train-0": 1, "train-1": 2, "train-2": 0}
    events = {n: k.view(n) for n in k.store}  # what the annotations' events will carry

    r.reachable = False  # one Status call fails now: a plan now is by index
    r.refuse_assign = {"10.0.0.2:7000"}  # node n2 does not take its rank yet
    # The event of train-0's annotations, while the index still shows the others bare.
    rank_handlers.settle(events["train-0"], [events["train-0"], fresh[1], fresh[2]])
    # The queued event of train-1's annotations (the index has caught up with plan 1).
    rank_handlers.settle(events["train-1"], list(events.values()))
    # Later the retry timer, with the pods as they are now; n2 takes its rank.
    r.refuse_assign = set()
    now = [k.view(f"train-{i}") for i in range(NODES)]
    rank_handlers.settle(now[2], now)

    told = {addr: rank for addr, rank in r.told.items()}
    assert sorted(told.values()) == [0, 1, 2], f"nodes told {told}"
    final = {n: k.view(n).rank for n in k.store}
    assert final == plan1, "the pods' rank annotations changed after plan 1"
    assert {f"10.0.0.{i}:7000": final[f"train-{i}"] for i in range(NODES)} == told
