"""What the controller does with one CheckpointConfiguration, decided without I/O.

The objects are ``mtc render``'s (``render_config.parse`` and ``render_manifests.manifests``,
the one rendering path), split in two: the configuration's own (ServiceAccount, ConfigMap,
NetworkPolicy, DaemonSet), which get an ownerReference to it and go with it; and what every
configuration shares (PriorityClass, CSIDriver, cert-manager's Issuers and Certificates),
made when missing and never deleted by one configuration. The Namespace is the
configuration's own, so it exists already and is not touched.

A spec is refused, with nothing applied, when it does not parse (the field is named), when it
changes a field that cannot change in place (``FIXED_FIELDS``), or when its nodes are
another configuration's. Status is computed from the refusal, if any, the DaemonSet's
counts, its pods, and what each node's replicator says of itself (``controller.report``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtc_replicator.controller.report import NodeReport, jobs_status, with_reasons
from mtc_replicator.tools.render_config import API_VERSION, KIND, Manifest, NodeConfig, parse
from mtc_replicator.tools.render_manifests import manifests

FINALIZER = "checkpointing.mtc.dev/node-stack"
"""Held while the node stack exists: the configuration goes once its objects are deleted."""
FIXED_ANNOTATION = "checkpointing.mtc.dev/fixed-fields"
"""On the DaemonSet: the values of ``FIXED_FIELDS`` it was made with (JSON)."""
RELEASE_ANNOTATION = "checkpointing.mtc.dev/release-ram-disk"
"""Set on the node-stack pods before a delete: their plugin frees the RAM disk as it stops
(``csi.release``, which reads it from a downward-API file; a test keeps the two equal)."""
OWNED_KINDS = ("ServiceAccount", "ConfigMap", "NetworkPolicy", "DaemonSet")
SHARED_KINDS = ("PriorityClass", "CSIDriver", "Issuer", "Certificate")
INSTANCE_LABEL = "app.kubernetes.io/instance"

FIXED_FIELDS: dict[str, str] = {
    "spec.runAsUser": "the replicator's store and the step directories on each node's RAM "
    "disk belong to this uid; a replicator of another uid could not move or remove them",
    "spec.runAsGroup": "each node's RAM disk and its checkpoint/ directory (mode 2770) keep "
    "this group; training pods of the new group would be locked out of what is there",
    "spec.tls.perNodeCertificates": "during a rolling switch, replicators with shared and "
    "per-node certificates refuse each other; move in three rollouts (docs/deploy.md, "
    "Per-node certificates) or delete and re-create the configuration",
}
"""Fields that cannot change in place, and why. Changing one is refused with a condition
naming it; everything else (image, RAM disk size, bucket, selectors, tolerations...) rolls."""

# Condition reasons of a refused spec: nothing of that generation was applied.
INVALID = "InvalidSpec"
FIXED = "FieldCannotChange"
CONFLICT = "NodeConflict"
NOT_OWNED = "NotOwned"
APPLY_FAILED = "ApplyFailed"
REFUSALS = frozenset({INVALID, FIXED, CONFLICT, NOT_OWNED, APPLY_FAILED})


@dataclass(frozen=True)
class Refusal:
    """Why a generation of the spec was not applied; ``field`` is a path or a conflict."""

    reason: str
    message: str


@dataclass(frozen=True)
class Desired:
    """The node stack of one configuration: its own objects and the shared ones."""

    config: NodeConfig
    owned: list[Manifest]
    shared: list[Manifest]
    fixed: dict[str, object]


def _scrubbed(cr: Mapping[str, Any]) -> dict[str, Any]:
    """The configuration as ``mtc render`` reads a file: the API's envelope dropped."""
    meta = cr.get("metadata") or {}
    return {
        "apiVersion": cr.get("apiVersion"),
        "kind": cr.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
        "spec": cr.get("spec"),
    }


def owner_reference(cr: Mapping[str, Any]) -> Manifest:
    meta = cr["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def fixed_values(config: NodeConfig) -> dict[str, object]:
    return {
        "spec.runAsUser": config.run_as_user,
        "spec.runAsGroup": config.run_as_group,
        "spec.tls.perNodeCertificates": config.per_node_certificates,
    }


def desired(cr: Mapping[str, Any], controller_namespace: str | None = None) -> Desired:
    """The objects for ``cr``; ``RenderError`` (naming the field) when its spec is invalid.
    ``controller_namespace``: where this controller runs (its NetworkPolicy rule)."""
    config = parse(_scrubbed(cr))
    if controller_namespace:
        config = dataclasses.replace(config, controller_namespace=controller_namespace)
    owner = owner_reference(cr)
    fixed = fixed_values(config)
    owned: list[Manifest] = []
    shared: list[Manifest] = []
    for obj in manifests(config):
        if obj["kind"] == "Namespace":
            continue
        if obj["kind"] in OWNED_KINDS:
            obj["metadata"]["ownerReferences"] = [owner]
            if obj["kind"] == "DaemonSet":
                annotations = obj["metadata"].setdefault("annotations", {})
                annotations[FIXED_ANNOTATION] = json.dumps(fixed, sort_keys=True)
            owned.append(obj)
        else:
            shared.append(obj)
    return Desired(config=config, owned=owned, shared=shared, fixed=fixed)


def changed_fixed(old: Mapping[str, Any] | None, new: Mapping[str, object]) -> Refusal | None:
    """A refusal naming the first fixed field whose value differs from the running stack's
    (``old``: the DaemonSet's ``FIXED_ANNOTATION``, parsed; None where there is none)."""
    if old is None:
        return None
    for name, why in FIXED_FIELDS.items():
        if name in old and old[name] != new[name]:
            return Refusal(
                FIXED,
                f"{name} cannot change in place ({old[name]!r} to {new[name]!r}): {why}; "
                "the node stack keeps running as it was",
            )
    return None


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@dataclass(frozen=True)
class Peer:
    """Another configuration, as far as a conflict goes."""

    namespace: str
    name: str
    created: str
    """Its creationTimestamp (RFC 3339 sorts as text, to the second)."""
    selector: dict[str, str]
    holding: bool = False
    """Whether its node stack exists: it keeps its nodes against one that has none yet."""


def _precedence(p: Peer) -> tuple[bool, str, str, str]:
    # The one whose node stack exists, then the older, then by name: one order for all.
    return (not p.holding, p.created, p.namespace, p.name)


def conflict(
    me: Peer, others: Sequence[Peer], nodes: Sequence[tuple[str, Mapping[str, str]]]
) -> Refusal | None:
    """A refusal when a configuration that comes first (its node stack exists, or it is
    older) selects a node ``me`` selects: a node has one RAM disk and one plugin socket.
    Overlap is certain when a node exists that both select, or when the other's selector is
    part of mine (every node mine selects, it selects too)."""
    for other in sorted(others, key=_precedence):
        if (other.namespace, other.name) == (me.namespace, me.name):
            continue
        if _precedence(other) > _precedence(me):
            continue  # the later one yields
        shared = [n for n, labels in nodes if _selects(me.selector, labels)]
        shared = [n for n in shared if _selects(other.selector, dict(nodes)[n])]
        subset = all(me.selector.get(k) == v for k, v in other.selector.items())
        if shared or subset:
            where = f"nodes {', '.join(sorted(shared)[:5])}" if shared else "every node"
            return Refusal(
                CONFLICT,
                f"spec.nodeSelector {json.dumps(me.selector, sort_keys=True)} selects {where} "
                f"that CheckpointConfiguration {other.namespace}/{other.name} selects "
                f"({json.dumps(other.selector, sort_keys=True)}); a node has one RAM disk: "
                "make the selectors disjoint",
            )
    return None


@dataclass(frozen=True)
class Counts:
    """A DaemonSet's status, as far as the configuration's status goes."""

    desired: int = 0
    ready: int = 0
    updated: int = 0
    available: int = 0
    current: bool = True
    """Whether the DaemonSet controller has seen the DaemonSet's newest generation."""


def counts(ds: Mapping[str, Any] | None) -> Counts:
    if ds is None:
        return Counts()
    st = ds.get("status") or {}
    generation = (ds.get("metadata") or {}).get("generation", 0)
    return Counts(
        desired=int(st.get("desiredNumberScheduled", 0)),
        ready=int(st.get("numberReady", 0)),
        updated=int(st.get("updatedNumberScheduled", 0)),
        available=int(st.get("numberAvailable", 0)),
        current=int(st.get("observedGeneration", 0)) >= int(generation),
    )


Condition = dict[str, Any]


def _cond(kind: str, true: bool, reason: str, message: str) -> Condition:
    return {
        "type": kind,
        "status": "True" if true else "False",
        "reason": reason,
        "message": message,
    }


def conditions(refusal: Refusal | None, n: Counts) -> list[Condition]:
    """Ready, Progressing and Degraded, each with a reason a person can act on."""
    nodes = f"{n.ready} of {n.desired} nodes ready, {n.updated} updated"
    if refusal is not None:
        return [
            _cond("Ready", False, refusal.reason, refusal.message),
            _cond("Progressing", False, refusal.reason, "the spec was refused; " + nodes),
            _cond("Degraded", True, refusal.reason, refusal.message),
        ]
    if not n.current or n.updated < n.desired:
        return [
            _cond("Ready", False, "RollingOut", nodes),
            _cond("Progressing", True, "RollingOut", nodes),
            _cond("Degraded", False, "AsExpected", nodes),
        ]
    if n.desired == 0:
        message = "no node matches spec.nodeSelector (label the node pool)"
        return [
            _cond("Ready", False, "NoMatchingNodes", message),
            _cond("Progressing", False, "RolledOut", message),
            _cond("Degraded", False, "AsExpected", message),
        ]
    if n.ready < n.desired:
        message = f"{n.desired - n.ready} of {n.desired} nodes not ready"
        return [
            _cond("Ready", False, "NodesNotReady", message),
            _cond("Progressing", False, "RolledOut", nodes),
            _cond("Degraded", True, "NodesNotReady", message),
        ]
    return [
        _cond("Ready", True, "AllNodesReady", nodes),
        _cond("Progressing", False, "RolledOut", nodes),
        _cond("Degraded", False, "AsExpected", nodes),
    ]


MAX_NOT_READY = 20
"""Nodes listed in ``status.nodes.notReady``: enough to act on, small enough to read."""


def host_port(ip: str, port: int) -> str:
    """``IP:PORT``, an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def replicator_address(pod: Mapping[str, Any], port_name: str) -> str | None:
    """``IP:PORT`` of a running node-stack pod's replicator port ``port_name`` (``grpc``,
    ``metrics``); None while the pod has no IP or is not running."""
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or status.get("phase") != "Running":
        return None
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") != "replicator":
            continue
        for p in c.get("ports") or []:
            if p.get("name") == port_name and p.get("containerPort"):
                return host_port(str(ip), int(p["containerPort"]))
    return None


def pod_node(pod: Mapping[str, Any]) -> str:
    """The node a node-stack pod runs on, or is made for."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    # Not bound yet: the DaemonSet controller names the node in the pod's affinity.
    terms = (
        ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        )
        or {}
    ).get("nodeSelectorTerms") or []
    for term in terms:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return str((pod.get("metadata") or {}).get("name", "?"))


def _pod_reason(pod: Mapping[str, Any]) -> str:
    """Why a pod is not ready, as kubelet reports it: a container's waiting or terminated
    reason, a failing readiness probe, or why it is not scheduled."""
    st = pod.get("status") or {}
    containers = [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]
    for c in containers:
        if c.get("ready"):
            continue
        state = c.get("state") or {}
        for key in ("waiting", "terminated"):
            if state.get(key):
                detail = state[key].get("message") or ""
                reason = state[key].get("reason") or key
                return f"{c.get('name')}: {reason}" + (f": {detail[:200]}" if detail else "")
        if "running" in state:
            return f"{c.get('name')}: running, readiness probe not passing"
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return f"not scheduled: {cond.get('message') or cond.get('reason', '')}"[:250]
    return f"pod {st.get('phase', 'Pending')}"


def not_ready(
    pods: Sequence[Mapping[str, Any]], before: Sequence[Mapping[str, Any]] = (), now: str = ""
) -> list[dict[str, Any]]:
    """The nodes whose node-stack pod is not ready, and why (at most ``MAX_NOT_READY``);
    ``since`` (and ``reported``) carried over from ``before`` while a node stays on the list."""
    earlier = {e.get("node"): e for e in before}
    out = []
    for pod in pods:
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            continue
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        node = pod_node(pod)
        old = earlier.get(node) or {}
        entry: dict[str, Any] = {
            "node": node,
            "reason": _pod_reason(pod),
            "since": old.get("since") or now,
        }
        if old.get("reported"):
            entry["reported"] = True
        out.append(entry)
    return sorted(out, key=lambda e: str(e["node"]))[:MAX_NOT_READY]


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def overdue(entries: Sequence[dict[str, Any]], now: str, seconds: float) -> list[dict[str, Any]]:
    """The entries not ready for ``seconds`` and not reported yet, now marked reported: one
    Event per node per spell of not being ready, however long it lasts."""
    due = []
    for e in entries:
        if e.get("reported") or not e.get("since"):
            continue
        if (_time(now) - _time(e["since"])).total_seconds() >= seconds:
            e["reported"] = True
            due.append(e)
    return due


def status(
    generation: int,
    refusal: Refusal | None,
    n: Counts,
    previous: Sequence[Condition],
    now: str,
    *,
    pods: Sequence[Mapping[str, Any]] = (),
    not_ready_before: Sequence[Mapping[str, Any]] = (),
    reports: Mapping[str, NodeReport] | None = None,
    jobs_before: Sequence[Mapping[str, Any]] = (),
) -> Manifest:
    """The status subresource: a condition keeps its lastTransitionTime while its status
    does not change. ``reports``: each node's replicator as it last answered, by node
    (None: not asked yet since this controller started, so what ``not_ready_before`` and
    ``jobs_before`` say of them stays)."""
    before = {c.get("type"): c for c in previous}
    out = []
    for c in conditions(refusal, n):
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"]
        c["lastTransitionTime"] = old.get("lastTransitionTime", now) if same and old else now
        c["observedGeneration"] = generation
        out.append(c)
    entries = not_ready(pods, not_ready_before, now)
    if reports is None:
        said = {e.get("node"): e.get("replicator") for e in not_ready_before}
        for e in entries:
            if said.get(e["node"]):
                e["replicator"] = said[e["node"]]
        jobs = [dict(j) for j in jobs_before]
    else:
        entries = with_reasons(entries, reports)
        jobs = jobs_status(reports.values())
    nodes: dict[str, Any] = {
        "desired": n.desired,
        "ready": n.ready,
        "updated": n.updated,
        "available": n.available,
        "notReady": entries,
    }
    if reports is not None:
        nodes["reporting"] = sum(1 for r in reports.values() if r.answered)
    return {"observedGeneration": generation, "conditions": out, "nodes": nodes, "jobs": jobs}


def refusal_in(st: Mapping[str, Any] | None, generation: int) -> Refusal | None:
    """The refusal a status records for ``generation``, so a DaemonSet's change does not
    paper over it."""
    if not st or st.get("observedGeneration") != generation:
        return None
    for c in st.get("conditions") or ():
        if (
            c.get("type") == "Degraded"
            and c.get("reason") in REFUSALS
            and c.get("status") == "True"
        ):
            return Refusal(str(c["reason"]), str(c.get("message", "")))
    return None
