"""The Helm chart: it lints, its schema refuses bad values with the key at fault, it renders
the kustomize tree's objects (base, each overlay, the monitoring component) object by object,
every variant validates, and the GPU pool variants of GKE, EKS and AKS land on their pool.

The property checks of test_manifests.py and test_monitoring.py run on Helm renders too
(their ``built`` fixtures); this file holds what is the chart's own.
"""

from __future__ import annotations

import functools
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_python.chart import lint
from helm_python.errors import HelmRenderError, HelmValuesError

from mtc_replicator.tools import render_manifests
from tests.deploy import helm_chart
from tests.deploy.helm_chart import CHART_DIR, MIRRORS, VALUES_DIR, merge, render, values_of
from tests.deploy.k8s import (
    DEPLOY,
    REPO,
    Obj,
    container,
    env,
    kustomize,
    name_of,
    only,
    pod_of,
    validate,
)

VALUES_FILES = sorted(p.name for p in VALUES_DIR.glob("*.yaml"))
MONITORING_KINDS = {"PodMonitor", "PrometheusRule"}
"""No schema here (the Prometheus Operator's CRDs are not vendored): test_monitoring.py
checks them by hand, on the Helm render as on the kustomize one."""


def test_the_chart_lints_clean_with_every_values_file() -> None:
    for values in [{}, *(values_of(name) for name in VALUES_FILES)]:
        report = lint(CHART_DIR, values, strict=True, namespace=helm_chart.RELEASE_NAMESPACE)
        # Severity 1 is information ("icon is recommended"); warnings fail under strict.
        assert [m for m in report["messages"] if m["severity"] > 1] == [], values
        assert report["errors"] == []


def test_the_chart_is_the_package_s_version() -> None:
    meta = helm_chart.chart().metadata
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == version
    image = container(pod_of(render()), "replicator")["image"]
    assert image == f"mtc-replicator:{version}"
    tagged = render({"image": {"repository": "registry.example/mtc", "tag": "9.9.9"}})
    for c in ("csi-plugin", "replicator"):
        assert container(pod_of(tagged), c)["image"] == "registry.example/mtc:9.9.9"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ramSize": 50}, "at '/ramSize': got number, want string"),
        ({"ramSize": "0Gi"}, "at '/ramSize'"),
        ({"backup": {"url": "azure://bucket/mtc"}}, "at '/backup/url'"),
        ({"backup": {"url": "s3://Bucket"}}, "at '/backup/url'"),
        ({"tls": {"mode": "plaintext"}}, "at '/tls/mode': value must be one of"),
        ({"runAsUser": "root"}, "at '/runAsUser': got string, want integer"),
        ({"runAsGroup": -1}, "at '/runAsGroup'"),
        ({"nodeSelector": {"pool": True}}, "at '/nodeSelector/pool': got boolean, want string"),
        ({"tolerations": [{"key": "sku", "effect": "NoStart"}]}, "at '/tolerations/0/effect'"),
        ({"allowedNamespaces": ["Team_A"]}, "at '/allowedNamespaces/0'"),
        # No memory limit for the replicator: its tmpfs pages would get it OOM-killed.
        (
            {"resources": {"replicator": {"limits": {"memory": "8Gi"}}}},
            "at '/resources/replicator/limits': additional properties 'memory' not allowed",
        ),
        ({"extraConfig": {"LD_PRELOAD": "/x.so"}}, "invalid propertyName 'LD_PRELOAD'"),
        ({"nodeselector": {}}, "additional properties 'nodeselector' not allowed"),
        # Its pods' names would exceed what the per-node certificate check admits.
        ({"name": "p" * 49}, "at '/name'"),
    ],
)
def test_the_schema_refuses_bad_values_naming_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmValuesError) as refused:
        render(values)
    assert message in str(refused.value)
    # `helm lint` (and so `helm install`) says the same.
    report = lint(CHART_DIR, values, namespace=helm_chart.RELEASE_NAMESPACE)
    assert any(message in e for e in report["errors"]), report["errors"]


@pytest.mark.parametrize(
    ("values", "namespace", "message"),
    [
        # Helm writes its release record into the release's namespace before it makes
        # anything: a chart that makes that namespace could never install.
        ({}, "mtc-system", "install with -n default"),
        ({"backup": {"s3": {"region": "us-east-1"}}}, "default", "backup.s3 is only for s3://"),
        (
            {"extraConfig": {"MTC_RAM_SIZE": "1Gi"}},
            "default",
            "extraConfig.MTC_RAM_SIZE is set by the chart: use the value ramSize instead",
        ),
        (
            {"backup": {"url": "gs://bucket/mtc", "s3": {"endpointUrl": "https://minio:9000"}}},
            "default",
            "backup.s3 is only for s3://",
        ),
    ],
)
def test_the_templates_refuse_what_the_schema_cannot_say(
    values: dict[str, Any], namespace: str, message: str
) -> None:
    with pytest.raises(HelmRenderError, match=re.escape(message)):
        render(values, namespace=namespace)


def test_the_release_may_live_in_the_namespace_it_does_not_make() -> None:
    objs = render({"namespace": {"name": "mtc-system", "create": False}}, namespace="mtc-system")
    assert "Namespace" not in {o["kind"] for o in objs}


# --- equal to the kustomize tree ------------------------------------------------------------


def _assert_same(helm: list[Obj], kustomized: list[Obj]) -> None:
    ours, theirs = helm_chart.normalised(helm), helm_chart.normalised(kustomized)
    assert sorted(ours) == sorted(theirs)
    for name, obj in theirs.items():
        assert ours[name] == obj, f"{name} differs from the kustomize build"


@pytest.mark.parametrize("kustomization", list(MIRRORS))
def test_the_chart_renders_each_kustomization(kustomization: str) -> None:
    _assert_same(
        helm_chart.render_files(*MIRRORS[kustomization]), kustomize(DEPLOY / kustomization)
    )


def test_the_chart_renders_the_monitoring_component(tmp_path: Path) -> None:
    built = kustomize(
        helm_chart.overlay(
            tmp_path / "overlay",
            {"resources": ["../../base"], "components": ["../../components/monitoring"]},
        )
    )
    assert {o["kind"] for o in built} >= MONITORING_KINDS
    _assert_same(helm_chart.render_files("monitoring.yaml"), built)


@pytest.mark.parametrize(
    ("resource", "components", "files"),
    [
        ("overlays/gke", ["cert-manager"], ("gke.yaml", "cert-manager.yaml")),
        (
            "overlays/s3",
            ["cert-manager", "monitoring"],
            ("s3.yaml", "cert-manager.yaml", "monitoring.yaml"),
        ),
        ("base", ["root-training"], ("root.yaml",)),
    ],
)
def test_values_files_compose_as_the_components_do(
    tmp_path: Path, resource: str, components: list[str], files: tuple[str, ...]
) -> None:
    # docs/deploy.md adds a component to an overlay; -f adds its values file the same way.
    kustomization = {
        "resources": [f"../../{resource}"],
        "components": [f"../../components/{c}" for c in components],
    }
    built = kustomize(helm_chart.overlay(tmp_path / "overlay", kustomization))
    _assert_same(helm_chart.render_files(*files), built)


def test_the_move_to_per_node_certificates_has_its_middle_step(tmp_path: Path) -> None:
    # docs/deploy.md's middle step as values: csi-driver's certificates, and the shared one
    # still made and accepted while pods with it remain.
    from tests.deploy.test_per_node_certificates import _documented_migration_step

    built = kustomize(
        helm_chart.overlay(tmp_path / "overlay", yaml.safe_load(_documented_migration_step()))
    )
    values = values_of("cert-manager-per-node.yaml", tls={"acceptSharedCertificate": True})
    helm = render(values)
    # The order of the variables is all that may differ: kustomize's patch puts the flag
    # first, the chart beside the other MTC_TLS_* ones.
    for objs in (helm, built):
        replicator = pod_of(objs)["containers"][0]
        assert replicator["name"] == "replicator"
        replicator["env"].sort(key=lambda e: e["name"])
    _assert_same(helm, built)
    for obj in helm:
        validate_once(obj)
    with pytest.raises(
        HelmRenderError, match=re.escape("set tls.mode cert-manager-per-node with it")
    ):
        render(values_of("cert-manager.yaml", tls={"acceptSharedCertificate": True}))


def test_only_what_must_differ_is_normalised() -> None:
    helm, kustomized = render(), kustomize(DEPLOY / "base")
    for obj in helm:
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "Helm", name_of(obj)
        assert labels["helm.sh/chart"] == "mtc-replicator-0.1.0", name_of(obj)
    # Kept by `helm uninstall`: the CRD (every CheckpointConfiguration) and the namespace
    # (hand-made Secrets), as the kustomize uninstall steps keep them; nothing else.
    kept = {
        name_of(o)
        for o in helm
        if o["metadata"].get("annotations", {}).get(helm_chart.KEEP_ANNOTATION) == "keep"
    }
    assert kept == {
        "CustomResourceDefinition/checkpointconfigurations.checkpointing.mtc.dev",
        "Namespace/mtc-system",
    }
    assert only(helm, "ConfigMap")["metadata"]["name"] == "mtc-node-default-config"
    assert re.fullmatch(
        r"mtc-node-default-config-[a-z0-9]{10}", only(kustomized, "ConfigMap")["metadata"]["name"]
    )


def _checksum(objs: list[Obj]) -> str:
    annotations = only(objs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    value: str = annotations[helm_chart.CHECKSUM_ANNOTATION]
    return value


def test_a_config_change_rolls_the_pods_and_nothing_else_does() -> None:
    # The pods read the ConfigMap at start only: its checksum on the pod template makes
    # `helm upgrade` replace them when it changes, as kustomize's hash suffix does.
    default = _checksum(render())
    assert re.fullmatch(r"[0-9a-f]{64}", default)
    assert _checksum(render({"ramSize": "100Gi"})) != default
    assert _checksum(render({"backup": {"url": "gs://other-bucket/mtc"}})) != default
    assert _checksum(render({"extraConfig": {"MTC_MAX_TRANSFER_RATE": "400MiB"}})) != default
    assert _checksum(render({"monitoring": {"enabled": True}})) == default


# --- every variant is valid -----------------------------------------------------------------

VARIANTS: dict[str, dict[str, Any]] = {
    **{name: values_of(name) for name in VALUES_FILES},
    "gke+cert-manager": values_of("gke.yaml", "cert-manager.yaml"),
    "eks-gpu+root+per-node": values_of("eks-gpu.yaml", "root.yaml", "cert-manager-per-node.yaml"),
    "everything": values_of(
        "s3.yaml",
        "monitoring.yaml",
        extraConfig={"MTC_MAX_TRANSFER_RATE": "400MiB", "MTC_DRAIN_SECONDS": "30"},
        allowedServiceAccounts=["ml/trainer"],
        backup={"registryUrl": "s3://registry-bucket/mtc"},
        metricsNamespace="prometheus",
    ),
    # A second pool beside the first: its own names, none of the shared objects.
    "second-pool": {
        "name": "tpu",
        "namespace": {"name": "mtc-system", "create": False},
        "crd": {"install": False},
        "clusterObjects": {"create": False},
        # Maps merge with the chart's defaults (Helm's rule): null drops the default label.
        "nodeSelector": {
            "checkpointing.mtc.dev/pool": None,
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        },
    },
}


@functools.cache
def _validated(obj_json: str) -> None:
    validate(json.loads(obj_json))


def validate_once(obj: Obj) -> None:
    """``validate``, once per distinct object: most variants share most objects (the CRD)."""
    _validated(json.dumps(obj, sort_keys=True))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_is_valid(variant: str) -> None:
    objs = render(VARIANTS[variant])
    for obj in objs:
        if obj["kind"] not in MONITORING_KINDS:
            validate_once(obj)
    if not VARIANTS[variant].get("nodeStack", {"enabled": True})["enabled"]:
        # The controller makes each configuration's node stack (tests/controller).
        assert only(objs, "Deployment")["metadata"]["name"] == "mtc-controller"
        assert "DaemonSet" not in {o["kind"] for o in objs}
        return
    # The ConfigMap is what mtc-csi and mtc-replicator read; both containers take it.
    data = only(objs, "ConfigMap")["data"]
    assert all(isinstance(v, str) for v in data.values())
    pod = pod_of(objs)
    for c in ("csi-plugin", "replicator"):
        (ref,) = [r for r in container(pod, c)["envFrom"] if "configMapRef" in r]
        assert ref["configMapRef"]["name"] == only(objs, "ConfigMap")["metadata"]["name"]


def test_a_second_pool_makes_only_its_own_objects() -> None:
    objs = render(VARIANTS["second-pool"])
    assert sorted(name_of(o) for o in objs) == [
        "ConfigMap/mtc-node-tpu-config",
        "DaemonSet/mtc-node-tpu",
        "NetworkPolicy/mtc-node-tpu",
        "ServiceAccount/mtc-node-tpu",
    ]
    pod = pod_of(objs)
    assert pod["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
    }
    # Its pods' names are still nodes to the daemon's per-node certificate check.
    assert re.fullmatch(render_manifests.NODE_POD_PATTERN, "mtc-node-tpu-x7k2p")
    longest = render({"name": "p" * 48})
    assert re.fullmatch(
        render_manifests.NODE_POD_PATTERN, only(longest, "DaemonSet")["metadata"]["name"] + "-x7k2p"
    )
    # With cert-manager, the CA (the first release's) is not made twice; its own shared
    # certificate, under its own name, is.
    per_node = render(VARIANTS["second-pool"] | {"tls": {"mode": "cert-manager-per-node"}})
    assert sorted(name_of(o) for o in per_node) == sorted(name_of(o) for o in objs)
    shared = render(
        VARIANTS["second-pool"] | {"tls": {"mode": "cert-manager", "secretName": "mtc-tpu-tls"}}
    )
    (certificate,) = [o for o in shared if o["kind"] == "Certificate"]
    assert certificate["spec"]["secretName"] == "mtc-tpu-tls"
    assert certificate["spec"]["issuerRef"]["name"] == "mtc-ca"
    for obj in shared:
        validate_once(obj)


def test_root_images_run_the_replicator_as_root_without_privileges() -> None:
    pod = pod_of(render(values_of("root.yaml")))
    replicator = container(pod, "replicator")
    sc = replicator["securityContext"]
    assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (0, 65532, False)
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    # The RAM disk keeps the replicator's group: pods of the same job that run as non-root
    # (a sidecar, an evaluator) still reach it through fsGroup.
    assert pod["securityContext"]["fsGroup"] == 65532
    assert env(container(pod, "csi-plugin"))["MTC_CSI_FS_GROUP"] == "65532"


def test_the_values_files_say_what_they_set() -> None:
    s3 = render(values_of("s3.yaml"))
    (secret,) = [r for r in container(pod_of(s3), "replicator")["envFrom"] if "secretRef" in r]
    assert secret["secretRef"] == {"name": "mtc-backup-credentials", "optional": False}
    assert "mtc-backup-credentials" in helm_chart.notes(values_of("s3.yaml"))
    assert "mtc certs secret" in helm_chart.notes()
    assert "mtc certs secret" not in helm_chart.notes(values_of("cert-manager.yaml"))
    eks = render(values_of("eks-gpu.yaml"))
    assert only(eks, "ServiceAccount")["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/mtc-backup"
    }
    (secret,) = [r for r in container(pod_of(eks), "replicator")["envFrom"] if "secretRef" in r]
    assert secret["secretRef"]["optional"] is True  # IRSA: no keys
    data = only(eks, "ConfigMap")["data"]
    assert (data["MTC_BACKUP"], data["AWS_DEFAULT_REGION"]) == (
        "s3://change-me-bucket/mtc",
        "us-east-1",
    )


# --- GPU pools ------------------------------------------------------------------------------

Node = tuple[dict[str, str], list[dict[str, str]]]
"""A node's labels and taints."""

LINUX = {"kubernetes.io/os": "linux"}
POOL = {"checkpointing.mtc.dev/pool": "true"}
# Nodes as docs/deploy.md ("The node pool") makes them on each cloud: the labelled GPU pool,
# a GPU pool nobody labelled (another team's), and the system pool.
CLOUDS: dict[str, dict[str, Node]] = {
    "gke-gpu.yaml": {
        "gpu": (
            LINUX | POOL | {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
            [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        ),
        "other-gpu": (
            LINUX | {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        ),
        "system": (LINUX | {"cloud.google.com/gke-nodepool": "default-pool"}, []),
    },
    "eks-gpu.yaml": {
        "gpu": (
            LINUX | POOL | {"eks.amazonaws.com/nodegroup": "gpu"},
            [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        ),
        "other-gpu": (
            LINUX | {"eks.amazonaws.com/nodegroup": "gpu-inference"},
            [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
        ),
        "system": (
            LINUX | {"eks.amazonaws.com/nodegroup": "system"},
            [{"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}],
        ),
    },
    "aks-gpu.yaml": {
        "gpu": (
            LINUX | POOL | {"kubernetes.azure.com/agentpool": "gpu"},
            [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}],
        ),
        "other-gpu": (
            LINUX | {"kubernetes.azure.com/agentpool": "gpu2"},
            [{"key": "sku", "value": "gpu", "effect": "NoSchedule"}],
        ),
        "system": (
            LINUX | {"kubernetes.azure.com/mode": "system"},
            [{"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}],
        ),
    },
}


def _tolerated(taint: dict[str, str], tolerations: list[dict[str, Any]]) -> bool:
    """kubelet's and the scheduler's rule (k8s.io/api/core/v1 Toleration.ToleratesTaint)."""
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("key") and t["key"] != taint["key"]:
            continue
        operator = t.get("operator", "Equal")
        if operator == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def schedulable(pod: Obj, node: Node) -> bool:
    """Whether a DaemonSet's pod runs on the node: its nodeSelector matches the node's labels,
    and every NoSchedule and NoExecute taint is tolerated."""
    labels, taints = node
    if any(labels.get(k) != v for k, v in pod.get("nodeSelector", {}).items()):
        return False
    return all(
        _tolerated(taint, pod.get("tolerations", []))
        for taint in taints
        if taint["effect"] in ("NoSchedule", "NoExecute")
    )


@pytest.mark.parametrize("values_file", list(CLOUDS))
def test_each_cloud_s_gpu_pool_gets_the_stack_and_no_other_node_does(values_file: str) -> None:
    nodes = CLOUDS[values_file]
    for values in (values_of(values_file), {}):  # the cloud's file, and the chart's defaults
        pod = pod_of(render(values))  # valid: test_every_variant_is_valid
        assert {n for n, node in nodes.items() if schedulable(pod, node)} == {"gpu"}, values
    # A GPU node whose taint it does not tolerate is not a node it runs on.
    labels, _ = nodes["gpu"]
    assert not schedulable(
        pod_of(render(values_of(values_file))),
        (labels, [{"key": "dedicated", "value": "training", "effect": "NoExecute"}]),
    )
    # PreferNoSchedule only discourages: not a reason to stay off.
    assert schedulable(
        pod_of(render(values_of(values_file))),
        (labels, [{"key": "dedicated", "value": "training", "effect": "PreferNoSchedule"}]),
    )


def test_every_kustomization_has_its_values() -> None:
    # A new overlay needs its values file here, or the chart would lag behind it unseen.
    from tests.deploy.test_manifests import CONTROLLER_OVERLAY, KUSTOMIZATIONS

    assert sorted(MIRRORS) == sorted(
        str(p.relative_to(DEPLOY)) for p in [*KUSTOMIZATIONS, CONTROLLER_OVERLAY]
    )
    for files in MIRRORS.values():
        assert all((VALUES_DIR / f).is_file() for f in files)


def test_requiring_rank_grants_is_for_the_controller_and_per_node_certificates() -> None:
    def env_of(objs: list[Obj]) -> dict[str, str]:
        replicator = pod_of(objs)["containers"][0]
        return {e["name"]: e.get("value", "") for e in replicator["env"]}

    values = values_of("cert-manager-per-node.yaml", controller={"enabled": True})
    assert "MTC_REQUIRE_RANK_GRANT" not in env_of(render(values))
    required = merge(values, {"controller": {"requireRankGrant": True}})
    objs = render(required)
    assert env_of(objs)["MTC_REQUIRE_RANK_GRANT"] == "true"
    for obj in objs:
        validate_once(obj)
    for bad in (
        merge(required, {"controller": {"enabled": False}}),
        merge(required, {"tls": {"acceptSharedCertificate": True}}),
        values_of("cert-manager.yaml", controller={"enabled": True, "requireRankGrant": True}),
    ):
        with pytest.raises(HelmRenderError, match=re.escape("controller.requireRankGrant needs")):
            render(bad)
