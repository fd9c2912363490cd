"""A ``CheckpointConfiguration`` read and checked: YAML text to a validated ``NodeConfig``.

Pure (text or a dict in, a frozen dataclass out), so every rule is unit-tested without a
cluster; a ``RenderError`` names the first bad field as the CRD's path (``spec.s3.region``).
``render_manifests`` turns the result into objects, ``render`` is the ``mtc render`` command.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from mtc_replicator import __version__
from mtc_replicator.core.pacing import MAX_YIELD_TO_SAVES, parse_rate

Manifest = dict[str, Any]

GROUP = "checkpointing.mtc.dev"
API_VERSION = f"{GROUP}/v1"
GKE_API_VERSION = "checkpointing.gke.io/v1"
"""GKE's configurations render unchanged: a drop-in needs no rewrite of what users have."""
KIND = "CheckpointConfiguration"
DEFAULT_NAMESPACE = "mtc-system"
DEFAULT_IMAGE = f"mtc-replicator:{__version__}"
MAX_DRAIN_SECONDS = 600
"""``spec.drainSeconds`` at most: a node drain waits this long plus ``STOP_MARGIN`` per pod."""
WORKLOAD_UID = 65532
"""The image's non-root user; training containers must run as the replicator's uid."""
DEFAULT_TLS_SECRET = "mtc-replicator-tls"  # noqa: S105 (a Secret's name)
DEFAULT_METRICS_NAMESPACE = "monitoring"

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
        "keepSteps",
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
_TLS_FIELDS = frozenset({"enabled", "secretName", "certManager", "perNodeCertificates"})
_TOLERATION_FIELDS = frozenset({"key", "operator", "value", "effect", "tolerationSeconds"})
_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
DEFAULT_TOLERATIONS: tuple[Manifest, ...] = tuple(
    {"key": key, "operator": "Exists", "effect": effect}
    for key in ("nvidia.com/gpu", "sku", "google.com/tpu")  # sku=gpu: AKS
    for effect in ("NoSchedule", "NoExecute")
)
"""Accelerator nodes are tainted; the node stack must run exactly there."""
POOL_LABEL = "checkpointing.mtc.dev/pool"
DEFAULT_NODE_SELECTOR: tuple[tuple[str, str], ...] = ((POOL_LABEL, "true"),)
"""Without ``spec.nodeSelector``: the nodes the operator labels as the checkpointing pool, not
every node (the plugin is privileged and requests resources)."""


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
    node_selector: tuple[tuple[str, str], ...] = DEFAULT_NODE_SELECTOR
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
    per_node_certificates: bool = False
    """With ``cert_manager``: a certificate per replicator pod from cert-manager's
    csi-driver, naming the pod, instead of the shared ``tls_secret``
    (``deploy/overlays/cert-manager-per-node``)."""
    metrics_namespace: str = DEFAULT_METRICS_NAMESPACE
    """The one namespace the NetworkPolicy lets scrape the metrics port."""
    controller_namespace: str = DEFAULT_NAMESPACE
    """Where mtc-controller runs: its pods may read the metrics port too (the replicators'
    own readiness reasons and jobs, for the configuration's status)."""
    max_transfer_rate: str | None = None
    """``--max-transfer-rate`` as written (validated); None: unlimited."""
    yield_to_saves_seconds: float | None = None
    """``--yield-to-saves-seconds``; None: the daemon's default."""
    drain_seconds: float | None = None
    """``--drain-seconds``; None: the daemon's default. The pod's grace period follows it."""
    keep_steps: int | None = None
    """``--keep-steps``: each node's newest steps kept on its RAM disk; None: the default."""
    allowed_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may mount the CSI volume (the plugin's allow-list)."""
    allowed_service_accounts: tuple[str, ...] = ()
    """``NAMESPACE/NAME`` service accounts whose pods may mount it. Both empty: any pod may
    (the plugin warns, and so does ``mtc render``)."""
    ignored: tuple[str, ...] = ()
    """GKE fields present in the input that have no effect here."""

    @property
    def pod_node_selector(self) -> dict[str, str]:
        """The ``nodeSelector`` of the node stack's pods, and so of every pod that mounts the
        RAM disk: only those nodes have it."""
        return {"kubernetes.io/os": "linux", **dict(self.node_selector)}


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


def _document(cr: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    """The envelope: its kind and version, ``metadata`` (name, namespace) and ``spec``."""
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
    return name, namespace, spec


def _backup_url(spec: Mapping[str, Any]) -> str:
    """``spec.backupUrl``, or GKE's ``cloudStorageBucketName`` as a ``gs://`` URL."""
    if ("backupUrl" in spec) == ("cloudStorageBucketName" in spec):
        raise RenderError(
            "spec.backupUrl", "set exactly one of backupUrl and cloudStorageBucketName"
        )
    if "backupUrl" in spec:
        return _string(
            spec["backupUrl"],
            "spec.backupUrl",
            OBJECT_URL_RE,
            "gs://BUCKET[/PREFIX] or s3://BUCKET[/PREFIX]",
        )
    bucket = _string(
        spec["cloudStorageBucketName"],
        "spec.cloudStorageBucketName",
        BUCKET_RE,
        "a bucket name",
    )
    return f"gs://{bucket}"


def _ram_size(spec: Mapping[str, Any]) -> str:
    if "inMemoryVolumeSize" not in spec:
        raise RenderError("spec.inMemoryVolumeSize", "required: the RAM disk's size, such as 50Gi")
    ram = _string(
        spec["inMemoryVolumeSize"], "spec.inMemoryVolumeSize", QUANTITY_RE, "a size such as 50Gi"
    )
    if not any(c in "123456789" for c in ram.rstrip("KMGTPEik")):
        raise RenderError("spec.inMemoryVolumeSize", f"{ram!r} is not a positive size")
    return ram


def _node_selector(spec: Mapping[str, Any]) -> dict[str, str]:
    if "nodeSelector" not in spec:
        return dict(DEFAULT_NODE_SELECTOR)
    node_selector = _string_map(spec.get("nodeSelector", {}), "spec.nodeSelector", _LABEL_KEY)
    for key, value in node_selector.items():
        if not _LABEL_VALUE.fullmatch(value):
            raise RenderError(f"spec.nodeSelector.{key}", f"{value!r} is not a label value")
    return node_selector


def _tolerations(spec: Mapping[str, Any]) -> tuple[Manifest, ...]:
    if "tolerations" not in spec:
        return DEFAULT_TOLERATIONS
    if not isinstance(spec["tolerations"], list):
        raise RenderError("spec.tolerations", f"expected a list, got {_kind(spec['tolerations'])}")
    return tuple(
        _toleration(t, f"spec.tolerations[{i}]") for i, t in enumerate(spec["tolerations"])
    )


def _s3(
    spec: Mapping[str, Any], backup: str, registry: str | None
) -> tuple[str | None, str | None]:
    """``spec.s3``'s endpoint and region; only where a URL is ``s3://``."""
    s3_endpoint = s3_region = None
    if "s3" not in spec:
        return s3_endpoint, s3_region
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
    return s3_endpoint, s3_region


def _tls(spec: Mapping[str, Any]) -> tuple[bool, bool, bool, str]:
    """``spec.tls``: enabled, cert-manager, per-node certificates, and the Secret's name."""
    tls = _mapping(spec.get("tls", {}), "spec.tls")
    for key in tls:
        if key not in _TLS_FIELDS:
            raise RenderError(f"spec.tls.{key}", "unknown field")
    tls_enabled = _bool(tls.get("enabled", True), "spec.tls.enabled")
    cert_manager = _bool(tls.get("certManager", False), "spec.tls.certManager")
    if cert_manager and not tls_enabled:
        raise RenderError("spec.tls.certManager", "needs spec.tls.enabled")
    per_node = _bool(tls.get("perNodeCertificates", False), "spec.tls.perNodeCertificates")
    if per_node and not cert_manager:
        # csi-driver's certificates come from the CA Issuer the cert-manager objects make.
        raise RenderError("spec.tls.perNodeCertificates", "needs spec.tls.certManager")
    tls_secret = _string(
        tls.get("secretName", DEFAULT_TLS_SECRET),
        "spec.tls.secretName",
        DNS_SUBDOMAIN_RE,
        "a Secret name",
    )
    return tls_enabled, cert_manager, per_node, tls_secret


def _optional(spec: Mapping[str, Any], key: str, pattern: re.Pattern[str], what: str) -> str | None:
    """``spec.KEY`` matching ``pattern``, or None where it is not set."""
    if key not in spec:
        return None
    return _string(spec[key], f"spec.{key}", pattern, what)


def _rate(spec: Mapping[str, Any]) -> str | None:
    if "maxTransferRate" not in spec:
        return None
    rate = _string(
        spec["maxTransferRate"], "spec.maxTransferRate", RATE_RE, "a rate such as 400MiB"
    )
    try:
        parse_rate(rate)
    except ValueError as exc:
        raise RenderError("spec.maxTransferRate", str(exc)) from None
    return rate


def _seconds(spec: Mapping[str, Any], key: str, most: float, shown: str) -> float | None:
    """A number of seconds from 0 to ``most`` (``shown`` as the error writes it), or None."""
    if key not in spec:
        return None
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most:
        raise RenderError(
            f"spec.{key}",
            f"expected a number of seconds from 0 to {shown}, got {value!r}",
        )
    return value


def _count(spec: Mapping[str, Any], key: str) -> int | None:
    """A whole number >= 1, or None where it is not set."""
    if key not in spec:
        return None
    value = spec[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RenderError(f"spec.{key}", f"expected a whole number >= 1, got {value!r}")
    return value


def parse(cr: Mapping[str, Any]) -> NodeConfig:
    """Validate a ``CheckpointConfiguration``; a ``RenderError`` names the first bad field.

    Sections are checked in the order their fields are listed, so the first bad one is named.
    """
    name, namespace, spec = _document(cr)
    backup = _backup_url(spec)
    ram = _ram_size(spec)
    registry = _optional(spec, "registryUrl", OBJECT_URL_RE, "a gs:// or s3:// URL")
    node_selector = _node_selector(spec)
    tolerations = _tolerations(spec)
    s3_endpoint, s3_region = _s3(spec, backup, registry)
    secret = _optional(spec, "credentialsSecretName", DNS_SUBDOMAIN_RE, "a Secret name")
    annotations = _string_map(
        spec.get("serviceAccountAnnotations", {}), "spec.serviceAccountAnnotations", _LABEL_KEY
    )
    tls_enabled, cert_manager, per_node, tls_secret = _tls(spec)
    metrics_namespace = _string(
        spec.get("metricsNamespace", DEFAULT_METRICS_NAMESPACE),
        "spec.metricsNamespace",
        DNS_LABEL_RE,
        "a namespace name",
    )
    rate = _rate(spec)
    yield_seconds = _seconds(
        spec, "yieldToSavesSeconds", MAX_YIELD_TO_SAVES, f"{MAX_YIELD_TO_SAVES:g}"
    )
    drain = _seconds(spec, "drainSeconds", MAX_DRAIN_SECONDS, f"{MAX_DRAIN_SECONDS}")
    keep_steps = _count(spec, "keepSteps")
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
        per_node_certificates=per_node,
        metrics_namespace=metrics_namespace,
        max_transfer_rate=rate,
        yield_to_saves_seconds=yield_seconds,
        drain_seconds=drain,
        keep_steps=keep_steps,
        allowed_namespaces=allowed_namespaces,
        allowed_service_accounts=allowed_accounts,
        ignored=tuple(sorted(k for k in spec if k in IGNORED_GKE_FIELDS)),
    )


def load(text: str) -> Mapping[str, Any]:
    """The one document of a configuration file."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise RenderError("(document)", f"not valid YAML: {exc}") from None
    if len(docs) != 1:
        raise RenderError("(document)", f"expected one YAML document, found {len(docs)}")
    return _mapping(docs[0], "(document)")
