"""Check NodePublishVolume / NodeUnpublishVolume requests in the spec's order. Pure.

Each check raises ``InvalidRequest`` naming the first thing wrong, in the order the CSI spec
and csi-sanity expect: volume_id, target_path, volume_capability, then what we support
(mount access, inline ephemeral volumes). The result is a plain value the node logic uses.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.errors import InvalidRequest
from mtc_replicator.csi.owner import PodInfo

EPHEMERAL_KEY = "csi.storage.k8s.io/ephemeral"
"""Set to "true" by kubelet for a CSI inline ephemeral volume (with podInfoOnMount)."""
NAMESPACE_KEY = "csi.storage.k8s.io/pod.namespace"
POD_NAME_KEY = "csi.storage.k8s.io/pod.name"
POD_UID_KEY = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT_KEY = "csi.storage.k8s.io/serviceAccount.name"

# Kubernetes' own rules: a namespace is a DNS-1123 label; pod and service account names are
# DNS-1123 subdomains; a UID is a UUID, accepted here as any short run of its characters.
LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_UID = re.compile(r"[A-Za-z0-9-]{1,128}")

_READ_ONLY_MODES = frozenset(
    {
        pb.VolumeCapability.AccessMode.SINGLE_NODE_READER_ONLY,
        pb.VolumeCapability.AccessMode.MULTI_NODE_READER_ONLY,
    }
)


@dataclass(frozen=True)
class Publish:
    volume_id: str
    target: Path
    readonly: bool
    pod: PodInfo


@dataclass(frozen=True)
class Unpublish:
    volume_id: str
    target: Path


def validate_publish(request: pb.NodePublishVolumeRequest) -> Publish:
    volume_id = _volume_id(request.volume_id)
    target = _target(request.target_path)
    # An unset sub-message still reads as a default instance: only HasField tells.
    if not request.HasField("volume_capability"):
        raise InvalidRequest("volume_capability is required")
    capability = request.volume_capability
    access = capability.WhichOneof("access_type")
    if access == "block":
        raise InvalidRequest("block access is not supported: the RAM disk is a filesystem")
    if access != "mount":
        raise InvalidRequest("volume_capability must ask for mount access")
    if request.volume_context.get(EPHEMERAL_KEY) != "true":
        raise InvalidRequest(
            "only CSI inline ephemeral volumes are supported (volume_context "
            f"{EPHEMERAL_KEY}=true); declare the volume inline in the pod spec, and give the "
            "CSIDriver volumeLifecycleModes [Ephemeral] and podInfoOnMount: true"
        )
    readonly = request.readonly or capability.access_mode.mode in _READ_ONLY_MODES
    return Publish(volume_id, target, readonly, pod_info(request.volume_context))


def pod_info(context: Mapping[str, str]) -> PodInfo:
    """The pod kubelet names in volume_context; the namespace decides who owns the volume."""
    fields = (
        (NAMESPACE_KEY, LABEL_RE),
        (POD_NAME_KEY, SUBDOMAIN_RE),
        (POD_UID_KEY, _UID),
        (SERVICE_ACCOUNT_KEY, SUBDOMAIN_RE),
    )
    values: list[str] = []
    for key, pattern in fields:
        value = context.get(key)
        if value is None:
            raise InvalidRequest(
                f"volume_context has no {key}: give the CSIDriver podInfoOnMount: true"
            )
        if not pattern.fullmatch(value):
            raise InvalidRequest(f"volume_context {key}={value!r} is not a valid name")
        values.append(value)
    return PodInfo(*values)


def validate_unpublish(request: pb.NodeUnpublishVolumeRequest) -> Unpublish:
    return Unpublish(_volume_id(request.volume_id), _target(request.target_path))


def _volume_id(value: str) -> str:
    if not value:
        raise InvalidRequest("volume_id is required")
    return value


def _target(value: str) -> Path:
    if not value:
        raise InvalidRequest("target_path is required")
    if "\0" in value or not os.path.isabs(value):
        raise InvalidRequest(f"target_path must be an absolute path, got {value!r}")
    # Normalised so "/a/b/" and "/a//b" name the one mount point mountinfo shows as "/a/b".
    return Path(os.path.normpath(value))
