"""The controller's install (deploy/overlays/controller, and the chart with values/controller.yaml,
which test_helm.py keeps equal): valid offline, two replicas with probes, no static node stack,
and RBAC that grants what the controller uses and nothing broader (tests/controller runs the
controller under this very RBAC against a real API server)."""

from __future__ import annotations

import pytest

from tests.deploy import helm_chart
from tests.deploy.k8s import DEPLOY, Obj, kustomize, only, validate


@pytest.fixture(params=["kustomize", "helm"])
def built(request: pytest.FixtureRequest) -> list[Obj]:
    if request.param == "helm":
        return helm_chart.render_files("controller.yaml")
    return kustomize(DEPLOY / "overlays" / "controller")


def test_valid_and_without_a_static_node_stack(built: list[Obj]) -> None:
    for obj in built:
        validate(obj)
    kinds = {o["kind"] for o in built}
    assert "DaemonSet" not in kinds
    assert "ConfigMap" not in kinds
    assert {"CustomResourceDefinition", "Namespace", "Deployment", "PodDisruptionBudget"} <= kinds


def test_two_replicas_with_probes_and_no_privileges(built: list[Obj]) -> None:
    deployment = only(built, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "mtc-controller"
    (c,) = pod["containers"]
    assert c["command"] == ["mtc-controller"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert only(built, "PodDisruptionBudget")["spec"]["minAvailable"] == 1


def _rules(built: list[Obj], kind: str) -> list[Obj]:
    return [r for o in built if o["kind"] == kind for r in o["rules"]]


def test_rbac_is_least_privilege(built: list[Obj]) -> None:
    rules = _rules(built, "ClusterRole") + _rules(built, "Role")
    for rule in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
    granted = {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # Never Secrets (the node stack's keys), never pods/exec, never RBAC; CRDs read only.
    resources = {r for _, r, _ in granted}
    assert not resources & {"secrets", "pods/exec", "roles", "clusterroles"}
    # Pods: listed (status) and annotated on a delete (the RAM disk's release), no more.
    assert {v for _, r, v in granted if r == "pods"} == {"list", "watch", "patch"}
    crds = {v for _, r, v in granted if r == "customresourcedefinitions"}
    assert crds == {"get", "list", "watch"}
    # Shared objects are only made, never changed or deleted.
    for shared in ("priorityclasses", "csidrivers", "issuers", "certificates"):
        assert {v for _, r, v in granted if r == shared} == {"get", "create"}, shared
    assert ("", "nodes", "list") in granted
    assert ("checkpointing.mtc.dev", "checkpointconfigurations/status", "patch") in granted
    # The Lease: updated by name only, in the controller's namespace only.
    (lease_role,) = [o for o in built if o["kind"] == "Role"]
    named = [r for r in lease_role["rules"] if "update" in r["verbs"]]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["mtc-controller"],
            "verbs": ["get", "update"],
        }
    ]
