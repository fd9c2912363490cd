"""kopf's handlers for CheckpointConfiguration, and the DaemonSet watch that feeds its status.

create, resume (at the controller's start) and update all reconcile: the same function
renders the spec, refuses it (a condition and an Event naming the field or the conflict,
nothing applied) or applies it. delete removes the owned objects, then kopf releases the
finalizer. A change of an owned DaemonSet's status updates its configuration's status. Every
``MTC_CONTROLLER_SCRAPE_SECONDS`` each configuration's replicators are asked how they are
(``controller.scrape``): their own readiness reasons and their jobs' newest steps go into
its status, and what an operator must act on into Events (``controller.report``).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import kopf
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from mtc_replicator.controller import plan, report, scrape
from mtc_replicator.controller.kube import Kube, MissingKind, fixed_of, owned_by
from mtc_replicator.tools.render_config import GROUP, RenderError

log = logging.getLogger(__name__)
REGISTRY = kopf.OperatorRegistry()
RESOURCE = (GROUP, "v1", "checkpointconfigurations")
CONFLICT_RETRY_SECONDS = float(os.environ.get("MTC_CONTROLLER_RETRY_SECONDS", "15"))
"""A configuration refused for a conflict, or whose apply failed, is tried again this often
(the other configuration may go, the API may answer again)."""

RESYNC_SECONDS = float(os.environ.get("MTC_CONTROLLER_RESYNC_SECONDS", "120"))
"""How often each configuration is applied again, whatever happened (drift), and its
status written (a node not ready long enough gets its Event then)."""
RELEASE_WAIT_SECONDS = float(os.environ.get("MTC_CONTROLLER_RELEASE_SECONDS", "5"))
"""On a delete, how long kubelets get to write the release annotation into the plugins'
files before the DaemonSet goes."""
NOT_READY_SECONDS = float(os.environ.get("MTC_CONTROLLER_NOT_READY_SECONDS", "300"))
"""A node whose pod stays not ready this long gets one Warning Event (NodeNotReady)."""

SCRAPE_SECONDS = float(os.environ.get("MTC_CONTROLLER_SCRAPE_SECONDS", "30"))
"""How often each configuration's replicators are asked how they are."""
EVENT_SECONDS = float(os.environ.get("MTC_CONTROLLER_EVENT_SECONDS", "600"))
"""At most one BackupFailing or RestoreBlocked Event per node (and job) this often."""

RECONCILES = Counter(
    "mtc_controller_reconciles_total",
    "Configurations reconciled, by outcome: Applied, or the refusal's reason",
    ["outcome"],
)

LOOKS = Counter(
    "mtc_controller_replicator_looks_total",
    "Answers read from the node stacks' replicators (/readyz and /metrics), by outcome",
    ["outcome"],
)

_kube: Kube | None = None
_reports: dict[tuple[str, str], dict[str, report.NodeReport]] = {}
"""Each configuration's replicators as they last answered, by node: the status written
between two looks (a DaemonSet's event) keeps what they said."""
_baselines: dict[tuple[str, str], dict[str, report.NodeReport]] = {}
"""Each node's last answer, which the next one is compared with for Events."""
_limiter = report.Limiter(EVENT_SECONDS)


def kube() -> Kube:
    global _kube  # noqa: PLW0603 (one API client per process, made after login)
    if _kube is None:
        _kube = Kube()
    return _kube


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_status_locks: dict[tuple[str, str], threading.Lock] = {}
_status_locks_guard = threading.Lock()


def _status_lock(namespace: str, name: str) -> threading.Lock:
    with _status_locks_guard:
        return _status_locks.setdefault((namespace, name), threading.Lock())


def _write_status(
    cr: Mapping[str, Any],
    refusal: plan.Refusal | None,
    ds: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Status from the refusal, the DaemonSet, its pods and the replicators' last answers.
    One writer per configuration at a time (the DaemonSet's events, the looks and the
    resync run in different threads), each starting from the status as it is now, so a
    NodeNotReady Event is posted once."""
    meta = cr["metadata"]
    key = (meta["namespace"], meta["name"])
    with _status_lock(*key):
        fresh = kube().configuration(*key) or cr
        old = fresh.get("status") or {}
        if pods is None:
            pods = kube().pods(*key) if ds is not None else ()
        now = _now()
        st = plan.status(
            int(meta.get("generation", 1)),
            refusal,
            plan.counts(ds),
            old.get("conditions") or [],
            now,
            pods=pods,
            not_ready_before=(old.get("nodes") or {}).get("notReady") or [],
            reports=_reports.get(key),
            jobs_before=old.get("jobs") or [],
        )
        for entry in plan.overdue(st["nodes"]["notReady"], now, NOT_READY_SECONDS):
            said = entry.get("replicator")
            why = entry["reason"] + (f" (the replicator: {said})" if said else "")
            kopf.warn(
                _body(cr),
                reason="NodeNotReady",
                message=f"node {entry['node']} not ready since {entry['since']}: {why}",
            )
        if all(old.get(k) == v for k, v in st.items()) and _same_conditions(old, st):
            return
        kube().patch_status(meta["namespace"], meta["name"], st)


def _same_conditions(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    return bool(old.get("conditions") == new.get("conditions"))


def _refuse(body: Mapping[str, Any], refusal: plan.Refusal, ds: Mapping[str, Any] | None) -> None:
    meta = body["metadata"]
    RECONCILES.labels(refusal.reason).inc()
    already = plan.refusal_in(body.get("status"), int(meta.get("generation", 1)))
    if already != refusal:  # one Event per refused generation, not one per retry
        kopf.warn(_body(body), reason=refusal.reason, message=refusal.message)
    log.warning(
        "%s/%s refused: %s: %s", meta["namespace"], meta["name"], refusal.reason, refusal.message
    )
    _write_status(body, refusal, ds)


def reconcile(body: Mapping[str, Any]) -> None:
    """Render, check and apply one configuration; its status says what came of it."""
    k = kube()
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    try:
        want = plan.desired(body, os.environ.get("POD_NAMESPACE"))
    except RenderError as exc:
        ds = k.daemonset(ns, f"mtc-node-{name}")
        _refuse(body, plan.Refusal(plan.INVALID, str(exc)), ds if owned_by(ds, uid) else None)
        raise kopf.PermanentError(str(exc)) from None
    ds_name = f"mtc-node-{name}"
    ds = k.daemonset(ns, ds_name)
    if ds is not None and not owned_by(ds, uid):
        refusal = plan.Refusal(
            plan.NOT_OWNED,
            f"DaemonSet {ns}/{ds_name} exists and is not this configuration's (a Helm or "
            "kustomize install?): remove it, or name the configuration otherwise",
        )
        _refuse(body, refusal, None)
        raise kopf.TemporaryError(refusal.message, delay=CONFLICT_RETRY_SECONDS)
    me = plan.Peer(
        ns, name, meta.get("creationTimestamp", ""), want.config.pod_node_selector, ds is not None
    )
    found = plan.conflict(me, k.peers(), k.nodes()) or plan.changed_fixed(fixed_of(ds), want.fixed)
    if found is not None:
        _refuse(body, found, ds)
        if found.reason == plan.CONFLICT:
            raise kopf.TemporaryError(found.message, delay=CONFLICT_RETRY_SECONDS)
        raise kopf.PermanentError(found.message)
    try:
        for obj in want.shared:
            k.ensure(obj)
        applied = [k.apply(obj) for obj in want.owned]
    except (MissingKind, ApiException) as exc:
        message = f"applying the node stack failed: {_short(exc)}"
        _refuse(body, plan.Refusal(plan.APPLY_FAILED, message), ds)
        raise kopf.TemporaryError(message, delay=CONFLICT_RETRY_SECONDS) from None
    # ConfigMaps of earlier specs (their name carries a hash of their data).
    current = [o["metadata"]["name"] for o in want.owned]
    k.delete_owned(ns, name, uid, keep=current)
    new_ds = next((o for o in applied if o.get("kind") == "DaemonSet"), None)
    rolled = ds is not None and new_ds is not None and _generation(new_ds) != _generation(ds)
    if ds is None:
        kopf.event(
            _body(body),
            type="Normal",
            reason="Created",
            message=f"node stack DaemonSet {ns}/{ds_name}",
        )
    elif rolled:
        kopf.event(
            _body(body),
            type="Normal",
            reason="RollingOut",
            message=f"DaemonSet {ns}/{ds_name} updated",
        )
    RECONCILES.labels("Applied").inc()
    _write_status(body, None, new_ds)


def _body(body: Mapping[str, Any]) -> kopf.Body:
    # kopf's Events need only the object's reference (kind, name, namespace, uid).
    return cast(kopf.Body, body)


def _generation(obj: Mapping[str, Any]) -> int:
    return int((obj.get("metadata") or {}).get("generation", 0))


def _short(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}: {(exc.body or '')[:300]}"
    return str(exc)


@kopf.on.resume(*RESOURCE, registry=REGISTRY)
@kopf.on.create(*RESOURCE, registry=REGISTRY)
@kopf.on.update(*RESOURCE, registry=REGISTRY)
def on_change(body: kopf.Body, **_: Any) -> None:
    reconcile(body)


@kopf.on.delete(*RESOURCE, registry=REGISTRY)
def on_delete(body: kopf.Body, **_: Any) -> None:
    """The pods are told to free their RAM disks, then the owned objects go (not through the
    garbage collector, so the finalizer is released only once they are gone); shared objects,
    Secrets and the bucket stay."""
    meta = body["metadata"]
    marked = kube().mark_release(meta["namespace"], meta["name"])
    if marked:
        # kubelet writes the annotation into each plugin's downward-API file; a node that
        # has not by the time its pod stops keeps its RAM disk (freed by hand).
        log.info(
            "%s/%s: %d pods asked to free their RAM disk", meta["namespace"], meta["name"], marked
        )
        time.sleep(RELEASE_WAIT_SECONDS)
    deleted = kube().delete_owned(meta["namespace"], meta["name"], meta["uid"])
    for memory in (_reports, _baselines):
        memory.pop((meta["namespace"], meta["name"]), None)
    log.info("%s/%s deleted: %d objects removed", meta["namespace"], meta["name"], deleted)


@kopf.on.event(
    "apps", "v1", "daemonsets", registry=REGISTRY, labels={"app.kubernetes.io/part-of": "mtc"}
)
def on_daemonset(body: kopf.Body, type: str | None, **_: Any) -> None:
    """A DaemonSet's counts changed: its configuration's status follows. Deleted while its
    configuration stays (by hand, by mistake): it is made again."""
    owner = next(
        (
            o
            for o in body.get("metadata", {}).get("ownerReferences") or []
            if o.get("kind") == "CheckpointConfiguration" and o.get("controller")
        ),
        None,
    )
    if owner is None:
        return
    cr = kube().configuration(body["metadata"]["namespace"], owner["name"])
    if cr is None or cr["metadata"].get("uid") != owner.get("uid"):
        return
    if cr["metadata"].get("deletionTimestamp"):
        return
    if type == "DELETED":
        _reconcile_quietly(cr)
        return
    generation = int(cr["metadata"].get("generation", 1))
    _write_status(cr, plan.refusal_in(cr.get("status"), generation), dict(body))


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, registry=REGISTRY)
def resync(body: kopf.Body, **_: Any) -> None:
    """Every few minutes, the spec applied again: a hand edit of an owned object is undone
    (server-side apply restores our fields), and nothing changes when nothing drifted."""
    _reconcile_quietly(body)


@kopf.timer(*RESOURCE, interval=SCRAPE_SECONDS, initial_delay=1.0, registry=REGISTRY)
def look(body: kopf.Body, **_: Any) -> None:
    """Ask every node's replicator how it is; its status and Events follow."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return
    key = (meta["namespace"], meta["name"])
    ds = kube().daemonset(key[0], f"mtc-node-{key[1]}")
    if not owned_by(ds, meta["uid"]):
        return  # refused, or not made yet: nothing of ours to ask
    pods = kube().pods(*key)
    answers = scrape.look_all(pods)
    baseline = _baselines.setdefault(key, {})
    clock = time.monotonic()
    for node, r in sorted(answers.items()):
        LOOKS.labels("answered" if r.answered and r.error is None else "failed").inc()
        for alert in report.alerts(baseline.get(node), r):
            if _limiter.allow(f"{key[0]}/{key[1]}/{alert.key}", clock):
                kopf.warn(_body(body), reason=alert.reason, message=alert.message)
        if r.answered:
            baseline[node] = r
    for gone in set(baseline) - {plan.pod_node(p) for p in pods}:
        del baseline[gone]
    _reports[key] = answers
    generation = int(meta.get("generation", 1))
    _write_status(body, plan.refusal_in(body.get("status"), generation), ds, pods)


def _reconcile_quietly(cr: Mapping[str, Any]) -> None:
    # Outside the configuration's own handlers, a refusal is already in its status: log it.
    try:
        reconcile(cr)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        meta = cr["metadata"]
        log.info("%s/%s not reconciled: %s", meta["namespace"], meta["name"], exc)


def configure(settings: kopf.OperatorSettings) -> None:
    """Our own finalizer and annotations (not kopf's defaults), and no status.kopf (the
    status schema is ours)."""
    settings.persistence.finalizer = plan.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "mtc-controller"  # kubectl describe's "From"
    settings.posting.reporting_instance = os.environ.get("POD_NAME", "mtc-controller")
    settings.peering.standalone = True
    settings.watching.server_timeout = 300
    # A delete waits for the object's timers (``look``, ``resync``) to end; one in flight
    # is checked again after this many seconds (kopf's 60 held a finalizer for a minute).
    settings.background.cancellation_polling = 1.0


@kopf.on.startup(registry=REGISTRY)
def on_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    configure(settings)
