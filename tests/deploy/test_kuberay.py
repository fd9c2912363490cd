"""The KubeRay examples: valid ray.io/v1 objects, wired to the RAM disk as ``mtc render
--ray-worker-group`` says, and that render itself.

The RayJob and RayCluster are checked against deploy/schemas/kuberay-ray.io-v1.yaml (our
reproduction of the fields of KubeRay's CRDs that they use), made strict like our own CRD,
and their pod templates with kubernetes-validate.
"""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from mtc_replicator.tools import cli, render, render_config, render_workload
from mtc_replicator.tools.render_config import RenderError
from mtc_replicator.tools.render_workload import JOB_LABEL, ray_worker_group
from tests.deploy.k8s import DEPLOY, Obj, container, cr, cr_errors, env, strict, validate

EXAMPLES = DEPLOY / "examples"
RAYJOB = EXAMPLES / "rayjob.yaml"
RAYCLUSTER = EXAMPLES / "raycluster.yaml"
RAY_CONFIG = EXAMPLES / "checkpointconfiguration-ray.yaml"
SCHEMA = DEPLOY / "schemas" / "kuberay-ray.io-v1.yaml"
API_VERSION = "ray.io/v1"


@functools.cache
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    doc = yaml.safe_load(SCHEMA.read_text())
    schema = strict({"$ref": f"#/$defs/{kind}", "$defs": doc["$defs"]})
    return jsonschema.Draft202012Validator(schema)


def _cluster_spec(obj: Obj) -> Obj:
    spec: Obj = obj["spec"]["rayClusterSpec"] if obj["kind"] == "RayJob" else obj["spec"]
    return spec


def kuberay_errors(obj: Obj) -> list[str]:
    """What the reproduced schema (strict) says is wrong with a RayJob or RayCluster."""
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") not in ("RayJob", "RayCluster"):
        return [f"not a {API_VERSION} RayJob or RayCluster: {obj.get('apiVersion')}"]
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in _validator(obj["kind"]).iter_errors(obj)
    ]


def validate_kuberay(obj: Obj) -> None:
    """Fail the test when the object or one of its pod templates is invalid."""
    errors = kuberay_errors(obj)
    assert not errors, f"{obj['kind']}/{obj['metadata']['name']}: {errors}"
    spec = _cluster_spec(obj)
    groups = [("head", spec["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        # The CRDs embed core/v1 PodTemplateSpec: check it as a PodTemplate.
        validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"{obj['metadata']['name']}-{name}"},
                "template": group["template"],
            }
        )


def _load(path: Path) -> Obj:
    obj: Obj = yaml.safe_load(path.read_text())
    return obj


def _workers(obj: Obj) -> Obj:
    (group,) = _cluster_spec(obj)["workerGroupSpecs"]
    return dict(group)


def _contains(big: Any, small: Any) -> bool:
    """``small`` is part of ``big``: mappings by key, lists item by item (each item of
    ``small`` part of some item of ``big``), anything else equal."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(
            k in big and _contains(big[k], v) for k, v in small.items()
        )
    if isinstance(small, list):
        return isinstance(big, list) and all(any(_contains(b, s) for b in big) for s in small)
    return bool(big == small)


EXAMPLE_FILES = pytest.mark.parametrize("path", [RAYJOB, RAYCLUSTER], ids=lambda p: p.stem)


@EXAMPLE_FILES
def test_examples_are_valid_kuberay_objects(path: Path) -> None:
    obj = _load(path)
    assert obj["apiVersion"] == API_VERSION
    validate_kuberay(obj)


def test_the_two_examples_describe_the_same_cluster() -> None:
    rayjob, raycluster = _load(RAYJOB), _load(RAYCLUSTER)
    assert rayjob["spec"]["rayClusterSpec"] == raycluster["spec"]
    assert rayjob["metadata"]["name"] == raycluster["metadata"]["name"]
    entry = rayjob["spec"]["entrypoint"].split()
    assert entry[1] == "/home/ray/mtc/examples/ray_train_job.py"
    assert entry[entry.index("--workers") + 1] == str(_workers(rayjob)["replicas"])
    assert entry[entry.index("--name") + 1] == rayjob["metadata"]["name"]


@EXAMPLE_FILES
def test_workers_wait_for_the_save_in_flight_before_sigterm(path: Path) -> None:
    """The preStop hook runs our client's wait, within the pod's grace period (Ray needs a
    few seconds of it after the hook)."""
    pod = _workers(_load(path))["template"]["spec"]
    command = container(pod, "ray-worker")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["python", "-m", "mtc_replicator.client.wait_saves"]
    timeout = float(command[command.index("--timeout") + 1])
    assert timeout + 5 <= pod.get("terminationGracePeriodSeconds", 30)
    from mtc_replicator.client import wait_saves

    with pytest.raises(SystemExit) as info:  # the module takes the hook's options
        wait_saves.main([*command[3:], "--help"])
    assert info.value.code == 0


def test_the_entrypoint_script_runs() -> None:
    """The script a RayJob starts exists and parses its options (no Ray cluster here)."""
    script = DEPLOY.parent / "examples" / "ray_train_job.py"
    done = subprocess.run(
        [sys.executable, str(script), "--help"],
        check=False,
        capture_output=True,
        timeout=60,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "--workers" in done.stdout


def _misspell_workers(obj: Obj) -> None:
    _cluster_spec(obj)["workerGroupSpec"] = _cluster_spec(obj).pop("workerGroupSpecs")


def _drop_min_replicas(obj: Obj) -> None:
    del _cluster_spec(obj)["workerGroupSpecs"][0]["minReplicas"]


def _unquote_num_cpus(obj: Obj) -> None:
    _cluster_spec(obj)["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0


def _drop_head_template(obj: Obj) -> None:
    del _cluster_spec(obj)["headGroupSpec"]["template"]


def _old_api(obj: Obj) -> None:
    obj["apiVersion"] = "ray.io/v1alpha1"


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (_misspell_workers, "'workerGroupSpec' was unexpected"),
        (_drop_min_replicas, "'minReplicas' is a required property"),
        (_unquote_num_cpus, "0 is not of type 'string'"),
        (_drop_head_template, "'template' is a required property"),
        (_old_api, "not a ray.io/v1 RayJob"),
    ],
    ids=["misspelled", "missing-required", "unquoted-param", "no-head-template", "v1alpha1"],
)
def test_schema_rejects_a_broken_rayjob(break_it: Callable[[Obj], None], message: str) -> None:
    obj = copy.deepcopy(_load(RAYJOB))
    break_it(obj)
    errors = kuberay_errors(obj)
    assert any(message in e for e in errors), errors


def test_pod_templates_are_checked_too() -> None:
    obj = copy.deepcopy(_load(RAYCLUSTER))
    worker = _workers(obj)["template"]["spec"]["containers"][0]
    worker["volumeMount"] = worker.pop("volumeMounts")
    assert kuberay_errors(obj) == []  # the pod spec is not in the reproduced schema
    with pytest.raises(pytest.fail.Exception, match="volumeMount"):
        validate_kuberay(obj)


@EXAMPLE_FILES
def test_worker_group_holds_what_mtc_render_prints(path: Path) -> None:
    obj = _load(path)
    config = render_config.parse(_load(RAY_CONFIG))
    workers = _workers(obj)
    job = workers["template"]["metadata"]["labels"][JOB_LABEL]
    assert job == obj["metadata"]["name"]
    snippet = ray_worker_group(config, job)
    assert _contains(workers, snippet), yaml.safe_dump(snippet)
    # Everything the snippet sets at pod level is set to exactly its value.
    pod, wanted = workers["template"]["spec"], snippet["template"]["spec"]
    for key in ("securityContext", "affinity", "nodeSelector", "tolerations", "volumes"):
        assert pod[key] == wanted[key], key
    # The Ray container is the first one (KubeRay's rule).
    assert pod["containers"][0]["name"] == render_workload.RAY_CONTAINER
    # rayproject/ray's user and group, which the configuration matches.
    assert (config.run_as_user, config.run_as_group) == (1000, 100)


@EXAMPLE_FILES
def test_workers_are_a_fixed_group_sized_for_the_object_store_and_checkpoints(
    path: Path,
) -> None:
    spec = _cluster_spec(_load(path))
    workers = _workers(_load(path))
    # Ray Train's layout must not change between restarts: no autoscaling, no range.
    assert spec["enableInTreeAutoscaling"] is False
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"]
    ray = container(workers["template"]["spec"], render_workload.RAY_CONTAINER)
    limit = _bytes(ray["resources"]["limits"]["memory"])
    assert _bytes(ray["resources"]["requests"]["memory"]) == limit
    # The object store (in /dev/shm, this container's memory) is fixed and leaves most of
    # the limit to training and the checkpoint steps on the RAM disk.
    store = int(workers["rayStartParams"]["object-store-memory"])
    assert 0 < store <= limit // 4
    assert env(ray)[render_workload.CHECKPOINT_ENV] == render_workload.MOUNT_PATH


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(quantity[:-2]) * units[quantity[-2:]]


@EXAMPLE_FILES
def test_head_group_runs_no_training_and_mounts_nothing(path: Path) -> None:
    head = _cluster_spec(_load(path))["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    pod = head["template"]["spec"]
    assert "volumes" not in pod
    assert JOB_LABEL not in head["template"].get("metadata", {}).get("labels", {})


# --- render_workload and the CLI ----------------------------------------------------------


def test_ray_configuration_is_valid_and_renders() -> None:
    cc = _load(RAY_CONFIG)
    assert cr_errors(cc) == []
    for obj in render.render(cc):
        validate(obj)


def test_worker_group_follows_the_configuration() -> None:
    config = render_config.parse(
        cr(nodeSelector={"pool": "a100"}, runAsUser=0, runAsGroup=4242, tolerations=[])
    )
    pod = ray_worker_group(config, "job-1")["template"]["spec"]
    assert pod["securityContext"] == {"runAsUser": 0, "runAsGroup": 4242, "fsGroup": 4242}
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux", "pool": "a100"}
    assert pod["tolerations"] == []
    default = ray_worker_group(render_config.parse(cr()), "job-1")["template"]["spec"]
    assert default["securityContext"]["runAsUser"] == render_config.WORKLOAD_UID
    assert default["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        render_config.POOL_LABEL: "true",
    }
    assert default["tolerations"] == [dict(t) for t in render_config.DEFAULT_TOLERATIONS]


@pytest.mark.parametrize("name", ["", "Job", "a_b", "x" * 64, "-a"])
def test_worker_group_refuses_a_bad_job_name(name: str) -> None:
    with pytest.raises(RenderError, match="--ray-worker-group"):
        ray_worker_group(render_config.parse(cr()), name)


def test_rendered_worker_group_is_a_valid_pod_template() -> None:
    group = ray_worker_group(render_config.parse(_load(RAY_CONFIG)), "llm-train")
    group["template"]["spec"]["containers"][0]["image"] = "rayproject/ray:2.60.0"
    validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, **group})


def test_cli_prints_the_worker_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", str(RAY_CONFIG), "--ray-worker-group", "llm-train"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("# ")
    assert yaml.safe_load(out) == ray_worker_group(
        render_config.parse(_load(RAY_CONFIG)), "llm-train"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ray-worker-group", "Bad_Name"], "'Bad_Name' is not a job name"),
        (["--ray-worker-group", "x", "-o", "out"], "prints to stdout"),
    ],
)
def test_cli_refuses(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["render", str(RAY_CONFIG.resolve()), *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err
    assert not (tmp_path / "out").exists()
