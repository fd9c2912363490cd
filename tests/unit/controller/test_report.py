"""controller.report: a replicator's /readyz and /metrics (as its own metrics code writes
them) to a node's report, reports to status.jobs and to reasons, and to Events."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from mtc_replicator.controller import plan
from mtc_replicator.controller.report import (
    MAX_JOBS,
    BadReport,
    Limiter,
    NodeReport,
    alerts,
    jobs_status,
    parse_metrics,
    readiness_lines,
)
from mtc_replicator.obs.metrics import ErrorKind, PrometheusMetrics

T0 = 1_790_000_000.0  # 2026-09-21T14:13:20Z


def exported(
    job: str,
    local: int | None = None,
    cluster: int | None = None,
    backup: int | None = None,
    *,
    at: float = T0,
    backup_errors: int = 0,
    failed_restores: int = 0,
) -> str:
    """What a daemon's /metrics says, from the daemon's own metrics code."""
    m = PrometheusMetrics(clock=lambda: at)
    m.serving(job)
    if local is not None:
        m.committed(job, local)
    if cluster is not None:
        m.cluster_restorable(job, cluster)
    if backup is not None:
        m.backed_up(job, backup, at - 60)
    for _ in range(backup_errors):
        m.error(ErrorKind.BACKUP)
    for _ in range(failed_restores):
        m.restore_failed(job, 1.0)
    return generate_latest(m.registry).decode()


def test_a_daemons_metrics_read_back_per_tier_with_their_times() -> None:
    r = parse_metrics("n0", (), exported("llama", local=40, cluster=35, backup=30, at=T0))
    assert r.answered
    assert r.error is None
    (job,) = r.jobs
    assert job.job == "llama"
    assert {t: (v.step, v.at) for t, v in job.tiers.items()} == {
        "local": (40, T0),
        "replicated": (35, T0),
        "backup": (30, T0 - 60),
    }
    assert r.backup_errors == 0
    assert r.reason == "ready"


def test_jobs_status_folds_the_nodes() -> None:
    reports = [
        parse_metrics("n0", (), exported("llama", local=40, cluster=35, backup=30, at=T0)),
        parse_metrics("n1", (), exported("llama", local=35, cluster=40, backup=30, at=T0 + 5)),
        parse_metrics("n2", (), exported("llama", local=35, at=T0 + 9)),
    ]
    (entry,) = jobs_status(reports)
    assert entry == {
        "job": "llama",
        "nodes": 3,
        # The step every node holds (the lowest), when the last of them got it.
        "local": {"step": 35, "at": "2026-09-21T14:13:29Z"},
        # The newest any node knows, when the first to know it got it.
        "replicated": {"step": 40, "at": "2026-09-21T14:13:25Z"},
        "backup": {"step": 30, "at": "2026-09-21T14:12:20Z"},
    }


def test_a_node_without_a_local_copy_leaves_the_local_tier_out() -> None:
    reports = [
        parse_metrics("n0", (), exported("a", local=4)),
        parse_metrics("n1", (), exported("a", backup=2)),
        NodeReport("n2", False, error="cannot connect"),  # not asked: not counted
    ]
    (entry,) = jobs_status(reports)
    assert entry["nodes"] == 2
    assert "local" not in entry
    assert entry["backup"]["step"] == 2


def test_hostile_or_broken_metrics_are_bounded() -> None:
    with pytest.raises(BadReport, match="not Prometheus text"):
        parse_metrics("n0", (), "mtc_newest_restorable_step{tier= nonsense\n")
    text = "\n".join(
        [
            "# TYPE mtc_newest_restorable_step gauge",
            'mtc_newest_restorable_step{mtc_job="../../etc",tier="local"} 5',  # not a job name
            'mtc_newest_restorable_step{mtc_job="neg",tier="local"} -1',
            'mtc_newest_restorable_step{mtc_job="nan",tier="local"} NaN',
            'mtc_newest_restorable_step{mtc_job="big",tier="local"} 1e30',
            'mtc_newest_restorable_step{mtc_job="ok",tier="nonsense"} 3',
            *(
                f'mtc_newest_restorable_step{{mtc_job="j{i:03d}",tier="local"}} {i}'
                for i in range(3 * MAX_JOBS)
            ),
            "",
        ]
    )
    r = parse_metrics("n0", (), text)
    assert [j.job for j in r.jobs] == [f"j{i:03d}" for i in range(MAX_JOBS)]


def test_readiness_lines() -> None:
    assert readiness_lines(200, "ok\n") == ()
    long = "backup s3://b/p refused: " + "x" * 1000
    lines = readiness_lines(503, f"CHECKPOINT_DIR /x is missing\n{long}\n" + "more\n" * 9)
    assert lines[0] == "CHECKPOINT_DIR /x is missing"
    assert len(lines) == 5
    assert len(lines[1]) == 300
    assert lines[1].endswith("...")
    assert readiness_lines(503, "") == ("/readyz answered 503",)
    # Not the replicator's way of saying it: nothing of the page is kept.
    assert readiness_lines(404, "<html>an internal page</html>") == ("/readyz answered 404",)


def test_not_ready_entries_carry_the_replicators_reason() -> None:
    pods = [
        {
            "metadata": {"name": "p0"},
            "spec": {"nodeName": "n0"},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]},
        }
    ]
    reports = {"n0": NodeReport("n0", True, ("CHECKPOINT_DIR /d is missing or not a directory",))}
    st = plan.status(
        1, None, plan.counts(None), [], "2026-01-01T00:00:00Z", pods=pods, reports=reports
    )
    (entry,) = st["nodes"]["notReady"]
    assert entry["replicator"] == "CHECKPOINT_DIR /d is missing or not a directory"
    assert st["nodes"]["reporting"] == 1
    # Written again before the next look (a DaemonSet's event): the reason and jobs stay.
    again = plan.status(
        1,
        None,
        plan.counts(None),
        [],
        "2026-01-01T00:00:05Z",
        pods=pods,
        not_ready_before=st["nodes"]["notReady"],
        jobs_before=[{"job": "a", "nodes": 1}],
    )
    assert again["nodes"]["notReady"][0]["replicator"] == entry["replicator"]
    assert again["jobs"] == [{"job": "a", "nodes": 1}]
    unreachable = NodeReport("n0", False, error="no answer within 2 s")
    assert unreachable.reason == "unreachable: no answer within 2 s"


def test_alerts_on_what_grew_since_the_last_answer() -> None:
    first = parse_metrics("n0", (), exported("a", local=1))
    assert alerts(None, first) == []  # a baseline, not an alert
    failing = parse_metrics("n0", (), exported("a", local=1, backup_errors=2))
    (a,) = alerts(first, failing)
    assert (a.reason, a.key) == ("BackupFailing", "backup/n0")
    assert "2 backup error(s)" in a.message
    assert alerts(failing, failing) == []
    blocked = parse_metrics("n0", (), exported("a", local=1, backup_errors=2, failed_restores=1))
    (b,) = alerts(failing, blocked)
    assert (b.reason, b.key) == ("RestoreBlocked", "restore/a/n0")
    # A restarted daemon's counters start again: its new count is what grew.
    restarted = parse_metrics("n0", (), exported("a", local=1, backup_errors=1))
    assert [x.reason for x in alerts(blocked, restarted)] == ["BackupFailing"]
    assert alerts(first, NodeReport("n0", False, error="x")) == []


def test_the_limiter_allows_one_per_key_per_period() -> None:
    lim = Limiter(600)
    assert lim.allow("backup/n0", 0)
    assert not lim.allow("backup/n0", 599)
    assert lim.allow("backup/n1", 10)
    assert lim.allow("backup/n0", 600)


def test_the_network_policy_admits_the_controllers_namespace() -> None:
    cr = {
        "apiVersion": "checkpointing.mtc.dev/v1",
        "kind": "CheckpointConfiguration",
        "metadata": {"name": "c", "namespace": "team-a", "uid": "u", "generation": 1},
        "spec": {"backupUrl": "gs://bucket-x/p", "inMemoryVolumeSize": "4Gi"},
    }
    policy = next(o for o in plan.desired(cr, "ops").owned if o["kind"] == "NetworkPolicy")
    metrics = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9464)
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "mtc-controller"}},
    } in metrics["from"]
