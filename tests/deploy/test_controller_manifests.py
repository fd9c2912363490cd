"""The controller's install (deploy/overlays/controller, and the chart with values/controller.yaml,
which test_helm.py keeps equal): valid offline, two replicas with probes, no static node stack,
and RBAC that grants what the controller uses and nothing broader (tests/controller runs the
controller under this very RBAC against a real API server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.core.identity import CONTROLLER_URI
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


def _controller_certificate(objs: list[Obj]) -> Obj:
    (cert,) = [
        o
        for o in objs
        if o["kind"] == "Certificate" and o["metadata"]["name"] == "mtc-controller-tls"
    ]
    return cert


@pytest.mark.parametrize("how", ["kustomize", "helm"])
def test_the_controller_gets_a_certificate_the_replicators_take_assignrank_from(
    how: str, tmp_path: Path
) -> None:
    """Sticky ranks: with cert-manager, a certificate from the node stack's CA naming the
    controller (the identity the replicators admit on AssignRank), mounted where the
    controller's MTC_TLS_* point; the Secret optional (without it: plaintext, indexes)."""
    if how == "helm":
        objs = helm_chart.render_files("controller.yaml", "cert-manager.yaml")
        assert not [
            o
            for o in helm_chart.render_files("controller.yaml")
            if o["kind"] == "Certificate" and o["metadata"]["name"] == "mtc-controller-tls"
        ]
    else:
        overlay = tmp_path / "overlay"
        overlay.mkdir()
        there = os.path.relpath(DEPLOY, overlay)
        (overlay / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"resources: [{there}/overlays/controller]\n"
            f"components: [{there}/components/cert-manager, "
            f"{there}/components/controller-certificate]\n"
        )
        objs = kustomize(overlay)
    cert = _controller_certificate(objs)
    spec = cert["spec"]
    assert spec["uris"] == [CONTROLLER_URI]
    assert "client auth" in spec["usages"]
    assert "server auth" not in spec["usages"]
    issuer = spec["issuerRef"]["name"]
    assert any(o["kind"] == "Issuer" and o["metadata"]["name"] == issuer for o in objs)
    pod = only(objs, "Deployment")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret")]
    assert volume["secret"]["secretName"] == spec["secretName"]
    assert volume["secret"]["optional"] is True
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    envs = {e["name"]: e.get("value") for e in c["env"]}
    for name, file in (
        ("MTC_TLS_CERT", "tls.crt"),
        ("MTC_TLS_KEY", "tls.key"),
        ("MTC_TLS_CA", "ca.crt"),
    ):
        assert envs[name] == f"{mount['mountPath']}/{file}"
