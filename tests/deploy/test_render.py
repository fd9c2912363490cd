"""``mtc render``: field mapping, agreement with deploy/base (and deploy/overlays/cert-manager),
who may mount, and the CLI wrapper (bad input and the CRD's schema: test_render_config)."""

from __future__ import annotations

import copy
import io
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtc_replicator.csi import plugin as csi_plugin
from mtc_replicator.tools import cli, render, render_config, render_manifests
from tests.deploy.k8s import (
    DEPLOY,
    Obj,
    all_containers,
    check_cert_manager_chain,
    container,
    cr,
    cr_errors,
    env,
    ingress_rules,
    kustomize,
    load_all,
    name_of,
    network_probe_ports,
    only,
    secret_volumes,
    tls_volume,
    validate,
)

EXAMPLE = DEPLOY / "examples" / "checkpointconfiguration.yaml"


def _pod(objs: list[Obj]) -> Obj:
    spec: Obj = only(objs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


# --- mapping -------------------------------------------------------------------------------


def test_example_renders_valid_manifests() -> None:
    objs = render.render(yaml.safe_load(EXAMPLE.read_text()))
    assert [o["kind"] for o in objs] == [
        "Namespace",
        "PriorityClass",
        "CSIDriver",
        "ServiceAccount",
        "ConfigMap",
        "NetworkPolicy",
        "DaemonSet",
    ]
    for obj in objs:
        validate(obj)


def test_defaults() -> None:
    config = render_config.parse(cr())
    assert config.namespace == "mtc-system"
    objs = render_manifests.manifests(config)
    assert only(objs, "ConfigMap")["data"] == {
        "MTC_LOG_LEVEL": "INFO",
        "MTC_RAM_SIZE": "50Gi",
        "MTC_BACKUP": "gs://ckpt-bucket/mtc",
    }
    pod = _pod(objs)
    assert pod["tolerations"] == [dict(t) for t in render_config.DEFAULT_TOLERATIONS]
    # The labelled accelerator pool, not every Linux node; its GPU taints, both effects.
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", render_config.POOL_LABEL: "true"}
    for key in ("nvidia.com/gpu", "sku"):
        for effect in ("NoSchedule", "NoExecute"):
            assert {"key": key, "operator": "Exists", "effect": effect} in pod["tolerations"]
    # An explicit empty selector opts out of the pool label.
    assert _pod(render_manifests.manifests(render_config.parse(cr(nodeSelector={}))))[
        "nodeSelector"
    ] == {"kubernetes.io/os": "linux"}
    # Scheduled before training pods, never preempting a running one.
    assert only(objs, "PriorityClass")["preemptionPolicy"] == "Never"
    # The default drain (20 s) and 10 s to stop: Kubernetes' default grace period.
    assert pod["terminationGracePeriodSeconds"] == 30
    replicator = container(pod, "replicator")
    assert (
        replicator["image"] == container(pod, "csi-plugin")["image"] == render_config.DEFAULT_IMAGE
    )
    assert replicator["securityContext"]["runAsUser"] == render_config.WORKLOAD_UID
    assert replicator["securityContext"]["runAsNonRoot"] is True
    assert {"secretRef": {"name": "mtc-backup-credentials", "optional": True}} in replicator[
        "envFrom"
    ]
    assert "annotations" not in only(objs, "ServiceAccount")["metadata"]
    # TLS is on, with the default Secret; no cert-manager objects unless asked for.
    assert (config.tls, config.tls_secret, config.cert_manager) == (
        True,
        render_config.DEFAULT_TLS_SECRET,
        False,
    )
    assert secret_volumes(pod) == {"tls": "mtc-replicator-tls"}
    assert {"MTC_TLS_CERT", "MTC_TLS_KEY", "MTC_TLS_CA"} <= set(env(replicator))
    assert not [o for o in objs if o["kind"] in ("Issuer", "Certificate")]
    assert config.metrics_namespace == "monitoring"


# --- TLS and the NetworkPolicy -------------------------------------------------------------

TLS_ENV = {"MTC_TLS_CERT", "MTC_TLS_KEY", "MTC_TLS_CA"}


def test_tls_secret_is_mounted_by_the_replicator_only() -> None:
    objs = render.render(cr(tls={"secretName": "node-certs"}))
    pod = _pod(objs)
    volume = tls_volume(pod, "node-certs")
    mounted_by = [
        c["name"]
        for c in all_containers(pod)
        for m in c.get("volumeMounts", [])
        if m["name"] == volume
    ]
    assert mounted_by == ["replicator"]
    replicator = container(pod, "replicator")
    (mount,) = [m for m in replicator["volumeMounts"] if m["name"] == volume]
    assert mount["readOnly"] is True
    e = env(replicator)
    for name in TLS_ENV:
        assert e[name].startswith(mount["mountPath"] + "/"), name
    for c in all_containers(pod):
        if c["name"] != "replicator":
            assert not TLS_ENV & set(env(c)), c["name"]
    for obj in objs:
        validate(obj)


def test_tls_key_is_readable_by_a_root_replicator_too() -> None:
    objs = render.render(cr(runAsUser=0, runAsGroup=0))
    pod = _pod(objs)
    assert pod["securityContext"]["fsGroup"] == 0
    (volume,) = [v for v in pod["volumes"] if v["name"] == tls_volume(pod, "mtc-replicator-tls")]
    assert volume["secret"]["defaultMode"] & 0o007 == 0
    for obj in objs:
        validate(obj)


def test_tls_disabled_renders_no_tls_and_no_mount() -> None:
    objs = render.render(cr(tls={"enabled": False}))
    pod = _pod(objs)
    replicator = container(pod, "replicator")
    assert not TLS_ENV & set(env(replicator))
    assert secret_volumes(pod) == {}
    assert "fsGroup" not in pod["securityContext"]
    assert {m["name"] for m in replicator["volumeMounts"]} == {"mtc-dir", "tmp"}
    # The same ports, probes and NetworkPolicy as with TLS: only the Secret is gone.
    with_tls = render.render(cr())
    assert network_probe_ports(pod) == network_probe_ports(_pod(with_tls))
    assert only(objs, "NetworkPolicy") == only(with_tls, "NetworkPolicy")
    for obj in objs:
        validate(obj)


def test_cert_manager_objects_make_the_mounted_secret() -> None:
    objs = render.render(cr(tls={"certManager": True, "secretName": "node-certs"}))
    check_cert_manager_chain(objs, "node-certs")
    assert only(objs, "DaemonSet") == only(
        render.render(cr(tls={"secretName": "node-certs"})), "DaemonSet"
    )


def test_per_node_certificates_come_from_csi_driver_in_the_replicator_s_group() -> None:
    objs = render.render(
        cr(tls={"certManager": True, "perNodeCertificates": True}, runAsUser=0, runAsGroup=0)
    )
    pod = _pod(objs)
    assert secret_volumes(pod) == {}
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    attributes = volume["csi"]["volumeAttributes"]
    assert attributes["csi.cert-manager.io/uri-sans"] == "spiffe://mtc-replicator/node/${POD_NAME}"
    assert attributes["csi.cert-manager.io/fs-group"] == "0"  # follows runAsGroup
    e = env(container(pod, "replicator"))
    assert "MTC_TLS_SHARED_CERTIFICATE" not in e
    assert e["MTC_TLS_NODE_NAME_PATTERN"] == render_manifests.NODE_POD_PATTERN
    certificates = [o["metadata"]["name"] for o in objs if o["kind"] == "Certificate"]
    assert certificates == ["mtc-ca"]  # the CA only: no shared certificate


def test_network_policy_follows_the_configuration() -> None:
    objs = render.render(
        cr(metricsNamespace="prometheus") | {"metadata": {"name": "h100", "namespace": "ml"}}
    )
    policy = only(objs, "NetworkPolicy")
    validate(policy)
    selector = "app.kubernetes.io/instance=h100,app.kubernetes.io/name=mtc-node"
    assert policy["metadata"]["namespace"] == "ml"
    assert policy["spec"]["podSelector"]["matchLabels"] == _pod_labels(objs)
    assert ingress_rules(policy) == {
        (f"pods:{selector}", 7070),
        (f"pods:{selector}", 7071),
        ("namespace:kubernetes.io/metadata.name=prometheus", 9464),
        (
            "namespace:kubernetes.io/metadata.name=mtc-system&pods:app.kubernetes.io/name=mtc-controller",
            9464,
        ),
        (
            "namespace:kubernetes.io/metadata.name=mtc-system&pods:app.kubernetes.io/name=mtc-controller",
            7070,
        ),
        ("*", 7072),
        ("*", 9808),
        ("*", 9809),
    }


def _pod_labels(objs: list[Obj]) -> dict[str, str]:
    labels: dict[str, str] = only(objs, "DaemonSet")["spec"]["selector"]["matchLabels"]
    return labels


def test_every_field_maps() -> None:
    objs = render.render(
        cr(
            backupUrl="s3://ckpt-bucket/prefix/a",
            registryUrl="s3://registry-bucket",
            inMemoryVolumeSize="1.5Ti",
            nodeSelector={"pool": "a100"},
            tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml"}],
            image="registry.example.com/mtc:1",
            imagePullPolicy="Always",
            runAsUser=0,
            runAsGroup=0,
            logLevel="DEBUG",
            s3={"endpointUrl": "https://minio.example.com:9000", "region": "eu-west-1"},
            credentialsSecretName="minio-keys",
            serviceAccountAnnotations={"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"},
            maxTransferRate="2Gbit",
            yieldToSavesSeconds=2.5,
            drainSeconds=45.5,
            keepSteps=3,
        )
    )
    for obj in objs:
        validate(obj)
    assert only(objs, "ConfigMap")["data"] == {
        "MTC_MAX_TRANSFER_RATE": "2Gbit",
        "MTC_YIELD_TO_SAVES_SECONDS": "2.5",
        "MTC_DRAIN_SECONDS": "45.5",
        "MTC_KEEP_STEPS": "3",
        "MTC_LOG_LEVEL": "DEBUG",
        "MTC_RAM_SIZE": "1.5Ti",
        "MTC_BACKUP": "s3://ckpt-bucket/prefix/a",
        "MTC_REGISTRY": "s3://registry-bucket",
        "AWS_ENDPOINT_URL_S3": "https://minio.example.com:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }
    pod = _pod(objs)
    assert pod["terminationGracePeriodSeconds"] == 56  # the drain, then 10 s to stop
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "a100"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml"}]
    for name in ("csi-plugin", "replicator"):
        c = container(pod, name)
        assert (c["image"], c["imagePullPolicy"]) == ("registry.example.com/mtc:1", "Always")
    for name in ("node-driver-registrar", "liveness-probe"):
        assert container(pod, name)["image"].startswith("registry.k8s.io/sig-storage/")
    sc = container(pod, "replicator")["securityContext"]
    # Root for root workloads, but still nothing more than a root-owned file's owner.
    assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (0, 0, False)
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert {"secretRef": {"name": "minio-keys", "optional": False}} in container(pod, "replicator")[
        "envFrom"
    ]
    assert only(objs, "ServiceAccount")["metadata"]["annotations"] == {
        "eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"
    }


def test_a_gke_configuration_renders_unchanged() -> None:
    gke = {
        "apiVersion": render_config.GKE_API_VERSION,
        "kind": "CheckpointConfiguration",
        "metadata": {"name": "tpu-pool"},
        "spec": {
            "cloudStorageBucketName": "my-bucket",
            "nodeSelector": {"node.kubernetes.io/instance-type": "ct5p-hightpu-4t"},
            "tolerations": [
                {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "inMemoryVolumeSize": "100Gi",
            "gcsFuseMountOptions": ["implicit-dirs", "metadata-cache:ttl-secs:-1"],
            "enableExternalJaxProcessIds": True,
        },
    }
    config = render_config.parse(gke)
    assert config.backup_url == "gs://my-bucket"
    assert config.ignored == ("enableExternalJaxProcessIds", "gcsFuseMountOptions")
    objs = render_manifests.manifests(config)
    assert only(objs, "DaemonSet")["metadata"]["name"] == "mtc-node-tpu-pool"
    assert only(objs, "DaemonSet")["metadata"]["namespace"] == render_config.DEFAULT_NAMESPACE
    for obj in objs:
        validate(obj)
    # Our CRD accepts the same document under our group.
    assert not cr_errors(gke | {"apiVersion": render_config.API_VERSION})


def test_names_and_selector_follow_the_configuration() -> None:
    objs = render.render(cr() | {"metadata": {"name": "h100", "namespace": "ml-infra"}})
    ds = only(objs, "DaemonSet")
    assert ds["metadata"] == {
        "name": "mtc-node-h100",
        "namespace": "ml-infra",
        "labels": ds["spec"]["template"]["metadata"]["labels"],
    }
    assert ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "h100"
    assert _pod(objs)["serviceAccountName"] == "mtc-node-h100"
    assert only(objs, "Namespace")["metadata"]["name"] == "ml-infra"
    cluster_kinds = {"Namespace", "PriorityClass", "CSIDriver"}
    assert {o["metadata"]["namespace"] for o in objs if o["kind"] not in cluster_kinds} == {
        "ml-infra"
    }


@pytest.mark.parametrize("namespace", ["default", "kube-system"])
def test_a_namespace_we_do_not_own_is_not_relabelled(namespace: str) -> None:
    objs = render.render(cr() | {"metadata": {"name": "a", "namespace": namespace}})
    assert "Namespace" not in {o["kind"] for o in objs}
    assert only(objs, "DaemonSet")["metadata"]["namespace"] == namespace


def test_a_changed_configuration_rolls_the_daemonset() -> None:
    def config_map_ref(objs: list[Obj]) -> str:
        refs = container(_pod(objs), "replicator")["envFrom"]
        name: str = refs[0]["configMapRef"]["name"]
        assert name == only(objs, "ConfigMap")["metadata"]["name"]
        return name

    one = config_map_ref(render.render(cr()))
    assert one == config_map_ref(render.render(cr()))  # deterministic
    assert one != config_map_ref(render.render(cr(inMemoryVolumeSize="60Gi")))


def test_render_is_pure() -> None:
    doc = cr(tolerations=[{"key": "a", "operator": "Exists"}], nodeSelector={"a": "b"})
    before = copy.deepcopy(doc)
    first = render.render(doc)
    first[-1]["spec"]["template"]["spec"]["tolerations"].append({"key": "mutated"})
    assert doc == before
    assert render.render(doc) != first


# --- who may mount -------------------------------------------------------------------------


def test_who_may_mount_and_the_ram_disk_group_are_rendered() -> None:
    """The allow-lists reach the plugin through the ConfigMap; the RAM disk's group is the
    replicator's gid, which the plugin gets in its own environment."""
    objs = render.render(
        cr(
            allowedNamespaces=["research", "ml-team", "research"],
            allowedServiceAccounts=["shared/trainer"],
            runAsGroup=1234,
        )
    )
    data = only(objs, "ConfigMap")["data"]
    assert data["MTC_CSI_ALLOWED_NAMESPACES"] == "ml-team,research"
    assert data["MTC_CSI_ALLOWED_SERVICE_ACCOUNTS"] == "shared/trainer"
    pod = _pod(objs)
    plugin_env = {**data, **env(container(pod, "csi-plugin")), "MTC_CSI_NODE_ID": "node-a"}
    plugin = csi_plugin.parse_args([], env=plugin_env)
    assert plugin.policy.namespaces == {"ml-team", "research"}
    assert plugin.policy.service_accounts == {("shared", "trainer")}
    assert plugin.fs_group == 1234 == container(pod, "replicator")["securityContext"]["runAsGroup"]
    assert not cr_errors(cr(allowedNamespaces=["a"], allowedServiceAccounts=["a/b.c"]))


def test_an_open_configuration_renders_with_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = only(render.render(cr()), "ConfigMap")["data"]
    assert "MTC_CSI_ALLOWED_NAMESPACES" not in data
    path = tmp_path / "open.yaml"
    path.write_text(yaml.safe_dump(cr()))
    assert cli.main(["render", str(path)]) == 0
    assert "pods of every namespace may mount" in capsys.readouterr().err


# --- render == deploy/base -----------------------------------------------------------------


def _without_config_map_hash(objs: list[Obj]) -> dict[str, Obj]:
    """Objects by kind/name, with the ConfigMap's content-hash suffix dropped everywhere."""
    text = yaml.safe_dump_all(objs)
    text = re.sub(r"(mtc-node-[a-z0-9-]+-config)-[a-z0-9]{10}\b", r"\1", text)
    return {name_of(o): o for o in load_all(text)}


@pytest.mark.parametrize(
    ("kustomization", "tls"),
    [
        ("base", {}),
        ("overlays/cert-manager", {"certManager": True}),
        ("overlays/cert-manager-per-node", {"certManager": True, "perNodeCertificates": True}),
    ],
)
def test_render_produces_what_deploy_holds(kustomization: str, tls: Obj) -> None:
    _check_render_matches(DEPLOY / kustomization, tls=tls)


def test_root_training_component_is_run_as_user_0(tmp_path: Path) -> None:
    """deploy/components/root-training (for NGC-style root images) is ``runAsUser: 0``."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    there = os.path.relpath(DEPLOY, overlay)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {"resources": [f"{there}/base"], "components": [f"{there}/components/root-training"]}
        )
    )
    objs = _check_render_matches(overlay, runAsUser=0)
    replicator = container(_pod(list(objs.values())), "replicator")["securityContext"]
    assert (replicator["runAsUser"], replicator["runAsNonRoot"]) == (0, False)
    assert replicator["capabilities"] == {"drop": ["ALL"]}
    assert replicator["readOnlyRootFilesystem"] is True
    assert replicator["allowPrivilegeEscalation"] is False
    for obj in objs.values():
        validate(obj)


def _check_render_matches(path: Path, **spec: Any) -> dict[str, Obj]:
    """``mtc render`` of a configuration with ``spec`` gives the objects kustomize builds
    at ``path`` (but the CRD, and the backup deploy/base lacks); those objects by name."""
    base = _without_config_map_hash(
        [o for o in kustomize(path) if o["kind"] != "CustomResourceDefinition"]
    )
    config_map = base["ConfigMap/mtc-node-default-config"]
    rendered = _without_config_map_hash(
        render.render(
            cr(
                inMemoryVolumeSize=config_map["data"]["MTC_RAM_SIZE"],
                allowedNamespaces=config_map["data"]["MTC_CSI_ALLOWED_NAMESPACES"].split(","),
                **spec,
            )
        )
    )
    # deploy/base has no backup location; everything else must be the same objects.
    config_map["data"]["MTC_BACKUP"] = "gs://ckpt-bucket/mtc"
    assert sorted(base) == sorted(rendered)
    for name, obj in rendered.items():
        assert base[name] == obj, name
    return base


# --- the CLI -------------------------------------------------------------------------------


def test_cli_writes_multi_document_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", str(EXAMPLE)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    objs = load_all(out)
    assert objs == render.render(yaml.safe_load(EXAMPLE.read_text()))
    for obj in objs:
        validate(obj)


def test_cli_writes_a_kustomization_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert cli.main(["render", str(EXAMPLE), "-o", str(out)]) == 0
    written = sorted(p.name for p in out.iterdir())
    assert "kustomization.yaml" in written
    assert len(written) == 8
    built = kustomize(out)
    assert _without_config_map_hash(built) == _without_config_map_hash(
        render.render(yaml.safe_load(EXAMPLE.read_text()))
    )
    assert str(out / "kustomization.yaml") in capsys.readouterr().err


def test_cli_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(cr(gcsFuseMountOptions=["x"]))))
    assert cli.main(["render", "-"]) == 0
    out, err = capsys.readouterr()
    assert only(load_all(out), "DaemonSet")
    assert "spec.gcsFuseMountOptions has no effect" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (yaml.safe_dump(cr(inMemoryVolumeSize="lots")), "spec.inMemoryVolumeSize: 'lots' is not"),
        ("a: [", "(document): not valid YAML"),
        (yaml.safe_dump_all([cr(), cr()]), "(document): expected one YAML document, found 2"),
        ("", "(document): expected one YAML document, found 0"),
        ("- a\n- b\n", "(document): expected a mapping"),
    ],
)
def test_cli_rejects_bad_configurations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    out = tmp_path / "out"
    assert cli.main(["render", str(config), "-o", str(out)]) == 2
    _, err = capsys.readouterr()
    assert f"mtc render: {config}: {message}" in err
    assert not out.exists()


def test_cli_reports_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_cli_reports_an_unwritable_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["render", str(EXAMPLE), "-o", str(blocker / "out")]) == 1
    assert "cannot write" in capsys.readouterr().err
