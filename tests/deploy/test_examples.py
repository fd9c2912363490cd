"""The example workloads (JobSet, PyTorchJob, StatefulSet) are valid and mount our volume the
way the contract needs. The PyTorchJob's own fields are checked against
deploy/schemas/kubeflow-pytorchjob-v1.yaml (strict, like test_kuberay.py's KubeRay schema), its
pod templates and the StatefulSet with kubernetes-validate."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml

from mtc_replicator.controller import jobpods
from mtc_replicator.tools import render_config
from tests.deploy.k8s import (
    DEPLOY,
    Obj,
    all_containers,
    container,
    env,
    secret_volumes,
    strict,
    validate,
)

JOBSET = DEPLOY / "examples" / "jobset.yaml"
PYTORCHJOB = DEPLOY / "examples" / "pytorchjob.yaml"
STATEFULSET = DEPLOY / "examples" / "statefulset.yaml"
PYTORCHJOB_SCHEMA = DEPLOY / "schemas" / "kubeflow-pytorchjob-v1.yaml"


def _pod_spec() -> Obj:
    jobset = yaml.safe_load(JOBSET.read_text())
    (rj,) = jobset["spec"]["replicatedJobs"]
    spec: Obj = rj["template"]["spec"]["template"]["spec"]
    return spec


def test_jobset_is_valid() -> None:
    jobset = yaml.safe_load(JOBSET.read_text())
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    validate(jobset)  # its Job templates, against batch/v1


def test_jobset_mounts_the_ram_disk_as_an_inline_csi_volume() -> None:
    pod = _pod_spec()
    (volume,) = pod["volumes"]
    driver = yaml.safe_load((DEPLOY / "base" / "csidriver.yaml").read_text())["metadata"]["name"]
    assert volume["csi"] == {"driver": driver}
    trainer = container(pod, "trainer")
    (mount,) = trainer["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": env(trainer)["MTC_CHECKPOINT_DIR"]}


def test_jobset_gives_the_client_what_replicator_yaml_needs() -> None:
    jobset = yaml.safe_load(JOBSET.read_text())
    (rj,) = jobset["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    e = env(container(_pod_spec(), "trainer"))
    # nodes = slices x nodes per slice; one pod per node, ranks from the indexes.
    assert job["completionMode"] == "Indexed"
    assert int(e["NUM_SLICES"]) == rj["replicas"]
    assert int(e["NODES_PER_SLICE"]) == job["parallelism"] == job["completions"]
    assert int(e["NNODES"]) == rj["replicas"] * job["parallelism"]
    assert e["MTC_JOB_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"}
    }
    command = " ".join(container(_pod_spec(), "trainer")["command"])
    # The rank as the node stack assigns it; the pod's index in the whole job if none comes.
    assert "--index $((SLICE_INDEX * NODES_PER_SLICE + JOB_COMPLETION_INDEX))" in command
    # The replicator moves what the trainer writes: same uid as the default configuration.
    assert _pod_spec()["securityContext"]["runAsUser"] == render_config.WORKLOAD_UID


def test_jobset_places_one_training_pod_per_node() -> None:
    # Two ranks on one node would share its RAM disk and its replicator (one rank each).
    jobset = yaml.safe_load(JOBSET.read_text())
    (term,) = _pod_spec()["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    # Every pod of the JobSet, all slices: JobSet labels each pod with its JobSet's name.
    assert term["labelSelector"] == {
        "matchLabels": {"jobset.sigs.k8s.io/jobset-name": jobset["metadata"]["name"]}
    }
    # Exclusive topology by hostname would put a whole slice (several pods) on one node.
    annotations = jobset["metadata"].get("annotations", {})
    assert (
        annotations.get("alpha.jobset.sigs.k8s.io/exclusive-topology") != "kubernetes.io/hostname"
    )


def _strings(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (str(k), *_strings(v))]
    if isinstance(node, list):
        return [s for item in node for s in _strings(item)]
    return [node] if isinstance(node, str) else []


def test_jobset_gets_no_tls_material() -> None:
    # The node certificate's key is the cluster's trust: only the replicator container mounts
    # it (tests/deploy/test_manifests.py). A training pod gets CHECKPOINT_DIR and nothing else.
    jobset = yaml.safe_load(JOBSET.read_text())
    pod = _pod_spec()
    assert secret_volumes(pod) == {}
    assert render_config.DEFAULT_TLS_SECRET not in _strings(jobset)
    assert not [s for s in _strings(jobset) if s.startswith("MTC_TLS_")]
    for c in all_containers(pod):
        assert not [r for r in c.get("envFrom", []) if "secretRef" in r], c["name"]
        assert not [e for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]


def test_jobset_runs_on_the_pool_and_uses_the_gpus_whose_taint_it_tolerates() -> None:
    pod = _pod_spec()
    assert pod["nodeSelector"] == dict(render_config.DEFAULT_NODE_SELECTOR)
    tolerated = {t["key"] for t in pod["tolerations"]}
    trainer = container(pod, "trainer")
    if "nvidia.com/gpu" in tolerated:
        assert int(trainer["resources"]["limits"]["nvidia.com/gpu"]) >= 1


# --- PyTorchJob and StatefulSet ------------------------------------------------------------


def _pytorchjob_errors(obj: Obj) -> list[str]:
    doc = yaml.safe_load(PYTORCHJOB_SCHEMA.read_text())
    schema = strict({"$ref": "#/$defs/PyTorchJob", "$defs": doc["$defs"]})
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in jsonschema.Draft202012Validator(schema).iter_errors(obj)
    ]


def _pod_specs() -> dict[str, Obj]:
    """The pod spec of each example workload, by kind (the PyTorchJob's Worker and Master
    share one template)."""
    pytorchjob = yaml.safe_load(PYTORCHJOB.read_text())
    (statefulset,) = [
        o for o in yaml.safe_load_all(STATEFULSET.read_text()) if o["kind"] == "StatefulSet"
    ]
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    return {
        "JobSet": _pod_spec(),
        "PyTorchJob": replicas["Master"]["template"]["spec"],
        "StatefulSet": statefulset["spec"]["template"]["spec"],
    }


def test_pytorchjob_is_valid() -> None:
    job = yaml.safe_load(PYTORCHJOB.read_text())
    assert _pytorchjob_errors(job) == []
    for kind, replica in job["spec"]["pytorchReplicaSpecs"].items():
        validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{job['metadata']['name']}-{kind.lower()}"},
                "template": replica["template"],
            }
        )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "pytorchReplicaSpecs", "Chief"), {"template": {}}),
        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes"),
        (("spec", "runPolicy", "cleanPodPolicy"), "Some"),
        (("spec", "replicaSpecs"), {}),
    ],
)
def test_the_pytorchjob_schema_rejects_mistakes(path: tuple[str, ...], value: object) -> None:
    job = copy.deepcopy(yaml.safe_load(PYTORCHJOB.read_text()))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert _pytorchjob_errors(job)


def test_statefulset_is_valid() -> None:
    docs = list(yaml.safe_load_all(STATEFULSET.read_text()))
    assert sorted(o["kind"] for o in docs) == ["Service", "StatefulSet"]
    for obj in docs:
        validate(obj)
    service, statefulset = sorted(docs, key=lambda o: o["kind"])
    assert service["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]


@pytest.mark.parametrize("kind", ["JobSet", "PyTorchJob", "StatefulSet"])
def test_every_example_mounts_the_ram_disk_on_the_pool_one_pod_per_node(kind: str) -> None:
    pod = _pod_specs()[kind]
    driver = yaml.safe_load((DEPLOY / "base" / "csidriver.yaml").read_text())["metadata"]["name"]
    (volume,) = pod["volumes"]
    assert volume["csi"] == {"driver": driver}
    (trainer,) = pod["containers"]
    (mount,) = trainer["volumeMounts"]
    assert mount == {"name": volume["name"], "mountPath": env(trainer)["MTC_CHECKPOINT_DIR"]}
    assert pod["securityContext"]["runAsUser"] == render_config.WORKLOAD_UID
    assert pod["nodeSelector"] == dict(render_config.DEFAULT_NODE_SELECTOR)
    # Tolerating the GPU taint means using the GPUs.
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu"}
    assert int(trainer["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert "MTC_JOB_NAME" in env(trainer)
    assert not secret_volumes(pod)


def test_pytorchjob_and_statefulset_count_their_nodes() -> None:
    job = yaml.safe_load(PYTORCHJOB.read_text())
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1
    e = env(_pod_specs()["PyTorchJob"]["containers"][0])
    assert int(e["NNODES"]) == replicas["Master"]["replicas"] + replicas["Worker"]["replicas"]
    assert e["MTC_JOB_NAME"] == {
        "fieldRef": {"fieldPath": "metadata.labels['training.kubeflow.org/job-name']"}
    }
    (statefulset,) = [
        o for o in yaml.safe_load_all(STATEFULSET.read_text()) if o["kind"] == "StatefulSet"
    ]
    e = env(_pod_specs()["StatefulSet"]["containers"][0])
    assert int(e["NNODES"]) == statefulset["spec"]["replicas"]
    assert e["POD_INDEX"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }


def _templates() -> dict[str, tuple[Obj, Obj]]:
    """Each example's pod template (metadata, spec) and the workload object."""
    jobset = yaml.safe_load(JOBSET.read_text())
    pt = yaml.safe_load(PYTORCHJOB.read_text())
    (ss,) = [o for o in yaml.safe_load_all(STATEFULSET.read_text()) if o["kind"] == "StatefulSet"]
    return {
        "JobSet": (jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"], jobset),
        "PyTorchJob": (pt["spec"]["pytorchReplicaSpecs"]["Worker"]["template"], pt),
        "StatefulSet": (ss["spec"]["template"], ss),
    }


def _as_created(kind: str, template: Obj, workload: Obj) -> Obj:
    """One pod as the workload's controller makes it: index 1's labels and annotations."""
    meta = template.get("metadata") or {}
    labels, annotations = dict(meta.get("labels") or {}), dict(meta.get("annotations") or {})
    name = workload["metadata"]["name"]
    owners: list[Obj] = []
    if kind == "JobSet":
        labels["jobset.sigs.k8s.io/jobset-name"] = name
        annotations.update(
            {
                "jobset.sigs.k8s.io/job-index": "0",
                "jobset.sigs.k8s.io/replicatedjob-replicas": str(
                    workload["spec"]["replicatedJobs"][0]["replicas"]
                ),
                "batch.kubernetes.io/job-completion-index": "1",
            }
        )
    elif kind == "PyTorchJob":
        labels.update(
            {
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/replica-type": "worker",
                "training.kubeflow.org/replica-index": "0",
            }
        )
    else:
        labels["apps.kubernetes.io/pod-index"] = "1"
        owners = [{"kind": "StatefulSet", "name": name}]
    return {
        "metadata": {
            "name": f"{name}-1",
            "namespace": "ml",
            "uid": "u1",
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": owners,
        },
        "spec": {**template["spec"], "nodeName": "n1"},
        "status": {"phase": "Running", "podIP": "10.0.0.2"},
    }


@pytest.mark.parametrize("kind", ["JobSet", "PyTorchJob", "StatefulSet"])
def test_every_example_takes_its_rank_from_the_node_stack(kind: str) -> None:
    """Sticky ranks: the pod opts in with the job's node count, the controller reads its
    job and index from what the workload's controller sets, and the container asks
    ``mtc_replicator.client.rank`` for its rank (its own index the fallback)."""
    template, workload = _templates()[kind]
    trainer = template["spec"]["containers"][0]
    e = env(trainer)
    member = jobpods.job_pod(_as_created(kind, template, workload))
    assert member is not None
    assert member.nodes == int(e["NNODES"])
    # JobSet: slice 0, index 1; PyTorchJob: worker 0 (the master is 0) resolved by the
    # group; StatefulSet: ordinal 1.
    assert member.index == (0 if kind == "PyTorchJob" else 1)
    assert member.mtc_job == workload["metadata"]["name"]
    command = " ".join(trainer["command"])
    assert 'eval "$(python -m mtc_replicator.client.rank' in command
    assert "--index" in command
    assert e["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    port = template["metadata"]["annotations"][jobpods.PORT_ANNOTATION]
    assert port == str(e.get("MASTER_PORT", "23456"))
