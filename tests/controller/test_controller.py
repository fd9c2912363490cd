"""The controller against a real kube-apiserver: apply, edit, refuse, conflict, delete, status.

One controller process (no leader election) serves the module; each test has its own
configuration, on a node selector of its own, and deletes it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from mtc_replicator.controller.plan import FINALIZER
from mtc_replicator.tools.render import render
from tests.controller.apiserver import REPO, ApiServer
from tests.controller.compat_main import downgrade
from tests.controller.conftest import NAMESPACE, Controller, running_controller, wait_for

GROUP, PLURAL = "checkpointing.mtc.dev", "checkpointconfigurations"


@pytest.fixture(scope="module")
def controller(
    apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    log = tmp_path_factory.mktemp("controller") / "controller.log"
    env = {
        "MTC_CONTROLLER_RETRY_SECONDS": "1",
        "MTC_CONTROLLER_RESYNC_SECONDS": "3",
        "MTC_CONTROLLER_NOT_READY_SECONDS": "2",
        "MTC_CONTROLLER_RELEASE_SECONDS": "0.5",
    }
    c = running_controller(apiserver, log, env)
    yield c
    c.stop()


def config(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "CheckpointConfiguration",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "backupUrl": "gs://mtc-test-bucket/ckpt",
            "inMemoryVolumeSize": "4Gi",
            "nodeSelector": {"test.mtc.dev/pool": name},
            **spec,
        },
    }


class Cluster:
    """The calls the tests make, through the official client."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.apps = client.AppsV1Api(api)
        self.core = client.CoreV1Api(api)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.custom.create_namespaced_custom_object(
            GROUP, "v1", NAMESPACE, PLURAL, body
        )
        return out

    def get(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            out: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, "v1", NAMESPACE, PLURAL, name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return out

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP, "v1", NAMESPACE, PLURAL, name, {"spec": spec}
        )

    def delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(GROUP, "v1", NAMESPACE, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def daemonset(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            ds = self.apps.read_namespaced_daemon_set(f"mtc-node-{name}", NAMESPACE)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        out: dict[str, Any] = self.api.sanitize_for_serialization(ds)
        return out

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        cr = self.get(name) or {}
        return next(
            (c for c in (cr.get("status") or {}).get("conditions") or [] if c["type"] == kind),
            None,
        )

    def events(self, name: str) -> list[Any]:
        items = self.core.list_namespaced_event(
            NAMESPACE, field_selector=f"involvedObject.name={name}"
        ).items
        return list(items)


@pytest.fixture
def cluster(api: Any, controller: Controller) -> Iterator[Cluster]:
    c = Cluster(api)
    made: list[str] = []
    original = c.create

    def create(body: dict[str, Any]) -> dict[str, Any]:
        made.append(body["metadata"]["name"])
        return original(body)

    c.create = create  # type: ignore[method-assign]
    yield c
    for name in made:
        c.delete(name)
    for name in made:
        wait_for(f"{name} deleted", lambda n=name: c.get(n) is None, timeout=30)


def contains(actual: Any, expected: Any, path: str = "") -> None:
    """Every field of ``expected`` is in ``actual`` with the same value (the API server adds
    defaults, and leaves out only false, zero and empty values)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {actual!r}"
        for key, value in expected.items():
            if key not in actual and value in (False, 0, "", [], {}):
                continue
            assert key in actual, f"{path}.{key} missing"
            contains(actual[key], value, f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), f"{path}: {actual!r}"
        assert len(actual) == len(expected), f"{path}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            contains(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def _read(c: Cluster, obj: dict[str, Any]) -> dict[str, Any]:
    from kubernetes.dynamic import DynamicClient

    dyn = DynamicClient(c.api)
    resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    meta = obj["metadata"]
    got = dyn.get(resource, name=meta["name"], namespace=meta.get("namespace"))
    out: dict[str, Any] = got.to_dict()
    return out


def test_apply_makes_the_rendered_node_stack_owned_by_the_configuration(cluster: Cluster) -> None:
    body = config("apply", image="registry.example/mtc-replicator:1.0")
    cr = cluster.create(body)
    ds = wait_for("the DaemonSet", lambda: cluster.daemonset("apply"))
    uid = cr["metadata"]["uid"]
    # Exactly what `mtc render` makes of the same file (one rendering path), Namespace aside.
    for obj in map(downgrade, render(body)):
        if obj["kind"] == "Namespace":
            continue
        got = _read(cluster, obj)
        contains(got, {k: v for k, v in obj.items() if k != "metadata"}, obj["kind"])
        contains(got["metadata"]["labels"], obj["metadata"]["labels"], obj["kind"])
        owners = got["metadata"].get("ownerReferences") or []
        if obj["kind"] in ("DaemonSet", "ConfigMap", "ServiceAccount", "NetworkPolicy"):
            assert [(o["kind"], o["uid"], o["controller"]) for o in owners] == [
                ("CheckpointConfiguration", uid, True)
            ], obj["kind"]
        else:  # shared by every configuration: never owned by one
            assert owners == [], obj["kind"]
    assert (
        ds["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example/mtc-replicator:1.0"
    )
    cr = wait_for("status", lambda: (cluster.get("apply") or {}).get("status"))
    assert cr["observedGeneration"] == 1
    assert FINALIZER in (cluster.get("apply") or {})["metadata"]["finalizers"]
    assert {c["type"] for c in cr["conditions"]} == {"Ready", "Progressing", "Degraded"}
    wait_for(
        "a Created Event",
        lambda: [
            e for e in cluster.events("apply") if e.reason == "Created" and e.type == "Normal"
        ],
    )


def test_an_edit_rolls_out_and_drops_the_old_configmap(cluster: Cluster) -> None:
    cluster.create(config("edit"))
    first = wait_for("the DaemonSet", lambda: cluster.daemonset("edit"))
    old_map = first["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"][
        "name"
    ]
    cluster.patch_spec("edit", {"image": "mtc-replicator:2.0", "inMemoryVolumeSize": "8Gi"})

    def rolled() -> dict[str, Any] | None:
        ds = cluster.daemonset("edit")
        spec = ds["spec"]["template"]["spec"] if ds else {}
        return ds if ds and spec["containers"][0]["image"] == "mtc-replicator:2.0" else None

    ds = wait_for("the DaemonSet rolled", rolled)
    assert ds["metadata"]["generation"] > first["metadata"]["generation"]
    new_map = ds["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"]
    assert new_map != old_map
    data = cluster.core.read_namespaced_config_map(new_map, NAMESPACE).data
    assert data["MTC_RAM_SIZE"] == "8Gi"
    names = {m.metadata.name for m in cluster.core.list_namespaced_config_map(NAMESPACE).items}
    assert old_map not in names
    assert new_map in names
    wait_for(
        "observedGeneration 2",
        lambda: (cluster.get("edit") or {}).get("status", {}).get("observedGeneration") == 2,
    )


def test_an_invalid_spec_is_refused_naming_the_field_and_nothing_is_applied(
    cluster: Cluster,
) -> None:
    # The CEL rule that says so is not enforced by this API server (1.20): the controller is.
    cluster.create(config("invalid", cloudStorageBucketName="other-bucket"))
    degraded = wait_for("Degraded", lambda: cluster.condition("invalid", "Degraded"))
    assert degraded["status"] == "True"
    assert degraded["reason"] == "InvalidSpec"
    assert "spec.backupUrl" in degraded["message"]
    ready = cluster.condition("invalid", "Ready")
    assert ready is not None
    assert ready["status"] == "False"
    assert ready["reason"] == "InvalidSpec"
    assert cluster.daemonset("invalid") is None
    wait_for(
        "an InvalidSpec Event",
        lambda: [
            e
            for e in cluster.events("invalid")
            if e.reason == "InvalidSpec" and e.type == "Warning"
        ],
    )


def test_an_invalid_edit_leaves_the_running_stack_alone(cluster: Cluster) -> None:
    cluster.create(config("badedit"))
    before = wait_for("the DaemonSet", lambda: cluster.daemonset("badedit"))
    cluster.patch_spec("badedit", {"s3": {"region": "eu-west-1"}})  # s3 with a gs:// backup
    degraded = wait_for(
        "Degraded",
        lambda: (
            (c := cluster.condition("badedit", "Degraded")) and c["reason"] == "InvalidSpec" and c
        ),
    )
    assert "spec.s3" in degraded["message"]
    assert (cluster.get("badedit") or {})["status"]["observedGeneration"] == 2
    after = cluster.daemonset("badedit")
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]


def test_a_field_that_cannot_change_in_place_is_refused(cluster: Cluster) -> None:
    cluster.create(config("fixed"))
    before = wait_for("the DaemonSet", lambda: cluster.daemonset("fixed"))
    cluster.patch_spec("fixed", {"runAsUser": 0, "image": "mtc-replicator:9.9"})
    degraded = wait_for(
        "Degraded",
        lambda: (
            (c := cluster.condition("fixed", "Degraded"))
            and c["reason"] == "FieldCannotChange"
            and c
        ),
    )
    assert degraded["message"].startswith("spec.runAsUser cannot change in place (65532 to 0)")
    after = cluster.daemonset("fixed")
    # Never half-applied: the image edit that came with it is not rolled either.
    assert after is not None
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"]["template"]["spec"]["containers"][0]["image"] != "mtc-replicator:9.9"
    # Put back, the edit rolls.
    cluster.patch_spec("fixed", {"runAsUser": 65532})
    wait_for(
        "rolled once runAsUser is back",
        lambda: (
            (ds := cluster.daemonset("fixed"))
            and ds["spec"]["template"]["spec"]["containers"][0]["image"] == "mtc-replicator:9.9"
        ),
    )


def test_two_configurations_on_the_same_nodes_the_newer_is_refused(cluster: Cluster) -> None:
    cluster.create(config("older", nodeSelector={"test.mtc.dev/pool": "shared"}))
    wait_for("the older one's DaemonSet", lambda: cluster.daemonset("older"))
    cluster.create(config("newer", nodeSelector={"test.mtc.dev/pool": "shared", "zone": "a"}))
    degraded = wait_for("Degraded", lambda: cluster.condition("newer", "Degraded"))
    assert degraded["reason"] == "NodeConflict"
    assert f"CheckpointConfiguration {NAMESPACE}/older" in degraded["message"]
    assert cluster.daemonset("newer") is None
    wait_for(
        "a NodeConflict Event",
        lambda: [e for e in cluster.events("newer") if e.reason == "NodeConflict"],
    )
    # The older one goes: the newer one gets its nodes (retried, not forgotten).
    cluster.delete("older")
    wait_for("the newer one's DaemonSet", lambda: cluster.daemonset("newer"), timeout=30)


def test_delete_removes_the_owned_objects_and_releases_the_finalizer(cluster: Cluster) -> None:
    cluster.create(config("gone"))
    ds = wait_for("the DaemonSet", lambda: cluster.daemonset("gone"))
    config_map = ds["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"][
        "name"
    ]
    cluster.delete("gone")
    wait_for("the configuration gone", lambda: cluster.get("gone") is None)
    assert cluster.daemonset("gone") is None
    names = {m.metadata.name for m in cluster.core.list_namespaced_config_map(NAMESPACE).items}
    assert config_map not in names
    accounts = {
        a.metadata.name for a in cluster.core.list_namespaced_service_account(NAMESPACE).items
    }
    assert "mtc-node-gone" not in accounts
    # What every configuration shares stays.
    from kubernetes import client

    client.SchedulingV1Api(cluster.api).read_priority_class("mtc-node-critical")
    client.StorageV1Api(cluster.api).read_csi_driver("multitier-checkpoint.mtc.dev")


def _set_daemonset_status(cluster: Cluster, name: str, desired: int, ready: int) -> None:
    """What the DaemonSet controller writes, where no kube-controller-manager runs."""
    ds = cluster.daemonset(name)
    assert ds is not None
    status = {
        "observedGeneration": ds["metadata"]["generation"],
        "currentNumberScheduled": desired,
        "numberMisscheduled": 0,
        "desiredNumberScheduled": desired,
        "numberReady": ready,
        "updatedNumberScheduled": desired,
        "numberAvailable": ready,
    }
    cluster.apps.patch_namespaced_daemon_set_status(
        f"mtc-node-{name}", NAMESPACE, {"status": status}
    )


def _register_nodes(cluster: Cluster, pool: str, count: int) -> list[str]:
    """Node objects as kubelets register them: the DaemonSet controller makes a pod for each."""
    names = [f"{pool}-node-{i}" for i in range(count)]
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    for node in names:
        cluster.core.create_node(
            {
                "metadata": {
                    "name": node,
                    "labels": {"kubernetes.io/os": "linux", "test.mtc.dev/pool": pool},
                },
                "status": {"capacity": capacity, "allocatable": capacity},
            }
        )
        # A new Node is tainted not-ready until its kubelet reports Ready and the node
        # lifecycle controller lifts the taint: done here as those two would.
        cluster.core.patch_node_status(
            node, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
        )
        cluster.core.patch_node(node, {"spec": {"taints": None}})
    return names


def _make_ready(cluster: Cluster, pods: list[Any]) -> None:
    """What each node's kubelet reports once the pod's containers pass their probes."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for pod in pods:
        cluster.core.patch_namespaced_pod_status(
            pod.metadata.name,
            NAMESPACE,
            {
                "status": {
                    "phase": "Running",
                    "conditions": [
                        {"type": "Ready", "status": "True", "lastTransitionTime": now},
                        {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                    ],
                }
            },
        )


def _set_nodes(cluster: Cluster, apiserver: ApiServer, name: str, ready: int) -> None:
    """3 nodes, ``ready`` of them with the node stack ready: through the real DaemonSet
    controller (kube-controller-manager, Node objects, pod status as kubelets set it) where
    it runs, else as it would write the DaemonSet's status."""
    if not apiserver.controller_manager:
        _set_daemonset_status(cluster, name, desired=3, ready=ready)
        return
    if not cluster.core.list_node(label_selector=f"test.mtc.dev/pool={name}").items:
        _register_nodes(cluster, name, 3)
    selector = f"app.kubernetes.io/instance={name}"
    pods = wait_for(
        "a pod per node",
        lambda: (
            (p := cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)
            and len(p) == 3
            and p
        ),
    )
    _make_ready(cluster, sorted(pods, key=lambda p: p.metadata.name)[:ready])


def test_status_follows_the_daemonset_and_reads_back_with_kubectl(
    cluster: Cluster, apiserver: ApiServer
) -> None:
    cluster.create(config("status"))
    wait_for("the DaemonSet", lambda: cluster.daemonset("status"))
    _set_nodes(cluster, apiserver, "status", ready=1)
    ready = wait_for(
        "2 of 3 nodes not ready",
        lambda: (
            (c := cluster.condition("status", "Ready"))
            and c["message"] == "2 of 3 nodes not ready"
            and c
        ),
    )
    assert (ready["status"], ready["reason"]) == ("False", "NodesNotReady")
    if apiserver.controller_manager:  # the two pods not ready, named by their nodes
        not_ready = (cluster.get("status") or {})["status"]["nodes"]["notReady"]
        assert len(not_ready) == 2
        assert {e["node"] for e in not_ready} < {f"status-node-{i}" for i in range(3)}
        assert {e["reason"] for e in not_ready} == {"pod Pending"}  # no kubelet here
        # Not ready past MTC_CONTROLLER_NOT_READY_SECONDS (2 s here, 5 minutes by default):
        # one Warning Event per node and spell (the third node may have had its spell too,
        # before its pod was made ready).
        events = wait_for(
            "NodeNotReady Events",
            lambda: (
                len(e := [x for x in cluster.events("status") if x.reason == "NodeNotReady"]) >= 2
                and e
            ),
            timeout=20,
        )
        time.sleep(4)  # a resync later: not posted again
        again = [x for x in cluster.events("status") if x.reason == "NodeNotReady"]
        assert len(again) <= 3
        assert all((x.count or 1) == 1 for x in again)
        assert all(e.type == "Warning" and "pod Pending" in e.message for e in events)
    degraded = cluster.condition("status", "Degraded")
    assert degraded is not None
    assert (degraded["status"], degraded["reason"]) == ("True", "NodesNotReady")
    _set_nodes(cluster, apiserver, "status", ready=3)
    ready = wait_for(
        "Ready",
        lambda: (c := cluster.condition("status", "Ready")) and c["status"] == "True" and c,
    )
    assert ready["reason"] == "AllNodesReady"
    st = (cluster.get("status") or {})["status"]
    assert st["nodes"] == {
        "desired": 3,
        "ready": 3,
        "updated": 3,
        "available": 3,
        "notReady": [],
        "reporting": 0,  # no pod has an IP here (no kubelet): no replicator was asked
    }
    if shutil.which("kubectl") is None:
        return
    kubectl = ["kubectl", "--kubeconfig", str(apiserver.kubeconfig), "-n", NAMESPACE]
    out = subprocess.run(
        [*kubectl, "get", "ckptconfig", "status", "-o", "yaml"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    read = yaml.safe_load(out)
    assert read["status"]["nodes"]["ready"] == 3
    assert {c["type"]: c["status"] for c in read["status"]["conditions"]}["Ready"] == "True"
    table = subprocess.run(
        [*kubectl, "get", "ckptconfig", "status"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "BACKUP",
        "BUCKET",
        "RAM",
        "READY",
        "REASON",
        "NODES",
        "NODES-READY",
        "AGE",
    ]
    assert row.split()[:6] == [
        "status",
        "gs://mtc-test-bucket/ckpt",
        "4Gi",
        "True",
        "AllNodesReady",
        "3",
    ]


def test_the_first_command_of_deploy_md_makes_the_node_stack(
    cluster: Cluster, apiserver: ApiServer
) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    docs = (REPO / "docs" / "deploy.md").read_text()
    first = docs.split("```sh\n", 1)[1].splitlines()[0].split("#")[0].split()
    assert first == ["kubectl", "apply", "-f", "deploy/examples/checkpointconfiguration.yaml"]
    kubectl = ["kubectl", "--kubeconfig", str(apiserver.kubeconfig)]
    subprocess.run([*kubectl, *first[1:]], cwd=REPO, check=True, capture_output=True, timeout=30)
    ds = wait_for("the example's DaemonSet", lambda: cluster.daemonset("default"))
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "cloud.google.com/gke-nodepool": "training",
    }
    events = wait_for(
        "a Created Event", lambda: [e for e in cluster.events("default") if e.reason == "Created"]
    )
    assert events[0].source.component == "mtc-controller"
    subprocess.run(
        [*kubectl, "delete", "-f", first[-1], "--timeout=30s"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert cluster.get("default") is None  # kubectl delete waited for the finalizer
    assert cluster.daemonset("default") is None


def test_a_daemonset_deleted_by_hand_is_made_again(cluster: Cluster) -> None:
    cluster.create(config("again"))
    first = wait_for("the DaemonSet", lambda: cluster.daemonset("again"))
    cluster.apps.delete_namespaced_daemon_set("mtc-node-again", NAMESPACE)
    again = wait_for(
        "a new DaemonSet",
        lambda: (
            (ds := cluster.daemonset("again"))
            and ds["metadata"]["uid"] != first["metadata"]["uid"]
            and ds
        ),
    )
    assert again["spec"]["template"] == first["spec"]["template"]


def test_delete_asks_each_pod_to_free_its_ram_disk_first(
    cluster: Cluster, apiserver: ApiServer
) -> None:
    if not apiserver.controller_manager:
        pytest.skip("no kube-controller-manager: DaemonSets get no pods")
    _register_nodes(cluster, "release", 1)
    cluster.create(config("release"))
    selector = "app.kubernetes.io/instance=release"
    (pod,) = wait_for(
        "the pod",
        lambda: cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items,
    )
    # Held by a finalizer of ours, the pod can be read after its DaemonSet is gone.
    hold = {"metadata": {"finalizers": ["test.mtc.dev/hold"]}}
    cluster.core.patch_namespaced_pod(pod.metadata.name, NAMESPACE, hold)
    cluster.delete("release")
    wait_for("the configuration gone", lambda: cluster.get("release") is None)
    after = cluster.core.read_namespaced_pod(pod.metadata.name, NAMESPACE)
    assert after.metadata.annotations["checkpointing.mtc.dev/release-ram-disk"] == "true"
    assert after.metadata.deletion_timestamp is not None  # the DaemonSet's pods go
    cluster.core.patch_namespaced_pod(
        pod.metadata.name, NAMESPACE, {"metadata": {"finalizers": None}}
    )
