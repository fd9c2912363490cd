"""``tools.render_config``: errors that name the bad field, and agreement with the CRD's
schema (its patterns, its fields, the example configuration)."""

from __future__ import annotations

import pytest
import yaml

from mtc_replicator.core.pacing import MAX_YIELD_TO_SAVES
from mtc_replicator.tools import render_config
from tests.deploy.k8s import DEPLOY, Obj, cr, cr_errors, crd, validate

EXAMPLE = DEPLOY / "examples" / "checkpointconfiguration.yaml"


# --- bad input -----------------------------------------------------------------------------

# (mutation of a valid document, the field the error must name, whether the CRD's OpenAPI
# schema rejects it too; False: only a CEL rule of the CRD or render's stricter checks do.)
BAD: list[tuple[str, Obj, str, bool]] = [
    ("no backup", cr(backupUrl=None), "spec.backupUrl", False),
    ("two backups", cr(cloudStorageBucketName="b-k-t"), "spec.backupUrl", False),
    ("http backup", cr(backupUrl="https://example.com/x"), "spec.backupUrl", True),
    ("file backup", cr(backupUrl="file:///tmp/x"), "spec.backupUrl", True),
    ("upper-case bucket", cr(backupUrl="gs://My-Bucket"), "spec.backupUrl", True),
    (
        "short bucket",
        cr(backupUrl=None, cloudStorageBucketName="ab"),
        "spec.cloudStorageBucketName",
        True,
    ),
    ("bad registry", cr(registryUrl="gs://"), "spec.registryUrl", True),
    ("no size", cr(inMemoryVolumeSize=None), "spec.inMemoryVolumeSize", True),
    ("milli size", cr(inMemoryVolumeSize="500m"), "spec.inMemoryVolumeSize", True),
    ("number size", cr(inMemoryVolumeSize=1073741824), "spec.inMemoryVolumeSize", True),
    ("zero size", cr(inMemoryVolumeSize="0Gi"), "spec.inMemoryVolumeSize", False),
    ("negative size", cr(inMemoryVolumeSize="-1Gi"), "spec.inMemoryVolumeSize", True),
    ("selector list", cr(nodeSelector=["a"]), "spec.nodeSelector", True),
    ("selector int", cr(nodeSelector={"pool": 3}), "spec.nodeSelector.pool", True),
    ("selector value", cr(nodeSelector={"pool": "a b"}), "spec.nodeSelector.pool", True),
    ("tolerations map", cr(tolerations={"key": "a"}), "spec.tolerations", True),
    (
        "toleration op",
        cr(tolerations=[{"key": "a", "operator": "In"}]),
        "spec.tolerations[0].operator",
        True,
    ),
    (
        "toleration field",
        cr(tolerations=[{"key": "a", "typo": 1}]),
        "spec.tolerations[0].typo",
        True,
    ),
    (
        "toleration effect",
        cr(tolerations=[{"key": "a", "effect": "Never"}]),
        "spec.tolerations[0].effect",
        True,
    ),
    (
        "exists with value",
        cr(tolerations=[{"key": "a", "operator": "Exists", "value": "x"}]),
        "spec.tolerations[0].value",
        False,
    ),
    (
        "seconds without NoExecute",
        cr(tolerations=[{"key": "a", "tolerationSeconds": 5}]),
        "spec.tolerations[0].tolerationSeconds",
        False,
    ),
    (
        "empty key equal",
        cr(tolerations=[{"operator": "Equal"}]),
        "spec.tolerations[0].operator",
        False,
    ),
    ("empty image", cr(image=""), "spec.image", True),
    ("pull policy", cr(imagePullPolicy="Sometimes"), "spec.imagePullPolicy", True),
    ("negative uid", cr(runAsUser=-1), "spec.runAsUser", True),
    ("string uid", cr(runAsUser="65532"), "spec.runAsUser", True),
    ("bool gid", cr(runAsGroup=True), "spec.runAsGroup", True),
    ("log level", cr(logLevel="TRACE"), "spec.logLevel", True),
    ("s3 for gs", cr(s3={"region": "us-east-1"}), "spec.s3", False),
    (
        "s3 field",
        cr(backupUrl="s3://ckpt-bucket", s3={"endpoint": "http://x"}),
        "spec.s3.endpoint",
        True,
    ),
    (
        "s3 endpoint",
        cr(backupUrl="s3://ckpt-bucket", s3={"endpointUrl": "minio:9000"}),
        "spec.s3.endpointUrl",
        True,
    ),
    ("secret name", cr(credentialsSecretName="Keys"), "spec.credentialsSecretName", True),
    (
        "annotation value",
        cr(serviceAccountAnnotations={"a": 1}),
        "spec.serviceAccountAnnotations.a",
        True,
    ),
    ("tls list", cr(tls=[]), "spec.tls", True),
    ("tls field", cr(tls={"enable": False}), "spec.tls.enable", True),
    ("tls enabled string", cr(tls={"enabled": "false"}), "spec.tls.enabled", True),
    ("tls cert-manager int", cr(tls={"certManager": 1}), "spec.tls.certManager", True),
    ("tls secret name", cr(tls={"secretName": "TLS"}), "spec.tls.secretName", True),
    ("tls empty secret", cr(tls={"secretName": ""}), "spec.tls.secretName", True),
    (
        "cert-manager without tls",
        cr(tls={"enabled": False, "certManager": True}),
        "spec.tls.certManager",
        False,
    ),
    (
        "tls per-node string",
        cr(tls={"perNodeCertificates": "yes"}),
        "spec.tls.perNodeCertificates",
        True,
    ),
    (
        "per-node certificates without cert-manager",
        cr(tls={"perNodeCertificates": True}),
        "spec.tls.perNodeCertificates",
        False,
    ),
    ("metrics namespace", cr(metricsNamespace="Monitoring"), "spec.metricsNamespace", True),
    ("metrics namespace int", cr(metricsNamespace=3), "spec.metricsNamespace", True),
    ("rate word", cr(maxTransferRate="fast"), "spec.maxTransferRate", True),
    ("rate number", cr(maxTransferRate=400), "spec.maxTransferRate", True),
    ("rate unit", cr(maxTransferRate="400MIB"), "spec.maxTransferRate", False),
    ("rate zero", cr(maxTransferRate="0MiB"), "spec.maxTransferRate", False),
    ("yield too long", cr(yieldToSavesSeconds=60), "spec.yieldToSavesSeconds", True),
    ("yield string", cr(yieldToSavesSeconds="5"), "spec.yieldToSavesSeconds", True),
    ("drain too long", cr(drainSeconds=601), "spec.drainSeconds", True),
    ("drain negative", cr(drainSeconds=-1), "spec.drainSeconds", True),
    ("drain bool", cr(drainSeconds=True), "spec.drainSeconds", True),
    ("keep no steps", cr(keepSteps=0), "spec.keepSteps", True),
    ("keep steps string", cr(keepSteps="3"), "spec.keepSteps", True),
    ("keep steps float", cr(keepSteps=2.5), "spec.keepSteps", True),
    ("namespaces string", cr(allowedNamespaces="ml"), "spec.allowedNamespaces", True),
    ("namespace name", cr(allowedNamespaces=["ml", "ML"]), "spec.allowedNamespaces[1]", True),
    ("namespace int", cr(allowedNamespaces=[3]), "spec.allowedNamespaces[0]", True),
    (
        "too many namespaces",
        cr(allowedNamespaces=[f"ns-{i}" for i in range(render_config.MAX_ALLOWED + 1)]),
        "spec.allowedNamespaces",
        True,
    ),
    (
        "account without namespace",
        cr(allowedServiceAccounts=["trainer"]),
        "spec.allowedServiceAccounts[0]",
        True,
    ),
    (
        "account name",
        cr(allowedServiceAccounts=["ml/Trainer"]),
        "spec.allowedServiceAccounts[0]",
        True,
    ),
    ("unknown field", cr(bucket="x"), "spec.bucket", True),
    ("spec list", cr() | {"spec": []}, "spec", True),
    ("no name", cr() | {"metadata": {}}, "metadata.name", False),
    ("bad name", cr() | {"metadata": {"name": "Default"}}, "metadata.name", False),
    ("other group", cr() | {"apiVersion": "example.com/v1"}, "apiVersion", False),
    ("other kind", cr() | {"kind": "Checkpoint"}, "kind", False),
    ("top-level typo", cr() | {"specs": {}}, "specs", True),
]


@pytest.mark.parametrize(
    ("doc", "field", "in_schema"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_input_names_the_field(doc: Obj, field: str, in_schema: bool) -> None:
    with pytest.raises(render_config.RenderError) as caught:
        render_config.parse(doc)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    if in_schema:
        assert cr_errors(doc), "the CRD's schema accepts what render rejects"


def test_the_crd_schema_uses_render_s_patterns() -> None:
    (version,) = crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert (
        spec["allowedNamespaces"]["items"]["pattern"] == f"^{render_config.DNS_LABEL_RE.pattern}$"
    )
    assert (
        spec["allowedServiceAccounts"]["items"]["pattern"]
        == f"^{render_config.SERVICE_ACCOUNT_RE.pattern}$"
    )
    assert spec["allowedNamespaces"]["maxItems"] == render_config.MAX_ALLOWED
    assert spec["backupUrl"]["pattern"] == f"^{render_config.OBJECT_URL_RE.pattern}$"
    assert spec["registryUrl"]["pattern"] == f"^{render_config.OBJECT_URL_RE.pattern}$"
    assert spec["cloudStorageBucketName"]["pattern"] == f"^{render_config.BUCKET_RE.pattern}$"
    assert spec["inMemoryVolumeSize"]["pattern"] == f"^{render_config.QUANTITY_RE.pattern}$"
    assert (
        spec["s3"]["properties"]["endpointUrl"]["pattern"]
        == f"^{render_config.HTTP_URL_RE.pattern}$"
    )
    tls_spec = spec["tls"]["properties"]
    assert tls_spec["secretName"]["pattern"] == f"^{render_config.DNS_SUBDOMAIN_RE.pattern}$"
    assert set(tls_spec) == {"enabled", "secretName", "certManager", "perNodeCertificates"}
    booleans = ("enabled", "certManager", "perNodeCertificates")
    assert {tls_spec[f]["type"] for f in booleans} == {"boolean"}
    assert spec["metricsNamespace"]["pattern"] == f"^{render_config.DNS_LABEL_RE.pattern}$"
    assert spec["maxTransferRate"]["pattern"] == f"^({render_config.RATE_RE.pattern})$"
    assert spec["yieldToSavesSeconds"]["maximum"] == MAX_YIELD_TO_SAVES
    assert spec["drainSeconds"]["maximum"] == render_config.MAX_DRAIN_SECONDS
    fields = set(spec)
    assert fields == set(render_config.SPEC_FIELDS) | set(render_config.IGNORED_GKE_FIELDS)


def test_the_crd_accepts_every_tls_setting() -> None:
    for tls in (
        {},
        {"enabled": False},
        {"certManager": True, "secretName": "a.b-c"},
        {"certManager": True, "perNodeCertificates": True},
    ):
        assert not cr_errors(cr(tls=tls, metricsNamespace="prom")), tls


def test_example_configuration_is_valid_for_the_crd() -> None:
    validate(yaml.safe_load(EXAMPLE.read_text()))
