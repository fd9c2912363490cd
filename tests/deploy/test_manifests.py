"""Every kustomization builds, every object is valid for the Kubernetes versions of
KUBE_VERSIONS, and the node stack keeps the properties it depends on (privileges, propagation,
paths, names that must agree, TLS on with the Secret in the replicator alone, the
NetworkPolicy's rules). The tests that take ``built`` run on the Helm chart's renders too
(tests/deploy/test_helm.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from mtc_replicator.csi import plugin as csi_plugin
from mtc_replicator.csi.checkpoint import CheckpointDir
from mtc_replicator.tools import certs, render_config, render_manifests
from mtc_replicator.transport import tls
from mtc_replicator.transport.grpc_server import READINESS_SERVICE
from tests.deploy import helm_chart
from tests.deploy.k8s import (
    DEPLOY,
    REPO,
    Obj,
    all_containers,
    cert_manager_errors,
    check_cert_manager_chain,
    container,
    daemon_options,
    env,
    ingress_rules,
    kustomize,
    name_of,
    network_probe_ports,
    only,
    secret_volumes,
    validate,
)
from tests.deploy.k8s import pod_of as _pod

KUSTOMIZATION_FILES = sorted(DEPLOY.rglob("kustomization.yaml"))
COMPONENTS = [
    p.parent for p in KUSTOMIZATION_FILES if yaml.safe_load(p.read_text())["kind"] == "Component"
]
CONTROLLER_OVERLAY = DEPLOY / "overlays" / "controller"
"""The controller's install: no static node stack (test_controller_manifests.py checks it)."""
KUSTOMIZATIONS = [
    p.parent
    for p in KUSTOMIZATION_FILES
    if p.parent not in COMPONENTS and p.parent != CONTROLLER_OVERLAY
]
CERT_MANAGER_OVERLAY = DEPLOY / "overlays" / "cert-manager"
CERT_MANAGER_COMPONENT = DEPLOY / "components" / "cert-manager"
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
NODE_STACK_KINDS = {
    "CustomResourceDefinition",
    "Namespace",
    "PriorityClass",
    "CSIDriver",
    "ServiceAccount",
    "ConfigMap",
    "DaemonSet",
    "NetworkPolicy",
}
TLS_SECRET = "mtc-replicator-tls"  # noqa: S105 (a Secret's name)


def _id(path: Path) -> str:
    return str(path.relative_to(DEPLOY))


def test_the_kustomizations_are_the_expected_ones() -> None:
    assert [_id(p) for p in KUSTOMIZATIONS] == [
        "base",
        "overlays/cert-manager",
        "overlays/cert-manager-per-node",
        "overlays/gke",
        "overlays/s3",
    ]
    assert [_id(p) for p in COMPONENTS] == [
        "components/cert-manager",
        "components/cert-manager-per-node",
        "components/controller",
        "components/controller-certificate",
        "components/monitoring",
        "components/root-training",
    ]


HELM_RENDERS = [f"helm:{name}" for name in helm_chart.MIRRORS if name != _id(CONTROLLER_OVERLAY)]
"""The Helm chart with the values of each kustomization: every property below holds for it."""


@pytest.fixture(
    params=[*KUSTOMIZATIONS, *HELM_RENDERS], ids=lambda p: p if isinstance(p, str) else _id(p)
)
def built(request: pytest.FixtureRequest) -> list[Obj]:
    if isinstance(request.param, str):
        return helm_chart.render_files(*helm_chart.MIRRORS[request.param.removeprefix("helm:")])
    path: Path = request.param
    return kustomize(path)


def test_every_object_is_valid(built: list[Obj]) -> None:
    kinds = {o["kind"] for o in built}
    assert kinds - {"Issuer", "Certificate"} == NODE_STACK_KINDS
    for obj in built:
        validate(obj)


def test_no_access_to_the_kubernetes_api(built: list[Obj]) -> None:
    # Least privilege: nothing in the node stack calls the API (deploy/base/serviceaccount.yaml).
    assert not [name_of(o) for o in built if o["kind"] in RBAC_KINDS]
    assert only(built, "ServiceAccount")["automountServiceAccountToken"] is False
    pod = _pod(built)
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == only(built, "ServiceAccount")["metadata"]["name"]


def test_csi_driver_is_ephemeral_with_pod_info(built: list[Obj]) -> None:
    driver = only(built, "CSIDriver")
    assert driver["metadata"]["name"] == render_manifests.DRIVER_NAME
    spec = driver["spec"]
    assert spec["attachRequired"] is False
    assert spec["podInfoOnMount"] is True
    assert spec["volumeLifecycleModes"] == ["Ephemeral"]
    assert spec["fsGroupPolicy"] == "None"


def test_plugin_is_privileged_and_propagates_its_mounts(built: list[Obj]) -> None:
    pod = _pod(built)
    plugin = container(pod, "csi-plugin")
    assert plugin in pod["initContainers"]  # a native sidecar: gates the replicator's start
    assert plugin["restartPolicy"] == "Always"
    assert plugin["securityContext"]["privileged"] is True
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    assert mounts["/var/lib/kubelet/pods"]["mountPropagation"] == "Bidirectional"
    e = env(plugin)
    ram_dir = e["MTC_RAM_DIR"]
    (host_mount,) = [p for p in mounts if ram_dir.startswith(p + "/")]
    assert mounts[host_mount]["mountPropagation"] == "Bidirectional"
    assert plugin["startupProbe"]["exec"]["command"] == ["mountpoint", "-q", ram_dir]
    assert e["MTC_CSI_DRIVER_NAME"] == render_manifests.DRIVER_NAME
    assert e["MTC_CSI_ENDPOINT"] == "unix:///csi/csi.sock"
    assert plugin["command"] == ["mtc-csi"]


def test_replicator_is_unprivileged_and_sees_the_ram_disk(built: list[Obj]) -> None:
    pod = _pod(built)
    replicator = container(pod, "replicator")
    sc = replicator["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "privileged" not in sc
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    e = env(replicator)
    plugin_env = env(container(pod, "csi-plugin"))
    assert Path(e["MTC_CHECKPOINT_DIR"]).parent == Path(plugin_env["MTC_RAM_DIR"])
    mounts = {m["mountPath"]: m for m in replicator["volumeMounts"]}
    (host_mount,) = [p for p in mounts if e["MTC_CHECKPOINT_DIR"].startswith(p + "/")]
    assert mounts[host_mount]["mountPropagation"] == "HostToContainer"
    plugin_mounts = {
        m["mountPath"]: m["name"] for m in container(pod, "csi-plugin")["volumeMounts"]
    }
    assert mounts[host_mount]["name"] == plugin_mounts[host_mount]  # the same host directory
    assert "limits" not in replicator["resources"]  # tmpfs pages it writes are charged to it
    assert replicator["command"] == ["mtc-replicator"]


def test_pods_get_checkpoint_dir_and_the_store_and_owner_file_lie_beside_it(
    built: list[Obj],
) -> None:
    """The plugin publishes ``<ram-dir>/<subdir>``; the daemon's CHECKPOINT_DIR is exactly
    that, its store a sibling on the same tmpfs, and the owner file the plugin's."""
    pod = _pod(built)
    plugin_env = env(container(pod, "csi-plugin"))
    plugin = csi_plugin.parse_args(
        [], env={**plugin_env, "MTC_CSI_NODE_ID": "node-a", "MTC_RAM_SIZE": "1Gi"}
    )
    ram_dir = Path(plugin_env["MTC_RAM_DIR"])
    checkpoint = CheckpointDir(plugin.ram_dir, plugin.checkpoint_subdir)
    assert (plugin.ram_dir, plugin.checkpoint_subdir) == (ram_dir, "checkpoint")
    e = env(container(pod, "replicator"))
    assert Path(e["MTC_CHECKPOINT_DIR"]) == checkpoint.path
    store = Path(e["MTC_STORE_DIR"])
    assert store.parent == ram_dir
    assert store != checkpoint.path
    assert Path(e["MTC_OWNER_FILE"]) == checkpoint.owner_path
    assert checkpoint.owner_path.parent == ram_dir


def test_the_plugin_serves_listed_namespaces_in_the_replicator_s_group(
    built: list[Obj],
) -> None:
    """What ``mtc-csi`` makes of its container's environment and the ConfigMap: an
    allow-list (never open by default), and the replicator's gid as the RAM disk's group."""
    pod = _pod(built)
    data = only(built, "ConfigMap")["data"]
    plugin_env = {**data, **env(container(pod, "csi-plugin")), "MTC_CSI_NODE_ID": "node-a"}
    plugin = csi_plugin.parse_args([], env=plugin_env)
    assert not plugin.policy.open
    assert plugin.policy.namespaces == {"default"}, "the example JobSet's namespace"
    replicator = container(pod, "replicator")["securityContext"]
    assert plugin.fs_group == replicator["runAsGroup"]


def test_replicator_probes_and_addresses_agree(built: list[Obj]) -> None:
    replicator = container(_pod(built), "replicator")
    e = env(replicator)
    port = int(e["MTC_LISTEN"].rsplit(":", 1)[1])
    assert e["MTC_ADVERTISE"] == f"$(POD_IP):{port}"
    assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert e["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    ports = {p["name"]: p["containerPort"] for p in replicator["ports"]}
    assert ports["grpc"] == port
    assert ports["data"] == int(e["MTC_DATA_PORT"]) != port
    assert ports["metrics"] == int(e["MTC_METRICS"].rsplit(":", 1)[1])
    # The probes ask the plaintext health-only port: the gRPC port wants a client certificate.
    health = int(e["MTC_HEALTH_LISTEN"].rsplit(":", 1)[1])
    assert ports["health"] == health not in (port, ports["data"], ports["metrics"])
    for probe in ("startupProbe", "livenessProbe"):
        assert replicator[probe]["grpc"] == {"port": health}, probe
    # Readiness asks the daemon's readiness checks (its /readyz), not only "started".
    assert replicator["readinessProbe"]["grpc"] == {"port": health, "service": READINESS_SERVICE}


def test_no_probe_targets_the_grpc_or_data_port(built: list[Obj]) -> None:
    probes = network_probe_ports(_pod(built))
    assert len(probes) == 5  # the replicator's three, the plugin's and the registrar's liveness
    assert not {
        k: v
        for k, v in probes.items()
        if v in (render_manifests.GRPC_PORT, render_manifests.DATA_PORT)
    }


# --- TLS -----------------------------------------------------------------------------------


CSI_DRIVER = "csi.cert-manager.io"
"""cert-manager's csi-driver: a certificate per pod (deploy/components/cert-manager-per-node)."""


def _tls_volume(pod: Obj) -> Obj:
    """The volume the replicator reads its TLS files from: the shared Secret, or
    csi-driver's volume in the per-node overlay (the same name and mount either way)."""
    replicator = container(pod, "replicator")
    tls_dir = os.path.dirname(env(replicator)["MTC_TLS_CERT"])
    (mount,) = [m for m in replicator["volumeMounts"] if m["mountPath"] == tls_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def _per_node(pod: Obj) -> bool:
    volume = _tls_volume(pod)
    if "csi" in volume:
        assert volume["csi"]["driver"] == CSI_DRIVER
        return True
    assert volume["secret"]["secretName"] == TLS_SECRET
    return False


def test_tls_is_on_and_points_into_the_secret(built: list[Obj]) -> None:
    pod = _pod(built)
    replicator = container(pod, "replicator")
    e = env(replicator)
    volume = _tls_volume(pod)
    (mount,) = [m for m in replicator["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert "subPath" not in mount  # a subPath mount never sees a rotated Secret
    # The keys of a kubernetes.io/tls Secret, as cert-manager, csi-driver and `mtc certs
    # secret` write them.
    assert e["MTC_TLS_CERT"] == f"{mount['mountPath']}/{certs.NODE_CERT}"
    assert e["MTC_TLS_KEY"] == f"{mount['mountPath']}/{certs.NODE_KEY}"
    assert e["MTC_TLS_CA"] == f"{mount['mountPath']}/{certs.CA_CERT}"
    # Every node certificate carries the daemon's default server name; nothing overrides it.
    assert "MTC_TLS_SERVER_NAME" not in e
    if _per_node(pod):
        # csi-driver's own names for the files are these three (no attribute renames them).
        attributes = volume["csi"]["volumeAttributes"]
        assert not {k for k in attributes if k.endswith("-file")}
        assert volume["csi"]["readOnly"] is True  # csi-driver serves read-only volumes only
    else:
        assert volume["secret"].get("optional", False) is False  # no Secret: wait, never plaintext


def test_the_tls_secret_reaches_the_replicator_only(built: list[Obj]) -> None:
    pod = _pod(built)
    tls_volume = _tls_volume(pod)["name"]
    mounted_by = sorted(
        c["name"]
        for c in all_containers(pod)
        for m in c.get("volumeMounts", [])
        if m["name"] == tls_volume
    )
    assert mounted_by == ["replicator"]
    # Nor does any container take it as environment.
    for c in all_containers(pod):
        refs = [r["secretRef"]["name"] for r in c.get("envFrom", []) if "secretRef" in r]
        refs += [
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        assert TLS_SECRET not in refs, c["name"]
    # The Secrets the pod holds: the TLS one, and the replicator's optional backup keys; with
    # per-node certificates, none (the key is made on the node, in csi-driver's volume).
    expected = set() if _per_node(pod) else {TLS_SECRET}
    assert set(secret_volumes(pod).values()) == expected


def test_the_tls_key_is_readable_by_the_replicator_and_not_by_others(built: list[Obj]) -> None:
    pod = _pod(built)
    volume = _tls_volume(pod)
    sc = container(pod, "replicator")["securityContext"]
    assert sc["runAsUser"] != 0
    if _per_node(pod):
        # csi-driver writes the files 0640 with this group: the replicator's, nobody else.
        group = volume["csi"]["volumeAttributes"]["csi.cert-manager.io/fs-group"]
        assert int(group) == sc["runAsGroup"] == pod["securityContext"]["fsGroup"]
        return
    mode = volume["secret"]["defaultMode"]
    assert mode & 0o007 == 0, oct(mode)  # nothing for other uids
    assert mode & 0o222 == 0, oct(mode)  # and read-only
    # Secret files are root's: a non-root replicator reads through the pod's fsGroup, which
    # kubelet gives the files, with the group bits of the mode.
    assert pod["securityContext"]["fsGroup"] == sc["runAsGroup"]
    assert mode & 0o040, oct(mode)


def test_the_daemon_reads_the_environment_as_meant(built: list[Obj]) -> None:
    pod = _pod(built)
    replicator = container(pod, "replicator")
    options = daemon_options(replicator)
    e = env(replicator)
    assert (options.tls_cert, options.tls_key, options.tls_ca) == (
        e["MTC_TLS_CERT"],
        e["MTC_TLS_KEY"],
        e["MTC_TLS_CA"],
    )
    assert options.tls_server_name == tls.DEFAULT_SERVER_NAME == certs.DEFAULT_SERVER_NAME
    # The one Secret every node mounts names no node: the daemon must be told, or it stops.
    # A certificate per node names it: the daemon refuses any that names none.
    assert options.tls_shared_certificate is not _per_node(pod)
    ports = {p["name"]: p["containerPort"] for p in replicator["ports"]}
    assert options.health_listen == f"0.0.0.0:{ports['health']}"
    assert options.listen == f"0.0.0.0:{ports['grpc']}"
    assert options.data_port == ports["data"]


# --- the NetworkPolicy ---------------------------------------------------------------------


def _expected_ingress(
    objs: list[Obj], metrics_namespace: str = "monitoring"
) -> set[tuple[str, int]]:
    selector = only(objs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    peers = "pods:" + ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    return {
        (peers, render_manifests.GRPC_PORT),
        (peers, render_manifests.DATA_PORT),
        (
            f"namespace:kubernetes.io/metadata.name={metrics_namespace}",
            render_manifests.METRICS_PORT,
        ),
        # The controller's pods only, in its namespace, for the configuration's status.
        (
            "namespace:kubernetes.io/metadata.name=mtc-system&pods:app.kubernetes.io/name=mtc-controller",
            render_manifests.METRICS_PORT,
        ),
        # And on gRPC: sticky ranks (Node/Status, Node/AssignRank).
        (
            "namespace:kubernetes.io/metadata.name=mtc-system&pods:app.kubernetes.io/name=mtc-controller",
            render_manifests.GRPC_PORT,
        ),
        ("*", render_manifests.HEALTH_PORT),
        ("*", render_manifests.PLUGIN_HEALTH_PORT),
        ("*", render_manifests.REGISTRAR_HEALTH_PORT),
    }


def test_network_policy_admits_exactly_peers_metrics_and_probes(built: list[Obj]) -> None:
    policy = only(built, "NetworkPolicy")
    ds = only(built, "DaemonSet")
    assert policy["metadata"]["namespace"] == ds["metadata"]["namespace"]
    # It selects the node stack's pods, isolates their ingress and leaves egress alone.
    assert policy["spec"]["podSelector"] == {"matchLabels": ds["spec"]["selector"]["matchLabels"]}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert "egress" not in policy["spec"]
    assert ingress_rules(policy) == _expected_ingress(built)


def test_network_policy_covers_every_port_and_probe(built: list[Obj]) -> None:
    pod = _pod(built)
    rules = ingress_rules(only(built, "NetworkPolicy"))
    declared = {p["containerPort"] for c in all_containers(pod) for p in c.get("ports", [])}
    assert {port for _, port in rules} == declared
    # kubelet's source address is not portable: every probe's port is open to any source.
    anywhere = {port for peer, port in rules if peer == "*"}
    assert set(network_probe_ports(pod).values()) == anywhere


# --- cert-manager --------------------------------------------------------------------------


def test_the_cert_manager_overlay_makes_the_mounted_secret() -> None:
    objs = kustomize(CERT_MANAGER_OVERLAY)
    check_cert_manager_chain(objs, TLS_SECRET)
    # The overlay is deploy/base plus the component, nothing else.
    base = {name_of(o) for o in kustomize(DEPLOY / "base")}
    component = {name_of(o) for o in kustomize(CERT_MANAGER_COMPONENT)}
    assert {name_of(o) for o in objs} == base | component
    assert {o["kind"] for o in kustomize(CERT_MANAGER_COMPONENT)} == {"Issuer", "Certificate"}


def _overlay(tmp_path: Path, text: str) -> Path:
    """A kustomization in a temporary directory; ``../../base``-style paths are made to reach
    the repository's deploy/ (kustomize refuses absolute ones)."""
    directory = tmp_path / "overlay"
    directory.mkdir()
    there = os.path.relpath(DEPLOY, directory)
    (directory / "kustomization.yaml").write_text(text.replace("../../", f"{there}/"))
    return directory


@pytest.mark.parametrize(("overlay", "scheme"), [("gke", "gs://"), ("s3", "s3://")])
def test_cert_manager_composes_with_the_other_overlays(
    tmp_path: Path, overlay: str, scheme: str
) -> None:
    # As docs/deploy.md says: an overlay that adds the component.
    kustomization = {
        "resources": [f"../../overlays/{overlay}"],
        "components": ["../../components/cert-manager"],
    }
    objs = kustomize(_overlay(tmp_path, yaml.safe_dump(kustomization)))
    check_cert_manager_chain(objs, TLS_SECRET)
    assert only(objs, "ConfigMap")["data"]["MTC_BACKUP"].startswith(scheme)


def _docs_metrics_patch() -> str:
    """The overlay docs/deploy.md shows for another metrics namespace."""
    text = (REPO / "docs" / "deploy.md").read_text()
    blocks: list[str] = [
        b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "NetworkPolicy" in b
    ]
    assert len(blocks) == 1, "docs/deploy.md shows one NetworkPolicy patch"
    return blocks[0]


def test_the_documented_patch_changes_the_metrics_namespace(tmp_path: Path) -> None:
    patch = _docs_metrics_patch()
    (namespace,) = re.findall(r"kubernetes\.io~1metadata\.name\n\s+value: (\S+)\n", patch)
    assert namespace != "monitoring"
    objs = kustomize(_overlay(tmp_path, patch))
    policy = only(objs, "NetworkPolicy")
    validate(policy)
    assert ingress_rules(policy) == _expected_ingress(objs, metrics_namespace=namespace)


def test_sidecars_are_pinned_and_find_the_plugin(built: list[Obj]) -> None:
    pod = _pod(built)
    registrar = container(pod, "node-driver-registrar")
    probe = container(pod, "liveness-probe")
    for sidecar in (registrar, probe):
        assert re.fullmatch(
            r"registry\.k8s\.io/sig-storage/[a-z-]+:v\d+\.\d+\.\d+", sidecar["image"]
        )
        assert "--csi-address=/csi/csi.sock" in sidecar["args"]
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    socket_dir = volumes["plugin-dir"]["hostPath"]["path"]
    assert socket_dir == f"/var/lib/kubelet/plugins/{render_manifests.DRIVER_NAME}"
    assert f"--kubelet-registration-path={socket_dir}/csi.sock" in registrar["args"]
    # kubelet's probe of the plugin goes to the livenessprobe sidecar's port.
    plugin = container(pod, "csi-plugin")
    health = {p["name"]: p["containerPort"] for p in plugin["ports"]}["healthz"]
    assert f"--http-endpoint=:{health}" in probe["args"]
    assert plugin["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


def test_scheduling_and_priority(built: list[Obj]) -> None:
    pod = _pod(built)
    priority = only(built, "PriorityClass")
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    assert priority["value"] >= 1_000_000
    # Placed before training pods but never evicting a running one (issue 28).
    assert priority["preemptionPolicy"] == "Never"
    # Only the pool the operator labels, not every Linux node (system nodes included).
    assert pod["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        render_config.POOL_LABEL: "true",
    }
    # GPU taints of GKE/EKS (nvidia.com/gpu) and AKS (sku=gpu), both effects.
    for key in ("nvidia.com/gpu", "sku"):
        for effect in ("NoSchedule", "NoExecute"):
            assert {"key": key, "operator": "Exists", "effect": effect} in pod["tolerations"]
    for c in [*pod["initContainers"], *pod["containers"]]:
        assert c["resources"]["requests"], c["name"]
    namespace = only(built, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_config_map_feeds_both_containers(built: list[Obj]) -> None:
    config_map = only(built, "ConfigMap")
    pod = _pod(built)
    for name in ("csi-plugin", "replicator"):
        refs = [
            r["configMapRef"]["name"]
            for r in container(pod, name)["envFrom"]
            if "configMapRef" in r
        ]
        assert refs == [config_map["metadata"]["name"]], name
    assert config_map["data"]["MTC_RAM_SIZE"]
    assert render_config.QUANTITY_RE.fullmatch(config_map["data"]["MTC_RAM_SIZE"])


@pytest.mark.parametrize(("overlay", "scheme"), [("gke", "gs://"), ("s3", "s3://")])
def test_overlays_set_a_backup(overlay: str, scheme: str) -> None:
    objs = kustomize(DEPLOY / "overlays" / overlay)
    data = only(objs, "ConfigMap")["data"]
    assert data["MTC_BACKUP"].startswith(scheme)
    assert render_config.OBJECT_URL_RE.fullmatch(data["MTC_BACKUP"])
    secret = [
        r["secretRef"] for r in container(_pod(objs), "replicator")["envFrom"] if "secretRef" in r
    ]
    # The s3 overlay needs its keys; with workload identity the Secret stays optional.
    assert secret == [{"name": "mtc-backup-credentials", "optional": overlay != "s3"}]


def test_base_has_no_backup() -> None:
    assert "MTC_BACKUP" not in only(kustomize(DEPLOY / "base"), "ConfigMap")["data"]


def _node_certificate() -> Obj:
    certificates = [o for o in kustomize(CERT_MANAGER_COMPONENT) if o["kind"] == "Certificate"]
    (node,) = [c for c in certificates if not c["spec"].get("isCA")]
    return node


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("secretName", None),
        ("dnsName", ["mtc-replicator"]),  # a typo: unknown field
        ("usages", ["server auth", "client authentication"]),
        ("privateKey", {"algorithm": "ECDSA", "size": 255}),
        ("privateKey", {"algorithm": "EC"}),
        ("privateKey", {"algorithm": "ECDSA", "rotationPolicy": "Sometimes"}),
        ("duration", "90d"),
        ("duration", "30m"),
        ("renewBefore", "2400h"),
        ("issuerRef", {"kind": "Issuer"}),
        ("isCA", "true"),
    ],
)
def test_the_cert_manager_check_catches_mistakes(field: str, value: object) -> None:
    certificate = _node_certificate()
    assert cert_manager_errors(certificate) == []
    if value is None:
        del certificate["spec"][field]
    else:
        certificate["spec"][field] = value
    assert cert_manager_errors(certificate)


@pytest.mark.parametrize(
    "spec", [{}, {"selfSigned": {}, "ca": {"secretName": "a"}}, {"ca": {}}, {"vault": {}}]
)
def test_the_cert_manager_check_catches_bad_issuers(spec: Obj) -> None:
    issuer = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Issuer",
        "metadata": {"name": "i", "namespace": "mtc-system"},
        "spec": spec,
    }
    assert cert_manager_errors(issuer)
    assert cert_manager_errors(issuer | {"spec": {"selfSigned": {}}}) == []


def _documented_uninstall() -> str:
    text = (REPO / "docs" / "deploy.md").read_text()
    return text.split("## 5. Uninstall", 1)[1].split("\n4. Only to remove everything", 1)[0]


def test_the_documented_uninstall_deletes_all_but_the_namespace_and_crd(built: list[Obj]) -> None:
    # Everything the kustomization makes goes, except the namespace (hand-made Secrets in it)
    # and the CRD (every CheckpointConfiguration): what docs/deploy.md promises to keep.
    steps = _documented_uninstall()
    namespaced: set[str] = set()
    for kinds in re.findall(r"-n mtc-system delete ([a-z,]+)", steps):
        namespaced |= set(kinds.split(","))
    assert "-l app.kubernetes.io/part-of=mtc" in steps
    named = set(re.findall(r"kubectl delete ([a-z]+) ([a-z0-9.-]+)", steps))
    for obj in built:
        kind, meta = obj["kind"], obj["metadata"]
        if kind in ("Namespace", "CustomResourceDefinition"):
            assert kind.lower() not in namespaced | {k for k, _ in named}
        elif "namespace" in meta:
            assert kind.lower() in namespaced, kind
            assert meta["labels"]["app.kubernetes.io/part-of"] == "mtc", name_of(obj)
        else:
            assert (kind.lower(), meta["name"]) in named, name_of(obj)
