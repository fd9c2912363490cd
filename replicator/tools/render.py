"""``mtc render``: a ``CheckpointConfiguration`` turned into the node stack's manifests.

``parse`` and ``manifests`` are pure (a dict in, dicts out) so every field mapping is
unit-tested without a cluster; ``run`` is the thin I/O wrapper behind ``mtc render``. The
objects are the ones ``deploy/base`` holds (a test keeps the two equal): the CSI plugin
(privileged, it mounts) and the replicator (unprivileged) in one DaemonSet per
configuration, sharing the node's RAM disk, and the NetworkPolicy in front of them. TLS is
on unless ``spec.tls.enabled`` is false: the replicator alone mounts the TLS Secret, and
with ``spec.tls.certManager`` the cert-manager objects that make it are rendered too
(``deploy/overlays/cert-manager``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from replicator import __version__
from replicator.core.drain import DEFAULT_DRAIN_SECONDS
from replicator.core.pacing import MAX_YIELD_TO_SAVES, parse_rate
from replicator.transport.server import READINESS_SERVICE

Manifest = dict[str, Any]

GROUP = "checkpointing.mtc.dev"
API_VERSION = f"{GROUP}/v1"
GKE_API_VERSION = "checkpointing.gke.io/v1"
"""GKE's configurations render unchanged: a drop-in needs no rewrite of what users have."""
KIND = "CheckpointConfiguration"
DRIVER_NAME = "multitier-checkpoint.mtc.dev"
DEFAULT_NAMESPACE = "mtc-system"
DEFAULT_IMAGE = f"mtc-replicator:{__version__}"
DEFAULT_CREDENTIALS_SECRET = "mtc-backup-credentials"  # noqa: S105 (a Secret's name)
MAX_DRAIN_SECONDS = 600
"""``spec.drainSeconds`` at most: a node drain waits this long plus ``STOP_MARGIN`` per pod."""
STOP_MARGIN = 10
"""Seconds of the pod's grace period after the drain: the replicator's gRPC server lets
transfers in flight end (5 s), then it exits and its sidecars stop."""
PRIORITY_CLASS = "mtc-node-critical"
REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0"
LIVENESS_PROBE_IMAGE = "registry.k8s.io/sig-storage/livenessprobe:v2.19.0"
WORKLOAD_UID = 65532
"""The image's non-root user; training containers must run as the replicator's uid."""

KUBELET_DIR = "/var/lib/kubelet"
HOST_DIR = "/var/lib/mtc"
RAM_DIR = f"{HOST_DIR}/ramdisk"
CHECKPOINT_SUBDIR = "checkpoint"
"""What pods get of the RAM disk (the daemon's CHECKPOINT_DIR); the store and the owner file
are its siblings, out of their reach."""
CHECKPOINT_DIR = f"{RAM_DIR}/{CHECKPOINT_SUBDIR}"
STORE_DIR = f"{RAM_DIR}/store"
OWNER_FILE = f"{RAM_DIR}/owner.json"
GRPC_PORT = 7070
DATA_PORT = 7071
HEALTH_PORT = 7072
"""The gRPC health service alone, in plaintext: kubelet's probes carry no client certificate."""
METRICS_PORT = 9464
PLUGIN_HEALTH_PORT = 9808
REGISTRAR_HEALTH_PORT = 9809
PROBE_PORTS = (HEALTH_PORT, PLUGIN_HEALTH_PORT, REGISTRAR_HEALTH_PORT)
"""kubelet's probes; the NetworkPolicy admits them from any source (see ``network_policy``)."""
DEFAULT_TLS_SECRET = "mtc-replicator-tls"  # noqa: S105 (a Secret's name)
TLS_DIR = "/etc/mtc/tls"
TLS_SERVER_NAME = "mtc-replicator"
"""The one DNS name in every node certificate, the daemon's ``--tls-server-name`` default
(``transport.tls.DEFAULT_SERVER_NAME``; a test keeps them equal)."""
TLS_SECRET_MODE = 0o440
"""Root and the pod's fsGroup (the replicator's gid) may read the key; nobody else."""
DEFAULT_METRICS_NAMESPACE = "monitoring"
CERT_MANAGER_API = "cert-manager.io/v1"
SELF_SIGNED_ISSUER = "mtc-selfsigned"
CA_NAME = "mtc-ca"
"""The CA's Certificate, its Secret and the Issuer that signs with it."""

_BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
SPEC_FIELDS = frozenset(
    {
        "backupUrl",
        "cloudStorageBucketName",
        "registryUrl",
        "inMemoryVolumeSize",
        "nodeSelector",
        "tolerations",
        "image",
        "imagePullPolicy",
        "runAsUser",
        "runAsGroup",
        "logLevel",
        "s3",
        "credentialsSecretName",
        "serviceAccountAnnotations",
        "tls",
        "metricsNamespace",
        "maxTransferRate",
        "yieldToSavesSeconds",
        "drainSeconds",
        "allowedNamespaces",
        "allowedServiceAccounts",
    }
)
IGNORED_GKE_FIELDS = frozenset(
    {
        "gcsFuseMountOptions",
        "enableExternalJaxProcessIds",
        "csiEphemeralLimit",
        "replicationOptions",
    }
)
"""GKE fields with no meaning here: backups go through the object store's SDK, not a FUSE
mount, and the replicator has no such options. Accepted so GKE configurations render."""

# The patterns are the CRD's (deploy/base/crd.yaml); a test feeds both the same bad input.
DNS_LABEL_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
SERVICE_ACCOUNT_RE = re.compile(rf"{DNS_LABEL_RE.pattern}/{DNS_SUBDOMAIN_RE.pattern}")
"""``spec.allowedServiceAccounts`` entries: ``NAMESPACE/NAME``."""
MAX_ALLOWED = 256
"""Entries per allow-list: a plugin flag, not a database."""
_BUCKET = r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]"
BUCKET_RE = re.compile(_BUCKET)
OBJECT_URL_RE = re.compile(rf"(gs|s3)://{_BUCKET}(/\S*)?")
RATE_RE = re.compile(r"unlimited|[0-9]+(\.[0-9]+)?[A-Za-z]{1,5}(/s|ps)?")
"""The shape of ``spec.maxTransferRate`` (``400MiB``, ``2Gbit``); ``parse_rate`` decides."""
QUANTITY_RE = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
"""Kubernetes quantity suffixes; no ``m``: milli to Kubernetes, MiB to ``mount``."""
HTTP_URL_RE = re.compile(r"https?://\S+")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_TLS_FIELDS = frozenset({"enabled", "secretName", "certManager"})
_TOLERATION_FIELDS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
SCRATCH_DIR = "/tmp"  # noqa: S108 (a private emptyDir: the root filesystem is read-only)
DEFAULT_TOLERATIONS: tuple[Manifest, ...] = (
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
)
"""Accelerator nodes are tainted; the node stack must run exactly there."""


class RenderError(ValueError):
    """A configuration that cannot be rendered; ``field`` is its path (``spec.s3.region``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class NodeConfig:
    """A validated configuration: everything the manifests depend on."""

    name: str
    namespace: str
    backup_url: str
    ram_size: str
    registry_url: str | None = None
    node_selector: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Manifest, ...] = DEFAULT_TOLERATIONS
    image: str = DEFAULT_IMAGE
    pull_policy: str = "IfNotPresent"
    run_as_user: int = WORKLOAD_UID
    """The replicator's uid. The kernel lets it move the step directories a workload writes
    only when it owns them, so this must be the training containers' uid (0 for root)."""
    run_as_group: int = WORKLOAD_UID
    log_level: str = "INFO"
    s3_endpoint: str | None = None
    s3_region: str | None = None
    credentials_secret: str | None = None
    """A Secret whose keys become the replicator's environment (static S3 keys)."""
    sa_annotations: tuple[tuple[str, str], ...] = ()
    """For workload identity: ``iam.gke.io/gcp-service-account``, ``eks.amazonaws.com/role-arn``."""
    tls: bool = True
    """Mutual TLS on the replicator's gRPC and data ports; False: plaintext (the daemon warns)."""
    tls_secret: str = DEFAULT_TLS_SECRET
    """The ``kubernetes.io/tls`` Secret (``tls.crt``, ``tls.key``, ``ca.crt``) it mounts."""
    cert_manager: bool = False
    """Also render the cert-manager Issuers and Certificates that make ``tls_secret``."""
    metrics_namespace: str = DEFAULT_METRICS_NAMESPACE
    """The one namespace the NetworkPolicy lets scrape the metrics port."""
    max_transfer_rate: str | None = None
    """``--max-transfer-rate`` as written (validated); None: unlimited."""
    yield_to_saves_seconds: float | None = None
    """``--yield-to-saves-seconds``; None: the daemon's default."""
    drain_seconds: float | None = None
    """``--drain-seconds``; None: the daemon's default. The pod's grace period follows it."""
    allowed_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may mount the CSI volume (the plugin's allow-list)."""
    allowed_service_accounts: tuple[str, ...] = ()
    """``NAMESPACE/NAME`` service accounts whose pods may mount it. Both empty: any pod may
    (the plugin warns, and so does ``mtc render``)."""
    ignored: tuple[str, ...] = ()
    """GKE fields present in the input that have no effect here."""


# --- parsing -------------------------------------------------------------------------------


def _mapping(value: object, field: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RenderError(field, f"expected a mapping, got {_kind(value)}")
    return value


def _string(
    value: object, field: str, pattern: re.Pattern[str] | None = None, what: str = ""
) -> str:
    if not isinstance(value, str) or not value:
        raise RenderError(field, f"expected a non-empty string, got {value!r}")
    if pattern is not None and not pattern.fullmatch(value):
        raise RenderError(field, f"{value!r} is not {what}")
    return value


def _int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RenderError(field, f"expected an integer >= 0, got {value!r}")
    return value


def _bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise RenderError(field, f"expected true or false, got {value!r}")
    return value


def _choice(value: object, field: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise RenderError(field, f"{value!r} is not one of {', '.join(map(repr, choices))}")
    return str(value)


def _string_map(value: object, field: str, keys: re.Pattern[str] | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, item in _mapping(value, field).items():
        if not isinstance(key, str) or (keys is not None and not keys.fullmatch(key)):
            raise RenderError(field, f"{key!r} is not a valid key")
        if not isinstance(item, str):
            raise RenderError(f"{field}.{key}", f"expected a string, got {item!r}")
        out[key] = item
    return out


def _string_list(value: object, field: str, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise RenderError(field, f"expected a list, got {_kind(value)}")
    if len(value) > MAX_ALLOWED:
        raise RenderError(field, f"at most {MAX_ALLOWED} entries, got {len(value)}")
    items = [_string(item, f"{field}[{i}]", pattern, what) for i, item in enumerate(value)]
    return tuple(sorted(set(items)))


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


def _toleration(value: object, field: str) -> Manifest:
    t = dict(_mapping(value, field))
    for key in t:
        if key not in _TOLERATION_FIELDS:
            raise RenderError(f"{field}.{key}", "unknown field")
    out: Manifest = {}
    if "key" in t:
        out["key"] = _string(t["key"], f"{field}.key", _LABEL_KEY, "a label key")
    operator = _choice(t.get("operator", "Equal"), f"{field}.operator", ("Exists", "Equal"))
    out["operator"] = operator
    if "value" in t:
        if not isinstance(t["value"], str) or not _LABEL_VALUE.fullmatch(t["value"]):
            raise RenderError(f"{field}.value", f"{t['value']!r} is not a label value")
        if operator == "Exists" and t["value"]:
            raise RenderError(f"{field}.value", "must be empty when operator is Exists")
        out["value"] = t["value"]
    if "key" not in out and operator != "Exists":
        raise RenderError(f"{field}.operator", "must be Exists when key is empty")
    if "effect" in t:
        out["effect"] = _choice(t["effect"], f"{field}.effect", _EFFECTS)
    if "tolerationSeconds" in t:
        if out.get("effect") != "NoExecute":
            raise RenderError(f"{field}.tolerationSeconds", "needs effect NoExecute")
        out["tolerationSeconds"] = _int(t["tolerationSeconds"], f"{field}.tolerationSeconds")
    return out


def parse(cr: Mapping[str, Any]) -> NodeConfig:
    """Validate a ``CheckpointConfiguration``; a ``RenderError`` names the first bad field."""
    cr = _mapping(cr, "(document)")
    for key in cr:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            raise RenderError(str(key), "unknown field")
    _choice(cr.get("apiVersion"), "apiVersion", (API_VERSION, GKE_API_VERSION))
    _choice(cr.get("kind"), "kind", (KIND,))
    meta = _mapping(cr.get("metadata"), "metadata")
    name = _string(meta.get("name"), "metadata.name", DNS_LABEL_RE, "a DNS label (RFC 1123)")
    namespace = DEFAULT_NAMESPACE
    if meta.get("namespace") is not None:
        namespace = _string(meta["namespace"], "metadata.namespace", DNS_LABEL_RE, "a DNS label")
    spec = _mapping(cr.get("spec"), "spec")
    for key in spec:
        if key not in SPEC_FIELDS and key not in IGNORED_GKE_FIELDS:
            raise RenderError(f"spec.{key}", "unknown field")

    if ("backupUrl" in spec) == ("cloudStorageBucketName" in spec):
        raise RenderError(
            "spec.backupUrl", "set exactly one of backupUrl and cloudStorageBucketName"
        )
    if "backupUrl" in spec:
        backup = _string(
            spec["backupUrl"],
            "spec.backupUrl",
            OBJECT_URL_RE,
            "gs://BUCKET[/PREFIX] or s3://BUCKET[/PREFIX]",
        )
    else:
        bucket = _string(
            spec["cloudStorageBucketName"],
            "spec.cloudStorageBucketName",
            BUCKET_RE,
            "a bucket name",
        )
        backup = f"gs://{bucket}"
    if "inMemoryVolumeSize" not in spec:
        raise RenderError("spec.inMemoryVolumeSize", "required: the RAM disk's size, such as 50Gi")
    ram = _string(
        spec["inMemoryVolumeSize"], "spec.inMemoryVolumeSize", QUANTITY_RE, "a size such as 50Gi"
    )
    if not any(c in "123456789" for c in ram.rstrip("KMGTPEik")):
        raise RenderError("spec.inMemoryVolumeSize", f"{ram!r} is not a positive size")

    registry = None
    if "registryUrl" in spec:
        registry = _string(
            spec["registryUrl"], "spec.registryUrl", OBJECT_URL_RE, "a gs:// or s3:// URL"
        )
    node_selector = _string_map(spec.get("nodeSelector", {}), "spec.nodeSelector", _LABEL_KEY)
    for key, value in node_selector.items():
        if not _LABEL_VALUE.fullmatch(value):
            raise RenderError(f"spec.nodeSelector.{key}", f"{value!r} is not a label value")
    tolerations = DEFAULT_TOLERATIONS
    if "tolerations" in spec:
        if not isinstance(spec["tolerations"], list):
            raise RenderError(
                "spec.tolerations", f"expected a list, got {_kind(spec['tolerations'])}"
            )
        tolerations = tuple(
            _toleration(t, f"spec.tolerations[{i}]") for i, t in enumerate(spec["tolerations"])
        )

    s3_endpoint = s3_region = None
    if "s3" in spec:
        s3 = _mapping(spec["s3"], "spec.s3")
        if not backup.startswith("s3://") and not (registry or "").startswith("s3://"):
            raise RenderError("spec.s3", "only for s3:// backup or registry URLs")
        for key in s3:
            if key not in ("endpointUrl", "region"):
                raise RenderError(f"spec.s3.{key}", "unknown field")
        if "endpointUrl" in s3:
            s3_endpoint = _string(
                s3["endpointUrl"], "spec.s3.endpointUrl", HTTP_URL_RE, "an http(s):// URL"
            )
        if "region" in s3:
            s3_region = _string(
                s3["region"], "spec.s3.region", re.compile(r"[a-z0-9-]+"), "a region name"
            )
    secret = None
    if "credentialsSecretName" in spec:
        secret = _string(
            spec["credentialsSecretName"],
            "spec.credentialsSecretName",
            DNS_SUBDOMAIN_RE,
            "a Secret name",
        )
    annotations = _string_map(
        spec.get("serviceAccountAnnotations", {}), "spec.serviceAccountAnnotations", _LABEL_KEY
    )
    tls = _mapping(spec.get("tls", {}), "spec.tls")
    for key in tls:
        if key not in _TLS_FIELDS:
            raise RenderError(f"spec.tls.{key}", "unknown field")
    tls_enabled = _bool(tls.get("enabled", True), "spec.tls.enabled")
    cert_manager = _bool(tls.get("certManager", False), "spec.tls.certManager")
    if cert_manager and not tls_enabled:
        raise RenderError("spec.tls.certManager", "needs spec.tls.enabled")
    tls_secret = _string(
        tls.get("secretName", DEFAULT_TLS_SECRET),
        "spec.tls.secretName",
        DNS_SUBDOMAIN_RE,
        "a Secret name",
    )
    metrics_namespace = _string(
        spec.get("metricsNamespace", DEFAULT_METRICS_NAMESPACE),
        "spec.metricsNamespace",
        DNS_LABEL_RE,
        "a namespace name",
    )
    rate = None
    if "maxTransferRate" in spec:
        rate = _string(
            spec["maxTransferRate"], "spec.maxTransferRate", RATE_RE, "a rate such as 400MiB"
        )
        try:
            parse_rate(rate)
        except ValueError as exc:
            raise RenderError("spec.maxTransferRate", str(exc)) from None
    yield_seconds = None
    if "yieldToSavesSeconds" in spec:
        yield_seconds = spec["yieldToSavesSeconds"]
        if (
            isinstance(yield_seconds, bool)
            or not isinstance(yield_seconds, int | float)
            or not 0 <= yield_seconds <= MAX_YIELD_TO_SAVES
        ):
            raise RenderError(
                "spec.yieldToSavesSeconds",
                f"expected a number of seconds from 0 to {MAX_YIELD_TO_SAVES:g}, "
                f"got {yield_seconds!r}",
            )
    drain = None
    if "drainSeconds" in spec:
        drain = spec["drainSeconds"]
        if (
            isinstance(drain, bool)
            or not isinstance(drain, int | float)
            or not 0 <= drain <= MAX_DRAIN_SECONDS
        ):
            raise RenderError(
                "spec.drainSeconds",
                f"expected a number of seconds from 0 to {MAX_DRAIN_SECONDS}, got {drain!r}",
            )
    allowed_namespaces = _string_list(
        spec.get("allowedNamespaces", []),
        "spec.allowedNamespaces",
        DNS_LABEL_RE,
        "a namespace name",
    )
    allowed_accounts = _string_list(
        spec.get("allowedServiceAccounts", []),
        "spec.allowedServiceAccounts",
        SERVICE_ACCOUNT_RE,
        "NAMESPACE/NAME of a service account",
    )
    return NodeConfig(
        name=name,
        namespace=namespace,
        backup_url=backup,
        ram_size=ram,
        registry_url=registry,
        node_selector=tuple(sorted(node_selector.items())),
        tolerations=tolerations,
        image=_string(spec.get("image", DEFAULT_IMAGE), "spec.image"),
        pull_policy=_choice(
            spec.get("imagePullPolicy", "IfNotPresent"), "spec.imagePullPolicy", _PULL_POLICIES
        ),
        run_as_user=_int(spec.get("runAsUser", WORKLOAD_UID), "spec.runAsUser"),
        run_as_group=_int(spec.get("runAsGroup", WORKLOAD_UID), "spec.runAsGroup"),
        log_level=_choice(spec.get("logLevel", "INFO"), "spec.logLevel", _LOG_LEVELS),
        s3_endpoint=s3_endpoint,
        s3_region=s3_region,
        credentials_secret=secret,
        sa_annotations=tuple(sorted(annotations.items())),
        tls=tls_enabled,
        tls_secret=tls_secret,
        cert_manager=cert_manager,
        metrics_namespace=metrics_namespace,
        max_transfer_rate=rate,
        yield_to_saves_seconds=yield_seconds,
        drain_seconds=drain,
        allowed_namespaces=allowed_namespaces,
        allowed_service_accounts=allowed_accounts,
        ignored=tuple(sorted(k for k in spec if k in IGNORED_GKE_FIELDS)),
    )


# --- manifests -----------------------------------------------------------------------------


def _labels(c: NodeConfig) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "mtc-node",
        "app.kubernetes.io/instance": c.name,
        "app.kubernetes.io/part-of": "mtc",
    }


def _meta(name: str, c: NodeConfig, namespaced: bool = True) -> Manifest:
    meta: Manifest = {"name": name}
    if namespaced:
        meta["namespace"] = c.namespace
        meta["labels"] = _labels(c)
    else:
        meta["labels"] = {"app.kubernetes.io/part-of": "mtc"}
    return meta


def config_data(c: NodeConfig) -> dict[str, str]:
    """The environment both containers read from the ConfigMap (the ``MTC_*`` flags)."""
    data = {"MTC_LOG_LEVEL": c.log_level, "MTC_RAM_SIZE": c.ram_size, "MTC_BACKUP": c.backup_url}
    if c.registry_url:
        data["MTC_REGISTRY"] = c.registry_url
    if c.max_transfer_rate is not None:
        data["MTC_MAX_TRANSFER_RATE"] = c.max_transfer_rate
    if c.yield_to_saves_seconds is not None:
        data["MTC_YIELD_TO_SAVES_SECONDS"] = f"{c.yield_to_saves_seconds:g}"
    if c.drain_seconds is not None:
        data["MTC_DRAIN_SECONDS"] = f"{c.drain_seconds:g}"
    if c.allowed_namespaces:
        data["MTC_CSI_ALLOWED_NAMESPACES"] = ",".join(c.allowed_namespaces)
    if c.allowed_service_accounts:
        data["MTC_CSI_ALLOWED_SERVICE_ACCOUNTS"] = ",".join(c.allowed_service_accounts)
    if c.s3_endpoint:
        data["AWS_ENDPOINT_URL_S3"] = c.s3_endpoint
    if c.s3_region:
        data["AWS_DEFAULT_REGION"] = c.s3_region
    return data


def _field_env(name: str, path: str) -> Manifest:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _resources(cpu: str, memory: str, memory_limit: str | None) -> Manifest:
    out: Manifest = {"requests": {"cpu": cpu, "memory": memory}}
    if memory_limit:
        out["limits"] = {"memory": memory_limit}
    return out


def _grpc_probe(period: int, failures: int, service: str | None = None) -> Manifest:
    # The plaintext health-only port: kubelet cannot present a client certificate to 7070.
    # Service "" is SERVING while the daemon's loop answers; "readiness" while CHECKPOINT_DIR
    # is usable (the daemon's /readyz).
    return {
        "grpc": {"port": HEALTH_PORT, **({"service": service} if service else {})},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _plugin(c: NodeConfig, config_map: str) -> Manifest:
    """The CSI node plugin: privileged, because it mounts the RAM disk and binds its
    checkpoint subdirectory into pods.

    A native sidecar (an init container that keeps running): the replicator starts only
    after its startup probe saw the RAM disk mounted, so the replicator never writes into
    the host directory underneath, and it stops before the plugin on shutdown.
    """
    return {
        "name": "csi-plugin",
        "image": c.image,
        "imagePullPolicy": c.pull_policy,
        "command": ["mtc-csi"],
        "restartPolicy": "Always",
        "env": [
            {"name": "CSI_ENDPOINT", "value": "unix:///csi/csi.sock"},
            _field_env("NODE_NAME", "spec.nodeName"),
            {"name": "MTC_RAM_DIR", "value": RAM_DIR},
            {"name": "MTC_CHECKPOINT_SUBDIR", "value": CHECKPOINT_SUBDIR},
            {"name": "MTC_CSI_DRIVER_NAME", "value": DRIVER_NAME},
            # The RAM disk's group (mode 1770, checkpoint/ 2770): the replicator's, which
            # training pods join with fsGroup or runAsGroup.
            {"name": "MTC_CSI_FS_GROUP", "value": str(c.run_as_group)},
        ],
        "envFrom": [{"configMapRef": {"name": config_map}}],
        "ports": [{"name": "healthz", "containerPort": PLUGIN_HEALTH_PORT, "protocol": "TCP"}],
        "startupProbe": {
            "exec": {"command": ["mountpoint", "-q", RAM_DIR]},
            "periodSeconds": 2,
            "failureThreshold": 60,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "healthz"},
            "initialDelaySeconds": 10,  # the liveness-probe sidecar starts after this one
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
        "securityContext": {"privileged": True, "runAsUser": 0, "runAsNonRoot": False},
        "resources": _resources("10m", "64Mi", "256Mi"),
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {
                "name": "pods-dir",
                "mountPath": f"{KUBELET_DIR}/pods",
                "mountPropagation": "Bidirectional",
            },
            {"name": "mtc-dir", "mountPath": HOST_DIR, "mountPropagation": "Bidirectional"},
        ],
    }


def _replicator(c: NodeConfig, config_map: str) -> Manifest:
    """The replicator: no privileges; it reads and writes the RAM disk the plugin mounted."""
    secret: Manifest = {"name": c.credentials_secret or DEFAULT_CREDENTIALS_SECRET}
    # The default Secret is optional (GCS and IRSA need none); a named one must exist.
    secret["optional"] = c.credentials_secret is None
    tls_env: list[Manifest] = []
    mounts: list[Manifest] = [
        {"name": "mtc-dir", "mountPath": HOST_DIR, "mountPropagation": "HostToContainer"},
        {"name": "tmp", "mountPath": SCRATCH_DIR},
    ]
    if c.tls:
        tls_env = [
            {"name": "MTC_TLS_CERT", "value": f"{TLS_DIR}/tls.crt"},
            {"name": "MTC_TLS_KEY", "value": f"{TLS_DIR}/tls.key"},
            {"name": "MTC_TLS_CA", "value": f"{TLS_DIR}/ca.crt"},
        ]
        # The only container that mounts the Secret: not the plugin, not the sidecars, and
        # never a training pod (the CSI volume is the RAM disk's checkpoint/ only).
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    return {
        "name": "replicator",
        "image": c.image,
        "imagePullPolicy": c.pull_policy,
        "command": ["mtc-replicator"],
        "env": [
            _field_env("NODE_NAME", "spec.nodeName"),
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("POD_IP", "status.podIP"),
            {"name": "MTC_CHECKPOINT_DIR", "value": CHECKPOINT_DIR},
            {"name": "MTC_STORE_DIR", "value": STORE_DIR},
            {"name": "MTC_OWNER_FILE", "value": OWNER_FILE},
            {"name": "MTC_LISTEN", "value": f"0.0.0.0:{GRPC_PORT}"},
            {"name": "MTC_ADVERTISE", "value": f"$(POD_IP):{GRPC_PORT}"},
            {"name": "MTC_DATA_PORT", "value": str(DATA_PORT)},
            {"name": "MTC_METRICS", "value": f"0.0.0.0:{METRICS_PORT}"},
            {"name": "MTC_HEALTH_LISTEN", "value": f"0.0.0.0:{HEALTH_PORT}"},
            *tls_env,
            {"name": "HOME", "value": SCRATCH_DIR},
        ],
        "envFrom": [{"configMapRef": {"name": config_map}}, {"secretRef": secret}],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "data", "containerPort": DATA_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
        ],
        # Opening the store re-hashes what a crash left unhashed: give it minutes.
        "startupProbe": _grpc_probe(period=5, failures=120),
        "readinessProbe": _grpc_probe(period=10, failures=3, service=READINESS_SERVICE),
        "livenessProbe": _grpc_probe(period=10, failures=6),
        "securityContext": {
            "runAsNonRoot": c.run_as_user != 0,
            "runAsUser": c.run_as_user,
            "runAsGroup": c.run_as_group,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        # No memory limit: tmpfs pages the replicator writes (peer copies, restores) are
        # charged to its cgroup, so a limit below the RAM disk's size would OOM-kill it.
        "resources": _resources("500m", "512Mi", None),
        "volumeMounts": mounts,
    }


def _sidecar_security() -> Manifest:
    return {
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def _registrar() -> Manifest:
    """Registers the plugin's socket with kubelet; runs as its image's root, no capabilities."""
    return {
        "name": "node-driver-registrar",
        "image": REGISTRAR_IMAGE,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--kubelet-registration-path={KUBELET_DIR}/plugins/{DRIVER_NAME}/csi.sock",
            f"--http-endpoint=:{REGISTRAR_HEALTH_PORT}",
        ],
        "ports": [
            {"name": "registrar-hz", "containerPort": REGISTRAR_HEALTH_PORT, "protocol": "TCP"}
        ],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "registrar-hz"},
            "periodSeconds": 10,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
        "securityContext": _sidecar_security(),
        "resources": _resources("10m", "16Mi", "64Mi"),
        "volumeMounts": [
            {"name": "plugin-dir", "mountPath": "/csi"},
            {"name": "registration-dir", "mountPath": "/registration"},
        ],
    }


def _liveness_probe() -> Manifest:
    """Serves the plugin's ``/healthz`` by calling its CSI ``Probe``."""
    return {
        "name": "liveness-probe",
        "image": LIVENESS_PROBE_IMAGE,
        "args": [
            "--csi-address=/csi/csi.sock",
            f"--http-endpoint=:{PLUGIN_HEALTH_PORT}",
            "--probe-timeout=3s",
        ],
        "securityContext": _sidecar_security(),
        "resources": _resources("10m", "16Mi", "64Mi"),
        "volumeMounts": [{"name": "plugin-dir", "mountPath": "/csi"}],
    }


def _host_path(name: str, path: str, kind: str) -> Manifest:
    return {"name": name, "hostPath": {"path": path, "type": kind}}


def _selector(c: NodeConfig) -> dict[str, str]:
    """The DaemonSet's pod selector, which the NetworkPolicy uses too."""
    return {k: v for k, v in _labels(c).items() if k != "app.kubernetes.io/part-of"}


def daemonset(c: NodeConfig, config_map: str) -> Manifest:
    pod_security: Manifest = {"seccompProfile": {"type": "RuntimeDefault"}}
    volumes: list[Manifest] = [
        _host_path("plugin-dir", f"{KUBELET_DIR}/plugins/{DRIVER_NAME}", "DirectoryOrCreate"),
        _host_path("registration-dir", f"{KUBELET_DIR}/plugins_registry", "Directory"),
        _host_path("pods-dir", f"{KUBELET_DIR}/pods", "Directory"),
        _host_path("mtc-dir", HOST_DIR, "DirectoryOrCreate"),
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    if c.tls:
        # Secret files are root's; fsGroup gives them the replicator's group, so its key is
        # readable without being world-readable. Not optional: no Secret, no start.
        pod_security["fsGroup"] = c.run_as_group
        volumes.append(
            {
                "name": "tls",
                "secret": {"secretName": c.tls_secret, "defaultMode": TLS_SECRET_MODE},
            }
        )
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(f"mtc-node-{c.name}", c),
        "spec": {
            "selector": {"matchLabels": _selector(c)},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": _labels(c),
                    "annotations": {
                        "kubectl.kubernetes.io/default-container": "replicator",
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                    },
                },
                "spec": {
                    "serviceAccountName": f"mtc-node-{c.name}",
                    "automountServiceAccountToken": False,
                    "priorityClassName": PRIORITY_CLASS,
                    "nodeSelector": {"kubernetes.io/os": "linux", **dict(c.node_selector)},
                    "tolerations": [dict(t) for t in c.tolerations],
                    "terminationGracePeriodSeconds": grace_seconds(c),
                    "securityContext": pod_security,
                    "initContainers": [_plugin(c, config_map)],
                    "containers": [_replicator(c, config_map), _registrar(), _liveness_probe()],
                    "volumes": volumes,
                },
            },
        },
    }


def grace_seconds(c: NodeConfig) -> int:
    """The pod's ``terminationGracePeriodSeconds``: the replicator's drain (``--drain-seconds``),
    then its gRPC server's grace for transfers in flight and its exit (``STOP_MARGIN``); 30,
    Kubernetes' default, with the default drain."""
    drain = DEFAULT_DRAIN_SECONDS if c.drain_seconds is None else c.drain_seconds
    return math.ceil(drain) + STOP_MARGIN


def _tcp(*ports: int) -> list[Manifest]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def network_policy(c: NodeConfig) -> Manifest:
    """Ingress to the node stack's pods: peers on gRPC and data, one namespace on metrics,
    kubelet's probes from anywhere (their source differs by CNI; they say only healthy or
    not), nothing else. Egress stays open (peers, coordinator, object store)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(f"mtc-node-{c.name}", c),
        "spec": {
            "podSelector": {"matchLabels": _selector(c)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": _selector(c)}}],
                    "ports": _tcp(GRPC_PORT, DATA_PORT),
                },
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": c.metrics_namespace}
                            }
                        }
                    ],
                    "ports": _tcp(METRICS_PORT),
                },
                {"ports": _tcp(*PROBE_PORTS)},
            ],
        },
    }


def _cert_manager_meta(name: str, c: NodeConfig) -> Manifest:
    # Shared by every configuration of the namespace (one CA, so all node pools trust each
    # other): no instance label.
    return {"name": name, "namespace": c.namespace, "labels": {"app.kubernetes.io/part-of": "mtc"}}


def _issuer_ref(name: str) -> Manifest:
    return {"group": "cert-manager.io", "kind": "Issuer", "name": name}


def cert_manager_objects(c: NodeConfig) -> list[Manifest]:
    """A self-signed CA and the node certificate in ``tls_secret``, as
    ``deploy/components/cert-manager`` holds them; cert-manager renews the Secret in place
    and the daemon re-reads it without a restart."""
    return [
        {
            "apiVersion": CERT_MANAGER_API,
            "kind": "Issuer",
            "metadata": _cert_manager_meta(SELF_SIGNED_ISSUER, c),
            "spec": {"selfSigned": {}},
        },
        {
            "apiVersion": CERT_MANAGER_API,
            "kind": "Certificate",
            "metadata": _cert_manager_meta(CA_NAME, c),
            "spec": {
                "isCA": True,
                "commonName": "mtc-replicator CA",
                "secretName": CA_NAME,
                "duration": "87600h",
                "renewBefore": "720h",
                # A renewed CA keeps its key: what it signed before still verifies.
                "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Never"},
                "issuerRef": _issuer_ref(SELF_SIGNED_ISSUER),
            },
        },
        {
            "apiVersion": CERT_MANAGER_API,
            "kind": "Issuer",
            "metadata": _cert_manager_meta(CA_NAME, c),
            "spec": {"ca": {"secretName": CA_NAME}},
        },
        {
            "apiVersion": CERT_MANAGER_API,
            "kind": "Certificate",
            "metadata": _cert_manager_meta(c.tls_secret, c),
            "spec": {
                "secretName": c.tls_secret,
                "dnsNames": [TLS_SERVER_NAME],
                "usages": ["digital signature", "server auth", "client auth"],
                "duration": "2160h",
                "renewBefore": "720h",
                "privateKey": {
                    "algorithm": "ECDSA",
                    "size": 256,
                    "encoding": "PKCS8",
                    "rotationPolicy": "Always",
                },
                "issuerRef": _issuer_ref(CA_NAME),
            },
        },
    ]


def manifests(c: NodeConfig) -> list[Manifest]:
    """Every object of one configuration's node stack, in apply order."""
    data = config_data(c)
    # A content hash in the name rolls the DaemonSet when the configuration changes.
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]
    config_map = f"mtc-node-{c.name}-config-{digest}"
    out: list[Manifest] = []
    if c.namespace not in _BUILTIN_NAMESPACES:  # never relabel a namespace we do not own
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {
                    "name": c.namespace,
                    "labels": {
                        "app.kubernetes.io/part-of": "mtc",
                        # The plugin is privileged and mounts host paths.
                        "pod-security.kubernetes.io/enforce": "privileged",
                    },
                },
            }
        )
    out.append(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": _meta(PRIORITY_CLASS, c, namespaced=False),
            # Our own class: system-node-critical is quota-limited to kube-system on some
            # clusters (GKE). Training pods need the node stack, so it must not be evicted.
            "value": 1_000_000_000,
            "globalDefault": False,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": "The multi-tier checkpoint node stack (CSI plugin and replicator).",
        }
    )
    out.append(
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSIDriver",
            "metadata": _meta(DRIVER_NAME, c, namespaced=False),
            "spec": {
                "attachRequired": False,
                "podInfoOnMount": True,
                "volumeLifecycleModes": ["Ephemeral"],
                # kubelet must not chown the RAM disk: the replicator's ownership is the point.
                "fsGroupPolicy": "None",
                "requiresRepublish": False,
                "storageCapacity": False,
            },
        }
    )
    account_meta = _meta(f"mtc-node-{c.name}", c)
    if c.sa_annotations:
        account_meta["annotations"] = dict(c.sa_annotations)
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": account_meta,
            # Nothing in the node stack calls the Kubernetes API (deploy/base/serviceaccount.yaml).
            "automountServiceAccountToken": False,
        }
    )
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(config_map, c),
            "data": data,
        }
    )
    out.append(network_policy(c))
    if c.cert_manager:
        out.extend(cert_manager_objects(c))
    out.append(daemonset(c, config_map))
    return out


def render(cr: Mapping[str, Any]) -> list[Manifest]:
    """The node stack's manifests for one ``CheckpointConfiguration`` (parsed YAML)."""
    return manifests(parse(cr))


# --- I/O: `mtc render` ---------------------------------------------------------------------


def load(text: str) -> Mapping[str, Any]:
    """The one document of a configuration file."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError("(document)", f"not valid YAML: {exc}") from None
    if len(docs) != 1:
        raise RenderError("(document)", f"expected one YAML document, found {len(docs)}")
    return _mapping(docs[0], "(document)")


def to_yaml(objects: Sequence[Manifest]) -> str:
    """Multi-document YAML, keys in the order they were built (kind first, as people read)."""
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def _file_name(index: int, obj: Manifest) -> str:
    # Numbered in apply order, and no content hash in the name: a new render overwrites the old.
    return f"{index:02d}-{obj['kind'].lower()}.yaml"


def write_dir(objects: Sequence[Manifest], out: Path) -> list[Path]:
    """One file per object plus a ``kustomization.yaml``: ``kubectl apply -k DIR`` works."""
    out.mkdir(parents=True, exist_ok=True)
    names = [_file_name(i, obj) for i, obj in enumerate(objects)]
    for name, obj in zip(names, objects, strict=True):
        (out / name).write_text(to_yaml([obj]))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": names,
    }
    (out / "kustomization.yaml").write_text(to_yaml([kustomization]))
    return [out / n for n in (*names, "kustomization.yaml")]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``mtc render`` on the operator CLI's subcommands."""
    about = "turn a CheckpointConfiguration into the node stack's Kubernetes manifests"
    p = sub.add_parser("render", help=about, description=about)
    p.add_argument("config", help="the CheckpointConfiguration YAML file, or - for stdin")
    p.add_argument(
        "-o",
        "--output",
        default="-",
        help="- (default): multi-document YAML on stdout; DIR: one file per object and a "
        "kustomization.yaml",
    )


def run(args: argparse.Namespace) -> int:
    """``mtc render``: 0 on success, 2 when the configuration is invalid or unreadable."""
    try:
        text = sys.stdin.read() if args.config == "-" else Path(args.config).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"mtc render: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        config = parse(load(text))
    except RenderError as exc:
        print(f"mtc render: {args.config}: {exc}", file=sys.stderr)
        return 2
    for name in config.ignored:
        print(f"mtc render: warning: spec.{name} has no effect here (GKE-only)", file=sys.stderr)
    if not config.allowed_namespaces and not config.allowed_service_accounts:
        print(
            "mtc render: warning: no spec.allowedNamespaces or spec.allowedServiceAccounts: "
            "pods of every namespace may mount the node's checkpoints",
            file=sys.stderr,
        )
    objects = manifests(config)
    if args.output == "-":
        sys.stdout.write(to_yaml(objects))
        return 0
    try:
        written = write_dir(objects, Path(args.output))
    except OSError as exc:
        print(f"mtc render: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path, file=sys.stderr)
    return 0
