"""Offline Kubernetes checks for the deploy tests: kustomize builds and schema validation.

``kubectl kustomize`` builds (no API server needed); built-in kinds are validated with
``kubernetes-validate`` (strict: unknown fields fail) against Kubernetes 1.32, our custom
resources with ``jsonschema`` against our CRD's schema, made strict the same way.
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from replicator.tools import render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBE_VERSION = "1.32"
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


def _strict(schema: Obj) -> Obj:
    """Reject unknown fields like the API server's strict field validation does (a CRD's
    structural schema may not say ``additionalProperties: false`` itself)."""
    out = copy.deepcopy(schema)

    def walk(node: Obj) -> None:
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            walk(child)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key])

    walk(out)
    return out


@functools.cache
def _cr_validator() -> jsonschema.Draft7Validator:
    (version,) = crd()["spec"]["versions"]
    return jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))


def cr_errors(obj: Obj) -> list[str]:
    """What our CRD's schema (strict) says is wrong with a CheckpointConfiguration."""
    return [
        f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in _cr_validator().iter_errors(obj)
    ]


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
    if obj["apiVersion"].split("/")[0] == render.GROUP:
        errors = cr_errors(obj)
        assert not errors, f"{name_of(obj)}: {errors}"
        return
    if obj["kind"] == "JobSet":
        assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}, sorted(obj)
        for job in _job_from_jobset(obj):
            validate(job)
        return
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(
            f"{name_of(obj)} is invalid for Kubernetes {KUBE_VERSION}: {path}: {exc.message}"
        )
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
