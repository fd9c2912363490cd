"""A training job's pods, as the controller sees them for sticky ranks. Pure.

A pod takes part when it carries the label ``checkpointing.mtc.dev/nodes`` (the job's pod
count, one pod per node), which its job's template sets once: the label lets the controller
watch only these pods (a server-side selector). Its job and its index, the rank it would
take on its own, come from the labels and annotations each workload kind already sets:

- JobSet: ``jobset.sigs.k8s.io/jobset-name``; index ``job-index * (nodes / replicas) +
  job-completion-index`` (one replicated job of ``replicas`` Indexed Jobs);
- Indexed Job: ``batch.kubernetes.io/job-name``; index ``job-completion-index``;
- PyTorchJob (Kubeflow): ``training.kubeflow.org/job-name``; the master is index 0 and worker
  ``i`` is ``i + 1`` when the job has a master (``replica-type``, ``replica-index``);
- StatefulSet: its owner's name; index ``apps.kubernetes.io/pod-index`` (or the name's
  ordinal).

``group`` decides, for one job's live pods, whether they are ready for an assignment (one
pod per index, each on a node with an IP), already assigned (every pod annotated with the
same assignment), or still waiting, and why.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NODES_LABEL = "checkpointing.mtc.dev/nodes"
PORT_ANNOTATION = "checkpointing.mtc.dev/coordinator-port"
RANK_ANNOTATION = "checkpointing.mtc.dev/rank"
ASSIGNMENT_ANNOTATION = "checkpointing.mtc.dev/assignment"
SOURCE_ANNOTATION = "checkpointing.mtc.dev/rank-source"
DELIVERED_ANNOTATION = "checkpointing.mtc.dev/rank-delivered"
HOLDER_ANNOTATION = "checkpointing.mtc.dev/rank-holder"
"""The node (as its certificate names it) the pod's rank is granted to (``core.grant``)."""
JOB_ANNOTATION = "checkpointing.mtc.dev/job"
"""The job's name in its ``replicator.yaml`` when it is not the workload's own name."""
DEFAULT_COORDINATOR_PORT = 8476
"""JAX's coordinator port in GKE's jax-init-info.txt; torchrun's MASTER_PORT if the job
sets none (``checkpointing.mtc.dev/coordinator-port`` on the pod overrides it)."""
MAX_NODES = 65536

_JOBSET = "jobset.sigs.k8s.io/"
_BATCH = "batch.kubernetes.io/"
_KUBEFLOW = "training.kubeflow.org/"


class BadPod(ValueError):
    """A pod that opts in but whose job or index cannot be read: the message says which."""


@dataclass(frozen=True)
class JobPod:
    namespace: str
    job: str
    """``<kind>/<name>``: the workload the pod belongs to."""
    name: str
    uid: str
    index: int
    nodes: int
    node: str
    """The node it is bound to; empty until scheduled."""
    ip: str
    """Its IP; empty until its sandbox runs."""
    port: int
    assignment: str
    """The assignment it carries (``ASSIGNMENT_ANNOTATION``); empty: none yet."""
    rank: int | None
    source: str
    holder: str
    """``HOLDER_ANNOTATION``: "" when the assignment has no grant."""
    delivered: bool
    mtc_job: str
    """The job's name as its ``replicator.yaml`` says it (``JOB_ANNOTATION``, else the
    workload's name)."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.job)


def _int(value: Any, what: str, pod: str, low: int = 0, high: int = MAX_NODES) -> int:
    try:
        n = int(str(value))
    except ValueError:
        raise BadPod(f"pod {pod}: {what} {value!r} is not a number") from None
    if not low <= n <= high:
        raise BadPod(f"pod {pod}: {what} {n} is outside {low}..{high}")
    return n


def _ordinal(name: str) -> str:
    m = re.search(r"-(\d+)$", name)
    return m.group(1) if m else ""


def job_pod(pod: Mapping[str, Any]) -> JobPod | None:
    """The pod as a member of its job; None when it does not opt in or is going away
    (terminating, or ended); ``BadPod`` when it opts in and its job or index is unreadable."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if NODES_LABEL not in labels:
        return None
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    ann = meta.get("annotations") or {}
    name = str(meta.get("name", "?"))
    nodes = _int(labels[NODES_LABEL], NODES_LABEL, name, 1)
    both = {**labels, **ann}
    if _JOBSET + "jobset-name" in both:
        job = "jobset/" + both[_JOBSET + "jobset-name"]
        replicas = _int(both.get(_JOBSET + "replicatedjob-replicas", 1), "replicas", name, 1)
        if nodes % replicas:
            raise BadPod(f"pod {name}: {nodes} nodes do not split into {replicas} jobs")
        per_job = nodes // replicas
        index = _int(both.get(_JOBSET + "job-index", 0), "job-index", name) * per_job + _int(
            both.get(_BATCH + "job-completion-index", ""), "job-completion-index", name
        )
    elif _KUBEFLOW + "job-name" in both:
        job = "pytorchjob/" + both[_KUBEFLOW + "job-name"]
        kind = str(both.get(_KUBEFLOW + "replica-type", "")).lower()
        index = _int(both.get(_KUBEFLOW + "replica-index", ""), "replica-index", name)
        index = -1 if kind == "master" else index  # resolved by ``group``: 0, workers + 1
    elif _BATCH + "job-name" in both or "job-name" in both:
        job = "job/" + str(both.get(_BATCH + "job-name") or both["job-name"])
        index = _int(both.get(_BATCH + "job-completion-index", ""), "completion index", name)
    else:
        owner = next(
            (o for o in meta.get("ownerReferences") or [] if o.get("kind") == "StatefulSet"),
            None,
        )
        if owner is None:
            raise BadPod(
                f"pod {name}: {NODES_LABEL} is set but it belongs to no JobSet, Indexed Job, "
                "PyTorchJob or StatefulSet, so its index is unknown"
            )
        job = "statefulset/" + str(owner.get("name"))
        raw = labels.get("apps.kubernetes.io/pod-index") or _ordinal(name)
        index = _int(raw, "pod index", name)
    if index >= nodes:
        raise BadPod(f"pod {name}: index {index} but the job has {nodes} nodes")
    ip = str(status.get("podIP") or "")
    if ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise BadPod(f"pod {name}: podIP {ip!r} is not an IP address") from None
    rank = ann.get(RANK_ANNOTATION)
    return JobPod(
        namespace=str(meta.get("namespace", "")),
        job=job,
        name=name,
        uid=str(meta.get("uid", "")),
        index=index,
        nodes=nodes,
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        ip=ip,
        port=_int(ann.get(PORT_ANNOTATION, DEFAULT_COORDINATOR_PORT), "port", name, 1, 65535),
        assignment=str(ann.get(ASSIGNMENT_ANNOTATION, "")),
        rank=_int(rank, RANK_ANNOTATION, name) if rank is not None else None,
        source=str(ann.get(SOURCE_ANNOTATION, "")),
        holder=str(ann.get(HOLDER_ANNOTATION, "")),
        mtc_job=str(ann.get(JOB_ANNOTATION) or job.split("/", 1)[1]),
        delivered=bool(ann.get(DELIVERED_ANNOTATION))
        and ann.get(DELIVERED_ANNOTATION) == ann.get(ASSIGNMENT_ANNOTATION),
    )


def resolve_masters(pods: Sequence[JobPod]) -> list[JobPod]:
    """PyTorchJob: the master is index 0 and each worker's index moves up by one."""
    if not any(p.index == -1 for p in pods):
        return list(pods)
    return [JobPod(**{**p.__dict__, "index": 0 if p.index == -1 else p.index + 1}) for p in pods]


@dataclass(frozen=True)
class Group:
    """One job's live pods and what to do with them."""

    pods: tuple[JobPod, ...]
    ready: bool
    """Every index has its pod, each on a node with an IP: an assignment can be made."""
    assigned: bool
    """Every pod already carries the same assignment (made by this or an earlier leader)."""
    why: str
    """Why not ready, or what was found."""

    @property
    def assignment_id(self) -> str:
        """The same for the same pods: a leader that restarts mid-way makes the same id."""
        digest = hashlib.sha256(",".join(sorted(p.uid for p in self.pods)).encode())
        return digest.hexdigest()[:16]


def group(members: Sequence[JobPod]) -> Group:
    """Whether ``members`` (one job's live pods) are ready, assigned, or waiting, and why."""
    pods = tuple(sorted(resolve_masters(members), key=lambda p: (p.index, p.name)))
    if not pods:
        return Group((), False, False, "no pods")
    nodes = {p.nodes for p in pods}
    if len(nodes) > 1:
        return Group(pods, False, False, f"its pods disagree on {NODES_LABEL}: {sorted(nodes)}")
    (n,) = nodes
    ids = {p.assignment for p in pods}
    if len(pods) == n and len(ids) == 1 and "" not in ids:
        return Group(pods, True, True, f"assigned ({ids.pop()})")
    indexes = [p.index for p in pods]
    if sorted(indexes) != list(range(n)):
        dup = sorted({i for i in indexes if indexes.count(i) > 1})
        missing = sorted(set(range(n)) - set(indexes))
        return Group(pods, False, False, f"waiting for indexes {missing}, duplicates {dup}")
    unplaced = [p.name for p in pods if not p.node or not p.ip]
    if unplaced:
        return Group(pods, False, False, f"waiting for {len(unplaced)} pods to get a node and IP")
    return Group(pods, True, False, "ready")
