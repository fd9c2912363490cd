"""Per-node certificates in deploy/ (issue 25, item 2): the overlay that has cert-manager's
csi-driver issue every replicator pod its own certificate, naming it, and that no longer
passes ``--tls-shared-certificate``; and a certificate shaped exactly as that volume asks
for one passes the daemon's start-up identity check under the flags the overlay sets.

csi-driver expands ``${POD_NAME}``, ``${POD_NAMESPACE}``, ``${POD_UID}`` and
``${SERVICE_ACCOUNT_NAME}`` in its attributes and nothing else (kubelet gives a CSI driver no
node name), so the name a certificate carries is the DaemonSet pod's, one per node, and the
daemon's ``--tls-node-name-pattern`` admits DaemonSet pod names (docs/deploy.md).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from mtc_replicator.core.identity import node_uri
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.startup import open_tls
from mtc_replicator.tools import certs, render_manifests
from mtc_replicator.transport.tls import TlsError
from tests.deploy.k8s import (
    DEPLOY,
    REPO,
    Obj,
    container,
    daemon_options,
    env,
    kustomize,
    name_of,
    only,
    pod_of,
    seconds,
    secret_volumes,
)
from tests.tls import cert_manager_ca, csi_driver_certificate

OVERLAY = DEPLOY / "overlays" / "cert-manager-per-node"
CSI_DRIVER = "csi.cert-manager.io"
ATTR = "csi.cert-manager.io/"
# The attributes csi-driver reads (pkg/apis/v1alpha1 of cert-manager/csi-driver), and the
# variables it expands in them: a typo or an unknown ${VAR} would fail at mount time.
KNOWN_ATTRIBUTES = {
    ATTR + a
    for a in (
        "issuer-name",
        "issuer-kind",
        "issuer-group",
        "literal-subject",
        "common-name",
        "organizations",
        "organizationalunits",
        "countries",
        "provinces",
        "localities",
        "streetaddresses",
        "postalcodes",
        "serialnumber",
        "dns-names",
        "ip-sans",
        "uri-sans",
        "duration",
        "is-ca",
        "key-usages",
        "key-algorithm",
        "key-encoding",
        "key-size",
        "ca-file",
        "certificate-file",
        "privatekey-file",
        "fs-group",
        "renew-before",
        "reuse-private-key",
        "pkcs12-enable",
        "pkcs12-filename",
        "pkcs12-password",
    )
}
CSI_DRIVER_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}
SHARED = "mtc-replicator-tls"


def _tls_volume(pod: Obj) -> Obj:
    replicator = container(pod, "replicator")
    (mount,) = [m for m in replicator["volumeMounts"] if m["mountPath"] == "/etc/mtc/tls"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def _pod_name(objs: list[Obj], suffix: str = "x7k2p") -> str:
    """A name the DaemonSet controller gives a pod (generateName ``<daemonset>-``)."""
    return f"{only(objs, 'DaemonSet')['metadata']['name']}-{suffix}"


def test_the_overlay_mounts_a_csi_driver_certificate_that_names_the_pod() -> None:
    objs = kustomize(OVERLAY)
    pod = pod_of(objs)
    volume = _tls_volume(pod)
    assert set(volume) == {"name", "csi"}, "csi-driver's volume, not the shared Secret"
    csi = volume["csi"]
    assert csi["driver"] == CSI_DRIVER
    assert csi["readOnly"] is True
    attrs: dict[str, str] = csi["volumeAttributes"]
    assert set(attrs) <= KNOWN_ATTRIBUTES, set(attrs) - KNOWN_ATTRIBUTES
    for value in attrs.values():
        assert set(re.findall(r"\$\{(\w+)\}", value)) <= CSI_DRIVER_VARIABLES, value
    # Names: the shared DNS name clients check, and the node's URI with the pod's name in it.
    assert attrs[ATTR + "dns-names"] == render_manifests.TLS_SERVER_NAME
    assert attrs[ATTR + "uri-sans"] == node_uri("${POD_NAME}")
    usages = {u.strip() for u in attrs[ATTR + "key-usages"].split(",")}
    assert usages == {"digital signature", "server auth", "client auth"}
    assert attrs[ATTR + "key-algorithm"] == "ECDSA"  # so no key encipherment (RSA's)
    assert attrs[ATTR + "key-size"] == "256"
    assert attrs[ATTR + "key-encoding"] == "PKCS8"
    duration, renew = seconds(attrs[ATTR + "duration"]), seconds(attrs[ATTR + "renew-before"])
    assert duration >= 3600
    assert 300 <= renew < duration
    assert ATTR + "is-ca" not in attrs
    # Issued by the CA Issuer the cert-manager component makes, in the pod's namespace
    # (a namespaced Issuer serves only CertificateRequests of its own namespace).
    assert attrs[ATTR + "issuer-kind"] == "Issuer"
    assert attrs[ATTR + "issuer-group"] == "cert-manager.io"
    issuers = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Issuer"}
    issuer = issuers[attrs[ATTR + "issuer-name"]]
    assert issuer["metadata"]["namespace"] == only(objs, "DaemonSet")["metadata"]["namespace"]
    (ca,) = [o for o in objs if o["kind"] == "Certificate"]
    assert ca["spec"]["isCA"] is True
    assert issuer["spec"] == {"ca": {"secretName": ca["spec"]["secretName"]}}
    # No shared certificate is made, and the pod mounts no Secret at all.
    assert SHARED not in {o["metadata"]["name"] for o in objs if o["kind"] == "Certificate"}
    assert secret_volumes(pod) == {}


def test_the_overlay_names_the_node_and_does_not_pass_the_shared_flag() -> None:
    objs = kustomize(OVERLAY)
    replicator = container(pod_of(objs), "replicator")
    e = env(replicator)
    assert "MTC_TLS_SHARED_CERTIFICATE" not in e
    options = daemon_options(replicator)
    assert options.tls_shared_certificate is False
    assert options.tls_node_name_pattern == e["MTC_TLS_NODE_NAME_PATTERN"]
    pattern = options.tls_node_name_pattern
    # Every name csi-driver can put there for this DaemonSet's pods, and nothing else.
    assert re.fullmatch(pattern, _pod_name(objs))
    assert re.fullmatch(pattern, "mtc-node-gpu-pool-2-b9q4z")
    for other in (
        "mtc-node-default",  # the DaemonSet, not a pod
        "gke-pool-1-abcd",  # a Kubernetes node's name (`mtc certs node`)
        "trainer-0",  # a training pod of the same namespace
        "mtc-node-default-x7k2p.evil",
        "",
    ):
        assert not re.fullmatch(pattern, other), other


def test_the_overlay_is_the_base_with_the_ca_and_nothing_shared() -> None:
    base = {name_of(o) for o in kustomize(DEPLOY / "base")}
    objs = {name_of(o) for o in kustomize(OVERLAY)}
    assert objs - base == {"Issuer/mtc-selfsigned", "Issuer/mtc-ca", "Certificate/mtc-ca"}
    assert base <= objs


@pytest.mark.parametrize(("overlay", "scheme"), [("gke", "gs://"), ("s3", "s3://")])
def test_per_node_certificates_compose_with_the_other_overlays(
    tmp_path: Path, overlay: str, scheme: str
) -> None:
    directory = tmp_path / "overlay"
    directory.mkdir()
    kustomization = {
        "resources": [f"../../overlays/{overlay}"],
        "components": ["../../components/cert-manager", "../../components/cert-manager-per-node"],
    }
    text = yaml.safe_dump(kustomization).replace("../../", f"{_relative(directory)}/")
    (directory / "kustomization.yaml").write_text(text)
    objs = kustomize(directory)
    assert "csi" in _tls_volume(pod_of(objs))
    assert only(objs, "ConfigMap")["data"]["MTC_BACKUP"].startswith(scheme)


def _relative(directory: Path) -> str:
    """deploy/ from ``directory`` (kustomize refuses absolute paths)."""
    return os.path.relpath(DEPLOY, directory)


def _documented_migration_step() -> str:
    """The overlay docs/deploy.md shows for the middle step of the move to per-node
    certificates: csi-driver's certificates while the daemons still take the shared one."""
    text = (REPO / "docs" / "deploy.md").read_text()
    blocks = [
        b
        for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
        if "cert-manager-per-node" in b and "MTC_TLS_SHARED_CERTIFICATE" in b
    ]
    assert len(blocks) == 1, "docs/deploy.md shows the migration step's overlay once"
    return blocks[0]


def test_the_documented_migration_step_builds(tmp_path: Path) -> None:
    directory = tmp_path / "migrating"
    directory.mkdir()
    text = _documented_migration_step().replace("../../", f"{_relative(directory)}/")
    (directory / "kustomization.yaml").write_text(text)
    objs = kustomize(directory)
    pod = pod_of(objs)
    assert "csi" in _tls_volume(pod)
    replicator = container(pod, "replicator")
    options = daemon_options(replicator)
    # Per-node certificates, and the shared one still admitted from nodes not rolled yet.
    assert options.tls_shared_certificate is True
    assert re.fullmatch(options.tls_node_name_pattern, _pod_name(objs))
    # The shared Secret still exists while old pods mount it.
    assert SHARED in {o["metadata"]["name"] for o in objs if o["kind"] == "Certificate"}


# --- the daemon's start-up identity check, on a certificate shaped as csi-driver's ---------


def _write(root: Path, ca: certs.Pair, pair: certs.Pair) -> None:
    certs.write_node_files(root, ca, pair)


def _options_of_the_overlay(root: Path) -> DaemonOptions:
    """The daemon's options from the overlay's replicator environment, its TLS files moved
    from /etc/mtc/tls to ``root``."""
    replicator = container(pod_of(kustomize(OVERLAY)), "replicator")
    for item in replicator["env"]:
        if item["name"] in ("MTC_TLS_CERT", "MTC_TLS_KEY", "MTC_TLS_CA"):
            item["value"] = item["value"].replace("/etc/mtc/tls", str(root))
    return daemon_options(replicator)


@pytest.mark.parametrize("rsa_key", [False, True], ids=["ecdsa-p256", "rsa-2048"])
def test_a_csi_driver_certificate_passes_the_daemons_start_up_check(
    tmp_path: Path, rsa_key: bool
) -> None:
    ca = cert_manager_ca()
    objs = kustomize(OVERLAY)
    pod = _pod_name(objs)
    attrs = _tls_volume(pod_of(objs))["csi"]["volumeAttributes"]
    uri = attrs[ATTR + "uri-sans"].replace("${POD_NAME}", pod)
    _write(tmp_path, ca, csi_driver_certificate(ca, uri, rsa_key=rsa_key))
    options = _options_of_the_overlay(tmp_path)
    tls, node = open_tls(options)
    assert tls is not None
    assert node == pod


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        (node_uri("gke-pool-1-abcd"), "does not match --tls-node-name-pattern"),
        ("spiffe://cluster.local/ns/mtc-system/sa/mtc-node-default", "names no node"),
    ],
    ids=["a node name from mtc certs node", "another spiffe identity"],
)
def test_a_certificate_the_overlay_would_not_request_is_refused_at_start(
    tmp_path: Path, uri: str, why: str
) -> None:
    ca = cert_manager_ca()
    _write(tmp_path, ca, csi_driver_certificate(ca, uri))
    with pytest.raises(TlsError, match=why):
        open_tls(_options_of_the_overlay(tmp_path))


def test_the_shared_certificate_is_refused_at_start_under_the_overlay(tmp_path: Path) -> None:
    ca = cert_manager_ca()
    _write(tmp_path, ca, certs.issue(ca))  # the shared DNS name, no node: the old Secret
    with pytest.raises(TlsError, match="names no node"):
        open_tls(_options_of_the_overlay(tmp_path))
