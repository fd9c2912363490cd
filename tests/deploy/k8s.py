"""Offline Kubernetes checks for the deploy tests: kustomize builds and schema validation.

``kubectl kustomize`` builds (no API server needed); built-in kinds are validated with
``kubernetes-validate`` (strict: unknown fields fail) against Kubernetes 1.32, our custom
resources with ``jsonschema`` against our CRD's schema, made strict the same way.
cert-manager's kinds have no schema here (its CRDs are not ours to vendor): their shape is
checked by hand against the fields of cert-manager.io/v1 that the node stack uses.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from mtc_replicator.node.options import DaemonOptions, parse_args
from mtc_replicator.tools import render_config, render_manifests

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE_VERSIONS = sorted(
    {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()},
    key=lambda v: tuple(int(p) for p in v.split(".")),
)[-3:]
"""The three newest Kubernetes minor versions kubernetes-validate knows: every manifest must
validate against each (an install on a cluster a year old, and on the newest)."""
CRD_FILE = DEPLOY / "base" / "crd.yaml"

Obj = dict[str, Any]


def load_all(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


@functools.cache
def _kustomize(path: Path) -> str:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize builds cannot be checked")
    done = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def kustomize(path: Path) -> list[Obj]:
    """The objects ``kubectl kustomize PATH`` builds (a fresh copy per call)."""
    return load_all(_kustomize(path))


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@functools.cache
def crd() -> Obj:
    doc: Obj = yaml.safe_load(CRD_FILE.read_text())
    return doc


def strict(schema: Obj) -> Obj:
    """Reject unknown fields like the API server's strict field validation does (a CRD's
    structural schema may not say ``additionalProperties: false`` itself)."""
    out = copy.deepcopy(schema)

    def walk(node: Obj) -> None:
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for child in [*node.get("properties", {}).values(), *node.get("$defs", {}).values()]:
            walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(out)
    return out


@functools.cache
def _cr_validator() -> jsonschema.Draft7Validator:
    (version,) = crd()["spec"]["versions"]
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def cr_errors(obj: Obj) -> list[str]:
    """What our CRD's schema (strict) says is wrong with a CheckpointConfiguration."""
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in _cr_validator().iter_errors(obj)
    ]


# --- cert-manager, by hand ------------------------------------------------------------------

CERT_MANAGER_GROUP = "cert-manager.io"
_GO_DURATION = re.compile(r"([0-9]+(\.[0-9]+)?(h|m|s))+")
_DURATION_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
# The values cert-manager.io/v1 allows (its CRDs' enums) for the fields the node stack sets.
_USAGES = frozenset(
    {
        "signing",
        "digital signature",
        "content commitment",
        "key encipherment",
        "key agreement",
        "data encipherment",
        "cert sign",
        "crl sign",
        "server auth",
        "client auth",
    }
)
_KEY_SIZES = {"ECDSA": {256, 384, 521}, "RSA": {2048, 4096, 8192}}
_CERTIFICATE_FIELDS = {
    "secretName": str,
    "commonName": str,
    "dnsNames": list,
    "uris": list,  # cert-manager.io/v1 CertificateSpec.uris: URI SANs (the controller's SPIFFE ID)
    "duration": str,
    "renewBefore": str,
    "isCA": bool,
    "usages": list,
    "privateKey": dict,
    "issuerRef": dict,
}


def seconds(duration: str) -> float:
    """A Go duration (``time.ParseDuration``, the units cert-manager's examples use)."""
    assert _GO_DURATION.fullmatch(duration), f"{duration!r} is not a Go duration"
    return sum(
        float(n) * _DURATION_UNITS[u]
        for n, _, u in re.findall(r"([0-9]+(\.[0-9]+)?)(h|m|s)", duration)
    )


def cert_manager_errors(obj: Obj) -> list[str]:
    errors: list[str] = []
    meta = obj.get("metadata", {})
    if obj["apiVersion"] != f"{CERT_MANAGER_GROUP}/v1":
        errors.append(f"apiVersion {obj['apiVersion']} is not cert-manager.io/v1")
    if set(obj) != {"apiVersion", "kind", "metadata", "spec"}:
        errors.append(f"top-level fields {sorted(obj)}")
    if not meta.get("name") or not meta.get("namespace"):
        errors.append("metadata needs name and namespace (Issuers are namespaced)")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [*errors, "spec is not a mapping"]
    if obj["kind"] == "Issuer":
        kinds = set(spec)
        if kinds not in ({"selfSigned"}, {"ca"}):
            errors.append(f"spec must be one issuer type, selfSigned or ca: {sorted(kinds)}")
        elif "selfSigned" in spec and spec["selfSigned"] != {}:
            errors.append("spec.selfSigned takes no fields here")
        elif "ca" in spec and (set(spec["ca"]) != {"secretName"} or not spec["ca"]["secretName"]):
            errors.append(f"spec.ca needs secretName only: {spec['ca']}")
        return errors
    if obj["kind"] != "Certificate":
        return [*errors, f"kind {obj['kind']} is not checked here"]
    for key, value in spec.items():
        want = _CERTIFICATE_FIELDS.get(key)
        if want is None:
            errors.append(f"spec.{key}: unknown field")
        elif not isinstance(value, want):
            errors.append(f"spec.{key}: expected {want.__name__}")
    if errors:
        return errors
    for key in ("secretName", "issuerRef"):
        if key not in spec:
            errors.append(f"spec.{key}: required")
    ref = spec.get("issuerRef", {})
    if not ref.get("name") or not set(ref) <= {"name", "kind", "group"}:
        errors.append(f"spec.issuerRef: {ref}")
    if ref.get("group", CERT_MANAGER_GROUP) != CERT_MANAGER_GROUP:
        errors.append(f"spec.issuerRef.group: {ref.get('group')}")
    if ref.get("kind", "Issuer") not in ("Issuer", "ClusterIssuer"):
        errors.append(f"spec.issuerRef.kind: {ref.get('kind')}")
    if not spec.get("dnsNames") and not spec.get("commonName"):
        errors.append("spec: a certificate needs dnsNames or a commonName")
    for usage in spec.get("usages", []):
        if usage not in _USAGES:
            errors.append(f"spec.usages: {usage!r} is not a usage")
    key = spec.get("privateKey", {})
    if not set(key) <= {"algorithm", "size", "encoding", "rotationPolicy"}:
        errors.append(f"spec.privateKey: unknown fields in {sorted(key)}")
    if key.get("algorithm") not in (None, *_KEY_SIZES, "Ed25519"):
        errors.append(f"spec.privateKey.algorithm: {key.get('algorithm')!r}")
    elif "size" in key and key["size"] not in _KEY_SIZES.get(key.get("algorithm", "RSA"), ()):
        errors.append(f"spec.privateKey.size: {key['size']!r}")
    if key.get("encoding") not in (None, "PKCS1", "PKCS8"):
        errors.append(f"spec.privateKey.encoding: {key.get('encoding')!r}")
    if key.get("rotationPolicy") not in (None, "Never", "Always"):
        errors.append(f"spec.privateKey.rotationPolicy: {key.get('rotationPolicy')!r}")
    for field in ("duration", "renewBefore"):
        if field in spec and not _GO_DURATION.fullmatch(spec[field]):
            errors.append(f"spec.{field}: {spec[field]!r} is not a Go duration")
    if errors:
        return errors
    duration = seconds(spec.get("duration", "2160h"))  # cert-manager's default: 90 days
    if duration < 3600:
        errors.append("spec.duration: below cert-manager's minimum, 1h")
    if "renewBefore" in spec and not 300 <= seconds(spec["renewBefore"]) < duration:
        errors.append("spec.renewBefore: must be at least 5m and less than the duration")
    return errors


def _job_from_jobset(jobset: Obj) -> Iterator[Obj]:
    # No schema ships for JobSet (a CRD): its pod-bearing part is a batch/v1 JobTemplateSpec.
    for rj in jobset["spec"]["replicatedJobs"]:
        template = rj["template"]
        yield {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-{rj['name']}"}
            | template.get("metadata", {}),
            "spec": template["spec"],
        }


def validate(obj: Obj) -> None:
    """Fail the test with the object, field path and rule when ``obj`` is not valid."""
    if obj["apiVersion"].split("/")[0] == render_config.GROUP:
        errors = cr_errors(obj)
        assert not errors, f"{name_of(obj)}: {errors}"
        return
    if obj["apiVersion"].split("/")[0] == CERT_MANAGER_GROUP:
        errors = cert_manager_errors(obj)
        assert not errors, f"{name_of(obj)}: {errors}"
        return
    if obj["kind"] == "JobSet":
        assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(obj)
        for job in _job_from_jobset(obj):
            validate(job)
        return
    try:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name_of(obj)} is invalid for Kubernetes {version}: {path}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{name_of(obj)}: {exc.message}")


def only(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[name_of(o) for o in found]}"
    return found[0]


def container(pod_spec: Obj, name: str) -> Obj:
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name}")


def env(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def pod_of(objs: list[Obj]) -> Obj:
    """The DaemonSet's pod spec."""
    spec: Obj = only(objs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def all_containers(pod_spec: Obj) -> list[Obj]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def secret_volumes(pod_spec: Obj) -> dict[str, str]:
    """Volume name -> Secret name, for every Secret a volume (or projection) carries."""
    out = {}
    for v in pod_spec.get("volumes", []):
        if "secret" in v:
            out[v["name"]] = v["secret"]["secretName"]
        for source in v.get("projected", {}).get("sources", []):
            if "secret" in source:
                out[v["name"]] = source["secret"]["name"]
    return out


def port_number(pod_spec: Obj, container_: Obj, port: int | str) -> int:
    """A probe's port, named ports resolved the way kubelet does (in its own container)."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container_.get("ports", []) if p["name"] == port]
    return int(number)


def network_probe_ports(pod_spec: Obj) -> dict[str, int]:
    """``container/probe`` -> the port kubelet connects to, for every network probe."""
    out = {}
    for c in all_containers(pod_spec):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            for action in ("grpc", "httpGet", "tcpSocket"):
                if action in probe:
                    out[f"{c['name']}/{kind}"] = port_number(pod_spec, c, probe[action]["port"])
    return out


def ingress_rules(policy: Obj) -> set[tuple[str, int]]:
    """A NetworkPolicy's ingress as (peer, port) pairs; peer ``*`` is any source. Rules with
    anything this reduction cannot express (port ranges, named ports, UDP, ipBlocks,
    matchExpressions) fail the test."""
    out: set[tuple[str, int]] = set()
    for rule in policy["spec"].get("ingress", []):
        assert set(rule) <= {"from", "ports"}, rule
        peers = []
        for peer in rule.get("from") or [{}]:
            assert set(peer) <= {"namespaceSelector", "podSelector"}, f"unexpected peer {peer}"
            if not peer:
                peers.append("*")
                continue
            # Both selectors in one peer: those pods in those namespaces ("namespace:..&pods:..").
            parts = []
            for key, word in (("namespaceSelector", "namespace"), ("podSelector", "pods")):
                if key in peer:
                    assert set(peer[key]) == {"matchLabels"}, peer
                    labels = peer[key]["matchLabels"]
                    parts.append(
                        f"{word}:" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                    )
            peers.append("&".join(parts))
        assert "ports" in rule, f"a rule without ports admits every port: {rule}"
        for port in rule["ports"]:
            assert set(port) == {"protocol", "port"}, port
            assert port["protocol"] == "TCP", port
            assert isinstance(port["port"], int), port
            out |= {(peer, port["port"]) for peer in peers}
    return out


def daemon_options(replicator: Obj) -> DaemonOptions:
    """What ``mtc-replicator`` makes of the container's environment (kubelet's $(VAR)
    expansion and the downward API replaced by stand-ins)."""
    values: dict[str, str] = {}
    for item in replicator["env"]:
        value = item.get("value", "10.0.0.7")
        values[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], value)
    return parse_args([], values)


def tls_volume(pod_spec: Obj, secret: str) -> str:
    """The name of the one volume that carries ``secret``."""
    (name,) = [v for v, s in secret_volumes(pod_spec).items() if s == secret]
    return name


def _by_name(objs: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def check_cert_manager_chain(objs: list[Obj], secret: str) -> None:
    """The node certificate fills ``secret``, the Secret the DaemonSet mounts, signed by a CA
    Issuer whose CA was made by a self-signed Issuer, all in the node stack's namespace."""
    ds = only(objs, "DaemonSet")
    namespace = ds["metadata"]["namespace"]
    pod = pod_of(objs)
    issuers, certificates = _by_name(objs, "Issuer"), _by_name(objs, "Certificate")
    assert len(issuers) == len(certificates) == 2
    for obj in [*issuers.values(), *certificates.values()]:
        validate(obj)
        assert obj["metadata"]["namespace"] == namespace, name_of(obj)
    mounted = secret_volumes(pod)[tls_volume(pod, secret)]
    (node,) = [c for c in certificates.values() if c["spec"]["secretName"] == mounted]
    spec = node["spec"]
    assert spec["dnsNames"] == [render_manifests.TLS_SERVER_NAME]
    assert "isCA" not in spec
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["privateKey"]["algorithm"] == "ECDSA"
    assert spec["privateKey"]["size"] == 256
    assert spec["privateKey"]["encoding"] == "PKCS8"  # what `mtc certs` writes
    ca_issuer = issuers[spec["issuerRef"]["name"]]
    assert spec["issuerRef"]["kind"] == "Issuer"
    (ca,) = [
        c
        for c in certificates.values()
        if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]
    ]
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["privateKey"]["algorithm"] == "ECDSA"
    assert ca["spec"]["privateKey"]["size"] == 256
    # A renewed CA keeps its key, so nodes still on the old Secret and nodes on the new one
    # trust each other while kubelet updates them.
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    # The CA's key stays in its Secret: nothing in the pod mounts it.
    assert ca["spec"]["secretName"] not in secret_volumes(pod).values()


def cr(**spec: Any) -> Obj:
    """A minimal valid configuration with ``spec`` fields replaced (None deletes one)."""
    base: Obj = {
        "apiVersion": render_config.API_VERSION,
        "kind": render_config.KIND,
        "metadata": {"name": "default", "namespace": "mtc-system"},
        "spec": {"backupUrl": "gs://ckpt-bucket/mtc", "inMemoryVolumeSize": "50Gi"},
    }
    for key, value in spec.items():
        if value is None:
            base["spec"].pop(key, None)
        else:
            base["spec"][key] = value
    return base
