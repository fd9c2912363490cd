"""Sticky ranks end to end: the controller (its own process, as its ServiceAccount, with the
certificate ``mtc certs controller`` makes) on a real API server, four real daemons with
per-node certificates standing for four nodes.

A job saved step 5 on the daemons. Its pods are recreated in a random order across the
nodes (an Indexed Job's pods: label ``checkpointing.mtc.dev/nodes``, their completion
index), their node-stack pods say where each node's replicator listens. The controller
asks each replicator what it holds, records every pod's rank on the pod, and hands each
node its pod's rank (``mtc-rank.json`` and ``jax-init-info.txt`` appear in CHECKPOINT_DIR).
The job then restarts with those ranks and every rank restores from its own node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.controller import jobpods
from mtc_replicator.tools import certs
from tests.controller.apiserver import ApiServer
from tests.controller.conftest import Controller, running_controller, wait_for
from tests.controller.test_controller import Cluster as Api
from tests.integration.cluster import Cluster, running
from tests.integration.helpers import store_root
from tests.integration.permuted import placement, restart

NODES = 4
TRAIN_NS = "ml-sticky"
STACK_NS = "mtc-system"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Cluster]:
    (tmp_path / "nodes").mkdir()
    with running(Cluster(tmp_path / "nodes", "sticky-job", nodes=NODES)) as c:
        yield c


def _controller(
    apiserver: ApiServer, root: Path, cluster: Cluster, log: str = "controller.log"
) -> Controller:
    assert cluster.ca is not None
    tls = root / "controller-tls"
    certs.write_node_files(tls, cluster.ca, certs.issue_controller(cluster.ca))
    files = certs.node_files(tls)
    env = {
        "MTC_TLS_CERT": str(files.cert),
        "MTC_TLS_KEY": str(files.key),
        "MTC_TLS_CA": str(files.ca),
        "MTC_CONTROLLER_RANK_RETRY_SECONDS": "1",
    }
    return running_controller(apiserver, root / log, env)


def _running(api: Api, namespace: str, name: str) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    api.core.patch_namespaced_pod_status(
        name,
        namespace,
        {
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            }
        },
    )


def _stack_pods(api: Api, cluster: Cluster) -> None:
    """Each node's replicator, where the controller finds it: a node-stack pod on that node."""
    for n in range(NODES):
        port = int(cluster.daemon(n).address.rsplit(":", 1)[1])
        name = f"mtc-node-sticky-{n}"
        api.core.create_namespaced_pod(
            STACK_NS,
            {
                "metadata": {
                    "name": name,
                    "labels": {
                        "app.kubernetes.io/name": "mtc-node",
                        "app.kubernetes.io/instance": "sticky-test",
                    },
                },
                "spec": {
                    "nodeName": f"node{n}",
                    "containers": [
                        {
                            "name": "replicator",
                            "image": "mtc-replicator",
                            "ports": [{"name": "grpc", "containerPort": port}],
                        }
                    ],
                },
            },
        )
        _running(api, STACK_NS, name)


def _training_pods(api: Api, cluster: Cluster, placed: list[int]) -> list[str]:
    """The job's recreated pods: pod i (completion index i) on node ``placed[i]``."""
    names = []
    for i, node in enumerate(placed):
        name = f"train-{i}"
        api.core.create_namespaced_pod(
            TRAIN_NS,
            {
                "metadata": {
                    "name": name,
                    "labels": {
                        jobpods.NODES_LABEL: str(NODES),
                        "batch.kubernetes.io/job-name": "train",
                    },
                    "annotations": {
                        "batch.kubernetes.io/job-completion-index": str(i),
                        jobpods.JOB_ANNOTATION: cluster.job,
                        jobpods.PORT_ANNOTATION: "29500",
                    },
                },
                "spec": {
                    "nodeName": f"node{node}",
                    "containers": [{"name": "trainer", "image": "trainer"}],
                },
            },
        )
        _running(api, TRAIN_NS, name)
        names.append(name)
    return names


def _default_account(api: Api, namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        api.core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def _annotations(api: Api, name: str) -> dict[str, str]:
    pod = api.core.read_namespaced_pod(name, TRAIN_NS)
    return dict(pod.metadata.annotations or {})


def test_the_controller_gives_each_pod_the_rank_its_node_holds(
    api: Any, apiserver: ApiServer, nodes: Cluster, tmp_path: Path
) -> None:
    cluster = nodes
    cluster.fresh_start()
    cluster.save(5)
    k8s = Api(api)
    k8s.core.create_namespace({"metadata": {"name": TRAIN_NS}})
    for ns in (TRAIN_NS, STACK_NS):  # what the (absent) service-account controller makes
        _default_account(k8s, ns)
    controller = _controller(apiserver, tmp_path, cluster)
    try:
        _stack_pods(k8s, cluster)
        placed = placement(NODES, seed=21)
        names = _training_pods(k8s, cluster, placed)

        def delivered() -> dict[str, dict[str, str]] | None:
            got = {n: _annotations(k8s, n) for n in names}
            done = all(a.get(jobpods.DELIVERED_ANNOTATION) for a in got.values())
            return got if done else None

        marks = wait_for("every pod's rank delivered", delivered, timeout=60)
        ids = {a[jobpods.ASSIGNMENT_ANNOTATION] for a in marks.values()}
        assert len(ids) == 1
        assert {a[jobpods.SOURCE_ANNOTATION] for a in marks.values()} == {"holdings"}
        ranks = {placed[i]: int(marks[n][jobpods.RANK_ANNOTATION]) for i, n in enumerate(names)}
        # The grant: each rank bound to the node its certificate names (issue 39).
        for i, n in enumerate(names):
            assert marks[n][jobpods.HOLDER_ANNOTATION] == f"node{placed[i]}"
            grant = json.loads(
                (store_root(cluster.dirs[placed[i]]) / "grants" / f"{cluster.job}.json").read_text()
            )
            assert grant["holders"][ranks[placed[i]]] == f"node{placed[i]}"
        assert sorted(ranks.values()) == list(range(NODES))
        # Each node's CHECKPOINT_DIR says its pod's rank, and rank 0's pod is the coordinator.
        for node, rank in ranks.items():
            record = json.loads((cluster.dirs[node] / "mtc-rank.json").read_text())
            assert (record["rank"], record["nodes"]) == (rank, NODES)
            assert record["coordinator"] == "127.0.0.1:29500"
            info = (cluster.dirs[node] / "jax-init-info.txt").read_text()
            assert info == f"{rank}\n127.0.0.1:29500\n"
        # The pods moved, the ranks followed the bytes: every rank restores from its node.
        assert any(ranks[placed[i]] != i for i in range(NODES))
        outcome = restart(cluster, ranks, 5)
        assert outcome.local == NODES, outcome.sources

        # A new controller (a restart, a new leader) reads the assignment off the pods and
        # keeps it, though every node now holds more (the restores wrote into the stores).
        controller.stop()
        controller = _controller(apiserver, tmp_path, cluster, "controller-2.log")
        time.sleep(3)  # a few events and retries later
        assert {n: _annotations(k8s, n) for n in names} == marks
        assert "ranks assigned" not in controller.text()
    finally:
        controller.stop()
        k8s.core.delete_collection_namespaced_pod(
            STACK_NS,
            label_selector="app.kubernetes.io/instance=sticky-test",
            grace_period_seconds=0,
        )
        k8s.core.delete_namespace(TRAIN_NS)
