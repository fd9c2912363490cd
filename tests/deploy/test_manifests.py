"""Every kustomization builds, every object is valid for Kubernetes 1.32, and the node stack
keeps the properties it depends on (privileges, propagation, paths, names that must agree)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from replicator.tools import render
from tests.deploy.k8s import DEPLOY, Obj, container, env, kustomize, name_of, only, validate

KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


def _id(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


def test_the_kustomizations_are_the_expected_ones() -> None:
    assert [_id(p) for p in KUSTOMIZATIONS] == ["base", "overlays/gke", "overlays/s3"]


@pytest.fixture(params=KUSTOMIZATIONS, ids=_id)
def built(request: pytest.FixtureRequest) -> list[Obj]:
    path: Path = request.param
    return kustomize(path)


def _pod(objs: list[Obj]) -> Obj:
    spec: Obj = only(objs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def test_every_object_is_valid(built: list[Obj]) -> None:
    assert {o["kind"] for o in built} == {
        "CustomResourceDefinition",
        "Namespace",
        "PriorityClass",
        "CSIDriver",
        "ServiceAccount",
        "ConfigMap",
        "DaemonSet",
    }
    for obj in built:
        validate(obj)


def test_no_access_to_the_kubernetes_api(built: list[Obj]) -> None:
    # Least privilege: nothing in the node stack calls the API (deploy/base/serviceaccount.yaml).
    assert not [name_of(o) for o in built if o["kind"] in RBAC_KINDS]
    assert only(built, "ServiceAccount")["automountServiceAccountToken"] is False
    pod = _pod(built)
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == only(built, "ServiceAccount")["metadata"]["name"]


def test_csi_driver_is_ephemeral_with_pod_info(built: list[Obj]) -> None:
    driver = only(built, "CSIDriver")
    assert driver["metadata"]["name"] == render.DRIVER_NAME
    spec = driver["spec"]
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True
    assert spec["volumeLifecycleModes"] == ["Ephemeral"]
    assert spec["fsGroupPolicy"] == "None"


def test_plugin_is_privileged_and_propagates_its_mounts(built: list[Obj]) -> None:
    pod = _pod(built)
    plugin = container(pod, "csi-plugin")
    assert plugin in pod["initContainers"]  # a native sidecar: gates the replicator's start
    assert plugin["restartPolicy"] == "Always"
    assert plugin["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    assert mounts["/var/lib/kubelet/pods"]["mountPropagation"] == "Bidirectional"
    e = env(plugin)
    ram_dir = e["MTC_RAM_DIR"]
    (host_mount,) = [p for p in mounts if ram_dir.startswith(p + "/")]
    assert mounts[host_mount]["mountPropagation"] == "Bidirectional"
    assert plugin["startupProbe"]["exec"]["command"] == ["mountpoint", "-q", ram_dir]
    assert e["MTC_CSI_DRIVER_NAME"] == render.DRIVER_NAME
    assert e["CSI_ENDPOINT"] == "unix:///csi/csi.sock"
    assert plugin["command"] == ["mtc-csi"]


def test_replicator_is_unprivileged_and_sees_the_ram_disk(built: list[Obj]) -> None:
    pod = _pod(built)
    replicator = container(pod, "replicator")
    sc = replicator["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    e = env(replicator)
    plugin_env = env(container(pod, "csi-plugin"))
    assert e["MTC_CHECKPOINT_DIR"] == plugin_env["MTC_RAM_DIR"]
    mounts = {m["mountPath"]: m for m in replicator["volumeMounts"]}
    (host_mount,) = [p for p in mounts if e["MTC_CHECKPOINT_DIR"].startswith(p + "/")]
    assert mounts[host_mount]["mountPropagation"] == "HostToContainer"
    plugin_mounts = {
        m["mountPath"]: m["name"] for m in container(pod, "csi-plugin")["volumeMounts"]
    }
    assert mounts[host_mount]["name"] == plugin_mounts[host_mount]  # the same host directory
    assert "limits" not in replicator["resources"]  # tmpfs pages it writes are charged to it
    assert replicator["command"] == ["mtc-replicator"]


def test_replicator_probes_and_addresses_agree(built: list[Obj]) -> None:
    replicator = container(_pod(built), "replicator")
    e = env(replicator)
    port = int(e["MTC_LISTEN"].rsplit(":", 1)[1])
    assert e["MTC_ADVERTISE"] == f"$(POD_IP):{port}"
    assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    ports = {p["name"]: p["containerPort"] for p in replicator["ports"]}
    assert ports["grpc"] == port
    assert ports["data"] == int(e["MTC_DATA_PORT"]) != port
    assert ports["metrics"] == int(e["MTC_METRICS"].rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replicator[probe]["grpc"] == {"port": port}, probe


def test_sidecars_are_pinned_and_find_the_plugin(built: list[Obj]) -> None:
    pod = _pod(built)
    registrar = container(pod, "node-driver-registrar")
    probe = container(pod, "liveness-probe")
    for sidecar in (registrar, probe):
        assert re.fullmatch(
            r"registry\.k8s\.io/sig-storage/[a-z-]+:v\d+\.\d+\.\d+", sidecar["image"]
        )
        assert "--csi-address=/csi/csi.sock" in sidecar["args"]
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_dir = volumes["plugin-dir"]["hostPath"]["path"]
    assert socket_dir == f"/var/lib/kubelet/plugins/{render.DRIVER_NAME}"
    assert f"--kubelet-registration-path={socket_dir}/csi.sock" in registrar["args"]
    # kubelet's probe of the plugin goes to the livenessprobe sidecar's port.
    plugin = container(pod, "csi-plugin")
    health = {p["name"]: p["containerPort"] for p in plugin["ports"]}["healthz"]
    assert f"--http-endpoint=:{health}" in probe["args"]
    assert plugin["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_scheduling_and_priority(built: list[Obj]) -> None:
    pod = _pod(built)
    priority = only(built, "PriorityClass")
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    assert priority["value"] >= 1_000_000
    assert pod["nodeSelector"]["kubernetes.io/os"] == "linux"
    assert pod["tolerations"]
    for c in [*pod["initContainers"], *pod["containers"]]:
        assert c["resources"]["requests"], c["name"]
    namespace = only(built, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_config_map_feeds_both_containers(built: list[Obj]) -> None:
    config_map = only(built, "ConfigMap")
    pod = _pod(built)
    for name in ("csi-plugin", "replicator"):
        refs = [
            r["configMapRef"]["name"]
            for r in container(pod, name)["envFrom"]
            if "configMapRef" in r
        ]
        assert refs == [config_map["metadata"]["name"]], name
    assert config_map["data"]["MTC_RAM_SIZE"]
    assert render.QUANTITY_RE.fullmatch(config_map["data"]["MTC_RAM_SIZE"])


@pytest.mark.parametrize(("overlay", "scheme"), [("gke", "gs://"), ("s3", "s3://")])
def test_overlays_set_a_backup(overlay: str, scheme: str) -> None:
    objs = kustomize(DEPLOY / "overlays" / overlay)
    data = only(objs, "ConfigMap")["data"]
    assert data["MTC_BACKUP"].startswith(scheme)
    assert render.OBJECT_URL_RE.fullmatch(data["MTC_BACKUP"])
    secret = [
        r["secretRef"] for r in container(_pod(objs), "replicator")["envFrom"] if "secretRef" in r
    ]
    # The s3 overlay needs its keys; with workload identity the Secret stays optional.
    assert secret == [{"name": "mtc-backup-credentials", "optional": overlay != "s3"}]


def test_base_has_no_backup() -> None:
    assert "MTC_BACKUP" not in only(kustomize(DEPLOY / "base"), "ConfigMap")["data"]
