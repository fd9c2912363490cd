"""deploy/components/monitoring: the PodMonitor finds the replicators' metrics port, and every
alert of the PrometheusRule asks for metrics the daemon really exports.

The Prometheus Operator's CRDs are not vendored here, so the objects' shape is checked by
hand against the monitoring.coreos.com/v1 fields they use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mtc_replicator.core.timeline import RestorePhase
from mtc_replicator.obs.metrics import (
    FilesystemCollector,
    PrometheusMetrics,
    process_metrics,
)
from tests.deploy import helm_chart
from tests.deploy.k8s import DEPLOY, Obj, container, kustomize, only, pod_of, seconds
from tests.deploy.test_manifests import _overlay

COMPONENT = DEPLOY / "components" / "monitoring"
GROUP_VERSION = "monitoring.coreos.com/v1"
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "min", "max", "sum", "avg", "count", "rate", "increase", "irate",
    "histogram_quantile", "absent", "scalar", "time", "le", "inf", "nan",
}  # fmt: skip
"""PromQL keywords, functions and aggregations the rules may use: anything else is a metric."""


@pytest.fixture(scope="module", params=["kustomize", "helm"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """deploy/base with the component, as docs/deploy.md tells to add it; or the Helm chart
    with monitoring on."""
    if request.param == "helm":
        return helm_chart.render_files("monitoring.yaml")
    tmp = tmp_path_factory.mktemp("monitoring")
    text = yaml.safe_dump(
        {"resources": ["../../base"], "components": ["../../components/monitoring"]}
    )
    return kustomize(_overlay(tmp, text))


@dataclass(frozen=True)
class Contact:
    """A peer's last contact, as ``core.contacts`` has it."""

    peer: str
    reachable: bool
    last_answer_at: float | None


def exported_metrics(tmp_path: Path) -> set[str]:
    """Every sample name a daemon with a job in every tier exports (the daemon registers
    these collectors on its registry, node/daemon.py)."""
    metrics = PrometheusMetrics(phases=[p.value for p in RestorePhase])
    process_metrics(metrics.registry)
    metrics.registry.register(FilesystemCollector(tmp_path, "mtc_checkpoint_dir", "test"))
    metrics.committed("j", 3)
    metrics.replicated("j", 2)
    metrics.cluster_restorable("j", 2)
    metrics.backed_up("j", 2, 1.0)
    metrics.restore_failed("j", 1.0)
    metrics.pin_delete_failed("j")
    metrics.off_node_copies("j", 0)
    metrics.peer_contacts(
        lambda: [Contact("10.0.0.2:7070", reachable=False, last_answer_at=1.0)],
        lambda: ["10.0.0.2:7070"],
    )
    text = generate_latest(metrics.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def metric_names(expr: str) -> set[str]:
    """The metric names in a PromQL expression: its identifiers less label matchers,
    grouping labels, durations and PromQL's own words."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range durations
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return {w for w in words if w.lower() not in PROMQL_WORDS}


def test_metric_names_sees_every_metric() -> None:
    assert metric_names('min by (job) (a_b{tier="x"}) > 2 * 30') == {"a_b"}
    assert metric_names("histogram_quantile(0.99, sum by (le) (rate(x_bucket[1h])))") == {
        "x_bucket"
    }
    assert metric_names("a / b < 0.1") == {"a", "b"}


def test_the_component_adds_a_pod_monitor_and_rules_only(built: list[Obj]) -> None:
    component = {(o["kind"], o["metadata"]["name"]) for o in kustomize(COMPONENT)}
    assert component == {
        ("PodMonitor", "mtc-node-default"),
        ("PrometheusRule", "mtc-node-default"),
    }
    kinds = [o["kind"] for o in built]
    assert kinds.count("PodMonitor") == kinds.count("PrometheusRule") == 1


def test_the_pod_monitor_scrapes_the_replicators_metrics_port(built: list[Obj]) -> None:
    ds = only(built, "DaemonSet")
    monitor = only(built, "PodMonitor")
    assert monitor["apiVersion"] == GROUP_VERSION
    assert monitor["metadata"]["namespace"] == ds["metadata"]["namespace"]
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "podMetricsEndpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [ds["metadata"]["namespace"]]}
    # It selects exactly the DaemonSet's pods.
    selector = spec["selector"]["matchLabels"]
    assert selector == ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = spec["podMetricsEndpoints"]
    replicator = container(pod_of(built), "replicator")
    ports = {p["name"]: p["containerPort"] for p in replicator["ports"]}
    assert endpoint["port"] in ports
    assert ports[endpoint["port"]] == int(
        next(e["value"] for e in replicator["env"] if e["name"] == "MTC_METRICS").rsplit(":")[1]
    )
    assert endpoint["path"] == "/metrics"
    # The training job is `mtc_job`: Prometheus' own labels need no overriding.
    assert not endpoint.get("honorLabels", False)
    assert seconds(endpoint["scrapeTimeout"]) < seconds(endpoint["interval"])


def test_every_alert_is_well_formed_and_asks_for_real_metrics(
    built: list[Obj], tmp_path: Path
) -> None:
    rule = only(built, "PrometheusRule")
    assert rule["apiVersion"] == GROUP_VERSION
    assert rule["metadata"]["namespace"] == only(built, "DaemonSet")["metadata"]["namespace"]
    exported = exported_metrics(tmp_path)
    alerts = []
    for group in rule["spec"]["groups"]:
        assert set(group) == {"name", "rules"}
        for r in group["rules"]:
            assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
            assert re.fullmatch(r"Mtc[A-Z][A-Za-z]+", r["alert"]), r["alert"]
            assert r["labels"]["severity"] in ("info", "warning", "critical"), r
            assert set(r["annotations"]) == {"summary", "description"}, r
            if "for" in r:
                assert seconds(r["for"]) > 0
            names = metric_names(r["expr"])
            assert names, r["expr"]
            assert names <= exported, f"{r['alert']}: {names - exported} not exported"
            # The training job is `mtc_job`; `job` is Prometheus' scrape job.
            text = r["expr"] + " ".join(r["annotations"].values())
            assert not re.search(r"\bby \(job\)|\$labels\.job\b|\bjob=", text), r
            alerts.append(r["alert"])
    assert len(alerts) == len(set(alerts))
    assert {
        "MtcBackupStale",
        "MtcReplicationLagging",
        "MtcRestoreFailed",
        "MtcNoCopyOffNode",
    } <= set(alerts)


def test_every_alert_expression_of_the_docs_is_a_rule(built: list[Obj]) -> None:
    """docs/metrics.md lists the alert expressions; the rules ship each of them."""
    docs = (DEPLOY.parent / "docs" / "metrics.md").read_text()
    block = docs.split("```promql", 1)[1].split("```", 1)[0]
    documented = {
        line.strip()
        for line in block.splitlines()
        if re.search(r" [<>]=? ", line) and not line.startswith("#")
    }
    rules = {
        " ".join(r["expr"].split())
        for g in only(built, "PrometheusRule")["spec"]["groups"]
        for r in g["rules"]
    }
    assert documented
    assert {" ".join(d.split()) for d in documented} <= rules
