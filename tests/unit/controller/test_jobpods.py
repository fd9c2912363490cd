"""controller.jobpods and the pure parts of controller.sticky: a training pod's job and index
from each workload kind's own labels, a job's pods ready or waiting, the fallback."""

from __future__ import annotations

from typing import Any

import pytest

from mtc_replicator.controller import jobpods, sticky
from mtc_replicator.controller.jobpods import BadPod, JobPod, group, job_pod


def pod(
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    *,
    node: str = "n1",
    ip: str = "10.0.0.1",
    owners: list[dict[str, Any]] | None = None,
    phase: str = "Running",
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": f"uid-{name}",
            "labels": {jobpods.NODES_LABEL: "4", **labels},
            "annotations": annotations or {},
            "ownerReferences": owners or [],
        },
        "spec": {"nodeName": node},
        "status": {"phase": phase, "podIP": ip},
    }


def test_each_workload_kind_gives_job_and_index() -> None:
    js = job_pod(
        pod(
            "llm-workers-1-0-abcde",
            {"jobset.sigs.k8s.io/jobset-name": "llm"},
            {
                "jobset.sigs.k8s.io/job-index": "1",
                "jobset.sigs.k8s.io/replicatedjob-replicas": "2",
                "batch.kubernetes.io/job-completion-index": "1",
            },
        )
    )
    assert js is not None
    assert (js.job, js.index, js.nodes, js.mtc_job) == ("jobset/llm", 3, 4, "llm")
    job = job_pod(
        pod(
            "t-2-x",
            {"batch.kubernetes.io/job-name": "t"},
            {"batch.kubernetes.io/job-completion-index": "2"},
        )
    )
    assert job is not None
    assert (job.job, job.index) == ("job/t", 2)
    sts = job_pod(pod("db-3", {}, owners=[{"kind": "StatefulSet", "name": "db"}]))
    assert sts is not None
    assert (sts.job, sts.index) == ("statefulset/db", 3)
    named = job_pod(
        pod(
            "db-1",
            {"apps.kubernetes.io/pod-index": "1"},
            {jobpods.JOB_ANNOTATION: "train-run-7"},
            owners=[{"kind": "StatefulSet", "name": "db"}],
        )
    )
    assert named is not None
    assert (named.index, named.mtc_job) == (1, "train-run-7")


def test_a_pytorchjob_master_is_rank_0_and_workers_follow() -> None:
    kf = "training.kubeflow.org/"
    master = job_pod(
        pod(
            "pt-master-0",
            {kf + "job-name": "pt", kf + "replica-type": "master", kf + "replica-index": "0"},
        )
    )
    workers = [
        job_pod(
            pod(
                f"pt-worker-{i}",
                {
                    kf + "job-name": "pt",
                    kf + "replica-type": "worker",
                    kf + "replica-index": str(i),
                },
            )
        )
        for i in range(3)
    ]
    members = [m for m in (master, *workers) if m is not None]
    g = group(members)
    assert [(p.name, p.index) for p in g.pods] == [
        ("pt-master-0", 0),
        ("pt-worker-0", 1),
        ("pt-worker-1", 2),
        ("pt-worker-2", 3),
    ]
    assert g.ready


def test_pods_that_do_not_take_part() -> None:
    plain = pod("x", {})
    del plain["metadata"]["labels"][jobpods.NODES_LABEL]
    assert job_pod(plain) is None  # no opt-in label
    ending = pod(
        "t-0",
        {"batch.kubernetes.io/job-name": "t"},
        {"batch.kubernetes.io/job-completion-index": "0"},
        phase="Failed",
    )
    assert job_pod(ending) is None


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (pod("lonely", {}), "belongs to no JobSet"),
        (
            pod(
                "t-0",
                {"batch.kubernetes.io/job-name": "t"},
                {"batch.kubernetes.io/job-completion-index": "x"},
            ),
            "not a number",
        ),
        (
            pod(
                "t-9",
                {"batch.kubernetes.io/job-name": "t"},
                {"batch.kubernetes.io/job-completion-index": "9"},
            ),
            "index 9 but the job has 4",
        ),
        (
            pod(
                "t-0",
                {"batch.kubernetes.io/job-name": "t"},
                {"batch.kubernetes.io/job-completion-index": "0"},
                ip="not-an-ip",
            ),
            "not an IP",
        ),
        (
            pod(
                "j",
                {"jobset.sigs.k8s.io/jobset-name": "j"},
                {
                    "jobset.sigs.k8s.io/replicatedjob-replicas": "3",
                    "batch.kubernetes.io/job-completion-index": "0",
                },
            ),
            "do not split",
        ),
    ],
)
def test_a_pod_that_opts_in_but_cannot_be_read_says_why(body: dict[str, Any], why: str) -> None:
    with pytest.raises(BadPod, match=why):
        job_pod(body)


def members(n: int = 4, **over: Any) -> list[JobPod]:
    out = []
    for i in range(n):
        p = job_pod(
            pod(
                f"t-{i}",
                {"batch.kubernetes.io/job-name": "t"},
                {"batch.kubernetes.io/job-completion-index": str(i), **over.get(f"ann{i}", {})},
                node=over.get("node", f"n{i}"),
                ip=over.get("ip", f"10.0.0.{i + 1}"),
            )
        )
        assert p is not None
        out.append(p)
    return out


def test_a_group_waits_until_every_index_has_a_placed_pod() -> None:
    assert "waiting for indexes [3]" in group(members()[:3]).why
    assert "get a node and IP" in group(members(ip="")).why
    g = group(members())
    assert g.ready
    assert not g.assigned
    # The same pods give the same id (a new leader makes the same assignment's id).
    assert g.assignment_id == group(list(reversed(members()))).assignment_id
    done = {
        f"ann{i}": {jobpods.ASSIGNMENT_ANNOTATION: "abc", jobpods.RANK_ANNOTATION: str(3 - i)}
        for i in range(4)
    }
    assert group(members(**done)).assigned


def test_the_fallback_keeps_running_pods_ranks() -> None:
    pods = members()
    assert sticky.by_index(pods, {}) == {"t-0": 0, "t-1": 1, "t-2": 2, "t-3": 3}
    # t-1 runs with rank 2 already: t-2 (index 2) takes the lowest free rank.
    assert sticky.by_index(pods, {"t-1": 2}) == {"t-1": 2, "t-0": 0, "t-3": 3, "t-2": 1}
    assert sticky.coordinator(pods, {"t-0": 1, "t-1": 0, "t-2": 2, "t-3": 3}) == "10.0.0.2:8476"


def test_replicators_are_found_by_node() -> None:
    stack = {
        "metadata": {"name": "mtc-node-x"},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "replicator", "ports": [{"name": "grpc", "containerPort": 7070}]}
            ],
        },
        "status": {"phase": "Running", "podIP": "10.1.0.5"},
    }
    pending = {**stack, "status": {"phase": "Pending"}}
    assert sticky.replicator_addresses([stack, pending]) == {"n1": "10.1.0.5:7070"}
