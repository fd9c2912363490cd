"""Who owns the node's CHECKPOINT_DIR: one Kubernetes namespace at a time. Pure, no I/O.

kubelet names the pod behind every NodePublishVolume (``podInfoOnMount: true``), so the
namespace comes from the node, never from a pod. The owner is the namespace of the last
publish; it is recorded in ``owner.json`` beside CHECKPOINT_DIR, for a restarted plugin
and for the daemon, which takes it as the owner of the job it runs.

A pod of the owner's namespace always gets the directory as it is: a restarted job finds
its checkpoints. Another namespace waits while any target is published (pods of two
tenants never share the directory), and once none is, the directory is emptied before the
new owner's pod sees it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

OWNER_KEYS = ("namespace", "pod", "pod_uid", "service_account", "published_at")
"""The keys of ``owner.json``, exactly; the daemon reads them (``--owner-file``)."""


@dataclass(frozen=True)
class PodInfo:
    """The pod kubelet publishes the volume for, from the request's volume_context."""

    namespace: str
    pod: str
    pod_uid: str
    service_account: str


class OwnerDecision(enum.Enum):
    KEEP = "keep"
    """The owner's namespace again: its files stay."""
    TAKE_OVER = "take over"
    """Another namespace, and no target is published: empty the directory, then publish."""
    WAIT = "wait"
    """Another namespace's pod still has the directory: refuse, kubelet retries."""


def decide_owner(recorded: str | None, requested: str, published_targets: int) -> OwnerDecision:
    """What a publish for ``requested`` does, given the recorded owner (None: unknown, so
    the directory may hold anyone's files) and how many targets are published now."""
    if recorded is not None and recorded == requested:
        return OwnerDecision.KEEP
    if published_targets > 0:
        return OwnerDecision.WAIT
    return OwnerDecision.TAKE_OVER


def owner_record(pod: PodInfo, published_at: float) -> bytes:
    """The bytes of ``owner.json`` for a publish by ``pod`` at ``published_at`` (Unix seconds)."""
    record = {
        "namespace": pod.namespace,
        "pod": pod.pod,
        "pod_uid": pod.pod_uid,
        "service_account": pod.service_account,
        "published_at": published_at,
    }
    return (json.dumps(record, indent=2) + "\n").encode()


def recorded_namespace(data: bytes) -> str | None:
    """The namespace an ``owner.json`` names; None when it is not one we wrote."""
    return _recorded(data, "namespace")


def recorded_pod_uid(data: bytes) -> str | None:
    """The pod uid an ``owner.json`` names; None when it is not one we wrote."""
    return _recorded(data, "pod_uid")


def _recorded(data: bytes, key: str) -> str | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    if not isinstance(record, dict) or set(record) != set(OWNER_KEYS):
        return None
    value = record[key]
    return value if isinstance(value, str) and value else None


RANK_FILE = "mtc-rank.json"
"""``core.rank_file.RANK_FILE`` (the plugin imports nothing of the replicator's)."""
RANK_FILES = ("jax-init-info.txt", RANK_FILE)
"""A pod's assigned rank, written by its node's replicator (``Node/AssignRank``)."""


def rank_file_pod(data: bytes) -> str | None:
    """The pod uid an ``mtc-rank.json`` names; None when it names none."""
    try:
        record = json.loads(data)
    except ValueError:
        return None
    uid = record.get("pod_uid") if isinstance(record, dict) else None
    return uid if isinstance(uid, str) and uid else None


def rank_files_stale(rank_file_uid: str | None, owner_uid: str | None, publishing: str) -> bool:
    """Whether a publish for pod ``publishing`` removes ``jax-init-info.txt`` and
    ``mtc-rank.json`` before the pod starts: unless they were written for it. Who they were
    written for is the pod ``mtc-rank.json`` names, or, without a readable one (a
    ``jax-init-info.txt`` a pod wrote itself), the pod ``owner.json`` recorded last."""
    return (rank_file_uid or owner_uid) != publishing
