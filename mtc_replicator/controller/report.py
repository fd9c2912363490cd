"""Each node's replicator, as it reports itself, folded into its configuration's status.

Pure: the texts of a node's ``/readyz`` and ``/metrics`` (read by ``controller.scrape``) to
a ``NodeReport``; reports to ``status.jobs`` and to the daemon's own reason on each entry
of ``status.nodes.notReady``; two reports of a node to the Events an operator must act on.
What a node says is untrusted: bounded, validated, and taken as true of that node only.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mtc_replicator.core.jobname import is_job_name

MAX_JOBS = 20
"""Jobs listed in ``status.jobs`` (the newest-moving first), and read from one node."""
MAX_PROBLEMS = 5
"""``/readyz`` lines kept per node."""
MAX_LINE = 300
"""Characters kept of each line a node sends."""
MAX_STEP = 2**63 - 1

TIERS = {"local": "local", "cluster": "replicated", "backup": "backup"}
"""``mtc_newest_restorable_*``'s tiers, by the name ``status.jobs`` gives each: ``local``
(this node's store), ``replicated`` (every rank can restore it from the nodes' RAM, its own
or a peer's copy, as the coordinator said), ``backup``."""


class BadReport(ValueError):
    """A node's ``/metrics`` that is not Prometheus text."""


@dataclass(frozen=True)
class Tier:
    step: int
    at: float | None
    """When the step became restorable from the tier (Unix time); None: not exported."""


@dataclass(frozen=True)
class JobReport:
    job: str
    tiers: Mapping[str, Tier]
    """By ``status.jobs`` name: ``local``, ``replicated``, ``backup``."""
    restores_failed: float = 0.0
    """``mtc_restore_rounds_total{outcome="failed"}``: a counter."""


@dataclass(frozen=True)
class NodeReport:
    """One node's replicator, as it last answered (or why it did not)."""

    node: str
    answered: bool
    problems: tuple[str, ...] = ()
    """``/readyz``'s lines: empty when ready."""
    error: str | None = None
    """Why it could not be read: unreachable, timed out, not Prometheus text."""
    jobs: tuple[JobReport, ...] = ()
    backup_errors: float | None = None
    """``mtc_errors_total{kind="backup"}``: a counter; None: not exported."""

    @property
    def reason(self) -> str:
        """The replicator's own word on why the node is not ready, one line."""
        if not self.answered:
            return f"unreachable: {self.error}"
        if self.problems:
            return "; ".join(self.problems)
        return "ready"


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."


def readiness_lines(status: int, body: str) -> tuple[str, ...]:
    """``/readyz``: 200 is ready; 503 (how the replicator says not ready) is its lines; any
    other answer is not the replicator's, so only its status code is kept: nothing of
    another server's page reaches the configuration's status."""
    if status == 200:
        return ()
    lines = [_clip(x) for x in body.splitlines() if x.strip()][:MAX_PROBLEMS]
    return tuple(lines) if status == 503 and lines else (f"/readyz answered {status}",)


def _step(value: float) -> int | None:
    if not math.isfinite(value) or value < 0 or value > MAX_STEP:
        return None
    return int(value)


def parse_metrics(node: str, problems: tuple[str, ...], text: str) -> NodeReport:
    """A node's report from its ``/metrics`` text; ``BadReport`` when it is not Prometheus
    text. Series of names that are not job names, and jobs past ``MAX_JOBS``, are ignored."""
    steps: dict[tuple[str, str], int] = {}
    times: dict[tuple[str, str], float] = {}
    failed: dict[str, float] = {}
    backup_errors: float | None = None
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                job = s.labels.get("mtc_job", "")
                tier = TIERS.get(s.labels.get("tier", ""))
                if s.name == "mtc_newest_restorable_step" and tier and is_job_name(job):
                    step = _step(s.value)
                    if step is not None:
                        steps[(job, tier)] = step
                elif s.name == "mtc_newest_restorable_timestamp_seconds" and tier:
                    if math.isfinite(s.value) and s.value > 0:
                        times[(job, tier)] = s.value
                elif not math.isfinite(s.value):
                    continue
                elif s.name == "mtc_restore_rounds_total" and is_job_name(job):
                    if s.labels.get("outcome") == "failed":
                        failed[job] = s.value
                elif s.name == "mtc_errors_total" and s.labels.get("kind") == "backup":
                    backup_errors = s.value
    except (ValueError, TypeError, IndexError):
        # Not the parser's message: it quotes the text, which may be another server's.
        raise BadReport("/metrics is not Prometheus text") from None
    names = sorted({job for job, _ in steps} | set(failed))[:MAX_JOBS]
    jobs = tuple(
        JobReport(
            job,
            {t: Tier(s, times.get((job, t))) for (j, t), s in steps.items() if j == job},
            failed.get(job, 0.0),
        )
        for job in names
    )
    return NodeReport(node, True, problems, None, jobs, backup_errors)


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _tier_entry(step: int, at: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"step": step}
    if at is not None:
        out["at"] = _iso(at)
    return out


def jobs_status(reports: Iterable[NodeReport]) -> list[dict[str, Any]]:
    """``status.jobs``: per job the nodes that report it, and per tier the newest step and
    when it became restorable there. ``local``: the newest step every reporting node holds
    in its own store (the lowest of theirs), ``at`` when the last of them got it;
    ``replicated`` and ``backup``: the newest any node knows (the coordinator's word reaches
    the nodes one by one), ``at`` as the first node to know it says."""
    by_job: dict[str, list[JobReport]] = {}
    for r in reports:
        if r.answered:
            for j in r.jobs:
                by_job.setdefault(j.job, []).append(j)
    out = []
    for job, seen in by_job.items():
        entry: dict[str, Any] = {"job": job, "nodes": len(seen)}
        local = [j.tiers.get("local") for j in seen]
        if local and all(t is not None for t in local):
            held = [t for t in local if t is not None]
            low = min(t.step for t in held)
            ats = [t.at for t in held if t.step == low and t.at is not None]
            entry["local"] = _tier_entry(low, max(ats) if ats else None)
        for tier in ("replicated", "backup"):
            found = [t for j in seen if (t := j.tiers.get(tier)) is not None]
            if found:
                high = max(t.step for t in found)
                ats = [t.at for t in found if t.step == high and t.at is not None]
                entry[tier] = _tier_entry(high, min(ats) if ats else None)
        out.append(entry)

    def newest(e: dict[str, Any]) -> tuple[float, str]:
        stamps = [e[t]["at"] for t in ("local", "replicated", "backup") if "at" in e.get(t, {})]
        return (-_epoch(max(stamps)) if stamps else 0.0, e["job"])

    return sorted(out, key=newest)[:MAX_JOBS]


def _epoch(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def with_reasons(
    entries: Sequence[Mapping[str, Any]], reports: Mapping[str, NodeReport]
) -> list[dict[str, Any]]:
    """``status.nodes.notReady`` with the replicator's own reason (``replicator``) beside
    kubelet's, for every node whose replicator was asked."""
    out = []
    for e in entries:
        entry = dict(e)
        r = reports.get(str(e.get("node")))
        if r is not None:
            entry["replicator"] = r.reason
        out.append(entry)
    return out


@dataclass(frozen=True)
class Alert:
    """An Event to post: ``key`` says what it is about, for rate limiting."""

    key: str
    reason: str
    message: str


def alerts(before: NodeReport | None, now: NodeReport) -> list[Alert]:
    """What changed between two answers of one node that an operator must act on: backup
    errors counted (a failing upload or listing), and a job's restore that failed there
    (``replicator.failed`` written). A first answer sets the baseline: a counter that is
    lower than before is a restarted daemon, its new count the increase."""
    if before is None or not before.answered or not now.answered:
        return []
    out = []
    grew = _grew(before.backup_errors, now.backup_errors)
    if grew:
        out.append(
            Alert(
                f"backup/{now.node}",
                "BackupFailing",
                f"node {now.node}: {grew:g} backup error(s) since the last look; the "
                "replicator's log there says which upload or listing failed and why",
            )
        )
    old = {j.job: j.restores_failed for j in before.jobs}
    for j in now.jobs:
        grew = _grew(old.get(j.job, 0.0), j.restores_failed)
        if grew:
            out.append(
                Alert(
                    f"restore/{j.job}/{now.node}",
                    "RestoreBlocked",
                    f"job {j.job}: its restore failed on node {now.node} "
                    "(replicator.failed written; the job's replicator.errors and the "
                    "replicator's log there say why)",
                )
            )
    return out


def _grew(before: float | None, now: float | None) -> float:
    if now is None or before is None:
        return 0.0
    return now if now < before else now - before


@dataclass
class Limiter:
    """At most one Event per key per ``every`` seconds (kube's own Event aggregation counts
    repeats; this keeps a flapping node from posting one each look)."""

    every: float
    last: dict[str, float] = field(default_factory=dict)

    def allow(self, key: str, now: float) -> bool:
        if now - self.last.get(key, -math.inf) < self.every:
            return False
        self.last[key] = now
        return True
