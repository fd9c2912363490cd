"""The controller dials every replicator's gRPC port (sticky ranks: ``Node/Status`` for what a
node holds, ``Node/AssignRank`` to hand a pod its rank; controller/sticky.py through
plan.replicator_address(pod, "grpc")). Every NetworkPolicy of a node stack (kustomize, the
chart, ``mtc render`` and so the controller's own) must admit the controller's pods there,
and no more: the data port stays the peers' alone."""

from __future__ import annotations

import pytest
import yaml

from mtc_replicator.controller import sticky
from mtc_replicator.tools import render, render_manifests
from tests.deploy import helm_chart
from tests.deploy.k8s import DEPLOY, Obj, ingress_rules, kustomize, only

CONTROLLER_PEER = (
    "namespace:kubernetes.io/metadata.name=mtc-system&pods:app.kubernetes.io/name=mtc-controller"
)


def _builds() -> list[tuple[str, list[Obj]]]:
    out = [(str(p.relative_to(DEPLOY)), kustomize(p)) for p in (DEPLOY / "base",)]
    out += [
        (str(p.relative_to(DEPLOY)), kustomize(p))
        for p in sorted((DEPLOY / "overlays").iterdir())
        if p.is_dir() and p.name != "controller"
    ]
    out.append(("helm", helm_chart.render({})))
    example = DEPLOY / "examples" / "checkpointconfiguration.yaml"
    out.append(("render", render.render(yaml.safe_load(example.read_text()))))
    return out


@pytest.mark.parametrize(("name", "objs"), _builds(), ids=lambda x: x if isinstance(x, str) else "")
def test_the_controller_reaches_the_port_it_dials(name: str, objs: list[Obj]) -> None:
    ds = only(objs, "DaemonSet")
    (replicator,) = [
        c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "replicator"
    ]
    ports = {p["name"]: p["containerPort"] for p in replicator["ports"]}
    grpc_port = ports[sticky.GRPC_PORT_NAME]
    rules = ingress_rules(only(objs, "NetworkPolicy"))
    assert (CONTROLLER_PEER, grpc_port) in rules, f"{name}: sticky ranks cannot reach {grpc_port}"
    # Only gRPC and metrics: never the data port.
    assert {port for peer, port in rules if peer == CONTROLLER_PEER} == {
        grpc_port,
        render_manifests.METRICS_PORT,
    }
