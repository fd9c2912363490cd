"""A validated ``NodeConfig`` turned into the node stack's Kubernetes objects.

Pure (a frozen dataclass in, dicts out), so every field mapping is unit-tested without a
cluster. The objects are the ones ``deploy/base`` holds (a test keeps the two equal): the CSI
plugin (privileged, it mounts) and the replicator (unprivileged) in one DaemonSet per
configuration, sharing the node's RAM disk, and the NetworkPolicy in front of them. TLS is
on unless ``spec.tls.enabled`` is false: the replicator alone mounts the TLS Secret, and
with ``spec.tls.certManager`` the cert-manager objects that make it are rendered too
(``deploy/overlays/cert-manager``).
"""

from __future__ import annotations

import hashlib
import json
import math

from mtc_replicator.core.drain import DEFAULT_DRAIN_SECONDS
from mtc_replicator.core.identity import node_uri
from mtc_replicator.tools.render_config import Manifest, NodeConfig
from mtc_replicator.transport.grpc_server import READINESS_SERVICE

DRIVER_NAME = "multitier-checkpoint.mtc.dev"
DEFAULT_CREDENTIALS_SECRET = "mtc-backup-credentials"  # noqa: S105 (a Secret's name)
STOP_MARGIN = 10
"""Seconds of the pod's grace period after the drain: the replicator's gRPC server lets
transfers in flight end (5 s), then it exits and its sidecars stop."""
PRIORITY_CLASS = "mtc-node-critical"
REGISTRAR_IMAGE = "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0"
LIVENESS_PROBE_IMAGE = "registry.k8s.io/sig-storage/livenessprobe:v2.19.0"

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
CONTROLLER = "mtc-controller"
"""The controller's pods' ``app.kubernetes.io/name`` (deploy/components/controller)."""
TLS_DIR = "/etc/mtc/tls"
TLS_SERVER_NAME = "mtc-replicator"
"""The one DNS name in every node certificate, the daemon's ``--tls-server-name`` default
(``transport.tls.DEFAULT_SERVER_NAME``; a test keeps them equal)."""
TLS_SECRET_MODE = 0o440
"""Root and the pod's fsGroup (the replicator's gid) may read the key; nobody else."""
CERT_MANAGER_API = "cert-manager.io/v1"
CSI_DRIVER = "csi.cert-manager.io"
"""cert-manager's csi-driver: with per-node certificates, each pod's key and certificate."""
NODE_POD_PATTERN = "mtc-node-[a-z0-9]([-a-z0-9]{0,46}[a-z0-9])?-[a-z0-9]{5}"
"""``--tls-node-name-pattern`` with per-node certificates: the DaemonSet's pod names
(``mtc-node-<name>-<5 characters>``), which csi-driver puts in each pod's certificate; it
cannot name the node (docs/deploy.md, "Per-node certificates")."""
SELF_SIGNED_ISSUER = "mtc-selfsigned"
CA_NAME = "mtc-ca"
"""The CA's Certificate, its Secret and the Issuer that signs with it."""

_BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
PODINFO_DIR = "/etc/mtc/podinfo"
"""The plugin's downward-API volume: its pod's annotations (``--release-file``)."""
SCRATCH_DIR = "/tmp"  # noqa: S108 (a private emptyDir: the root filesystem is read-only)


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
    if c.keep_steps is not None:
        data["MTC_KEEP_STEPS"] = str(c.keep_steps)
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
            {"name": "MTC_CSI_ENDPOINT", "value": "unix:///csi/csi.sock"},
            _field_env("MTC_CSI_NODE_ID", "spec.nodeName"),
            {"name": "MTC_RAM_DIR", "value": RAM_DIR},
            {"name": "MTC_CHECKPOINT_SUBDIR", "value": CHECKPOINT_SUBDIR},
            {"name": "MTC_CSI_DRIVER_NAME", "value": DRIVER_NAME},
            # The RAM disk's group (mode 1770, checkpoint/ 2770): the replicator's, which
            # training pods join with fsGroup or runAsGroup.
            {"name": "MTC_CSI_FS_GROUP", "value": str(c.run_as_group)},
            # The pod's annotations: the controller sets one on a delete that frees the RAM
            # disk (csi.release); every other stop keeps it.
            {"name": "MTC_CSI_RELEASE_FILE", "value": f"{PODINFO_DIR}/annotations"},
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
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
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
            # Each pod's certificate names it: only this DaemonSet's pod names are nodes.
            {"name": "MTC_TLS_NODE_NAME_PATTERN", "value": NODE_POD_PATTERN}
            if c.per_node_certificates
            # One shared Secret, naming no node (docs/deploy.md, "Per-node certificates").
            else {"name": "MTC_TLS_SHARED_CERTIFICATE", "value": "true"},
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
            {"name": "tls", "csi": _csi_driver_volume(c)}
            if c.per_node_certificates
            else {
                "name": "tls",
                "secret": {"secretName": c.tls_secret, "defaultMode": TLS_SECRET_MODE},
            }
        )
    # Last, so the volumes before keep their places (the components patch them by index).
    field = {"fieldRef": {"fieldPath": "metadata.annotations"}}
    volumes.append(
        {"name": "podinfo", "downwardAPI": {"items": [{"path": "annotations", **field}]}}
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
                    "nodeSelector": c.pod_node_selector,
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
    """Ingress to the node stack's pods: peers on gRPC and data, one namespace and the
    controller's pods on metrics, kubelet's probes from anywhere (their source differs by
    CNI; they say only healthy or not), the controller's pods on gRPC (sticky ranks),
    nothing else. Egress stays open (peers, coordinator, object store)."""

    def controller() -> Manifest:  # a new dict each time: YAML output would alias one
        return {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": c.controller_namespace}
            },
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": CONTROLLER}},
        }

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
                        },
                        controller(),
                    ],
                    "ports": _tcp(METRICS_PORT),
                },
                {"ports": _tcp(*PROBE_PORTS)},
                # The controller on gRPC only: sticky ranks (Node/Status, Node/AssignRank).
                {"from": [controller()], "ports": _tcp(GRPC_PORT)},
            ],
        },
    }


def _csi_driver_volume(c: NodeConfig) -> Manifest:
    """csi-driver's inline volume: a key made on the node and a certificate from the CA
    Issuer naming the pod (``spiffe://mtc-replicator/node/${POD_NAME}``) beside the shared
    DNS name, renewed in place; files 0640 in the replicator's group."""
    attr = "csi.cert-manager.io/"
    return {
        "driver": CSI_DRIVER,
        "readOnly": True,
        "volumeAttributes": {
            attr + "issuer-name": CA_NAME,
            attr + "issuer-kind": "Issuer",
            attr + "issuer-group": "cert-manager.io",
            attr + "dns-names": TLS_SERVER_NAME,
            attr + "uri-sans": node_uri("${POD_NAME}"),
            attr + "key-usages": "digital signature,server auth,client auth",
            attr + "key-algorithm": "ECDSA",
            attr + "key-size": "256",
            attr + "key-encoding": "PKCS8",
            attr + "duration": "2160h",
            attr + "renew-before": "720h",
            attr + "fs-group": str(c.run_as_group),
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
    and the daemon re-reads it without a restart. With per-node certificates, the CA only:
    csi-driver asks its Issuer for each pod's certificate."""
    objects = [
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
    return objects[:3] if c.per_node_certificates else objects


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
            # clusters (GKE). Training pods need the node stack: the high value schedules it
            # before them and keeps them from preempting it, and Never keeps it from
            # preempting running training pods (it waits for room instead).
            "value": 1_000_000_000,
            "globalDefault": False,
            "preemptionPolicy": "Never",
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
