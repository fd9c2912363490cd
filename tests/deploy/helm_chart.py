"""The Helm chart (deploy/helm/mtc-replicator) rendered offline, and what its objects and the
kustomize tree's may differ in.

Rendered with Helm's own Go SDK through ``helm-python-sdk`` (``helm_python``: Helm v4's engine,
schema validation and lint in a bundled shared library), so no ``helm`` binary or network is
needed. ``deploy/helm/values/`` holds a values file per kustomize overlay and component, and
the GKE, EKS and AKS GPU pools of docs/deploy.md.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import yaml
from helm_python.chart import Chart

from tests.deploy.k8s import DEPLOY, Obj, load_all

CHART_DIR = DEPLOY / "helm" / "mtc-replicator"
VALUES_DIR = DEPLOY / "helm" / "values"
RELEASE = "mtc"
RELEASE_NAMESPACE = "default"
"""Not mtc-system: the chart makes that namespace, so the release's record lives elsewhere."""

MIRRORS: dict[str, tuple[str, ...]] = {
    "base": (),
    "overlays/cert-manager": ("cert-manager.yaml",),
    "overlays/cert-manager-per-node": ("cert-manager-per-node.yaml",),
    "overlays/gke": ("gke.yaml",),
    "overlays/s3": ("s3.yaml",),
    "overlays/controller": ("controller.yaml",),
}
"""Each kustomization of deploy/ and the values files that make the chart render the same."""

HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
KEEP_ANNOTATION = "helm.sh/resource-policy"
CHECKSUM_ANNOTATION = "checksum/config"
_KUSTOMIZE_HASH = re.compile(r"-[a-z0-9]{10}$")


@functools.cache
def chart() -> Chart:
    return Chart.load(CHART_DIR)


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Values files layered as ``helm -f a -f b`` does: maps merge, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values_of(*files: str, **extra: Any) -> dict[str, Any]:
    """The values of ``deploy/helm/values/FILE``s in order, then ``extra`` on top."""
    out: dict[str, Any] = {}
    for name in files:
        out = merge(out, yaml.safe_load((VALUES_DIR / name).read_text()) or {})
    return merge(out, extra)


@functools.cache
def _render(values_json: str, namespace: str) -> tuple[str, ...]:
    rendered = chart().render(
        values=json.loads(values_json), name=RELEASE, namespace=namespace, is_install=True
    )
    return tuple(text for path, text in sorted(rendered.items()) if not path.endswith("NOTES.txt"))


def render(values: dict[str, Any] | None = None, namespace: str = RELEASE_NAMESPACE) -> list[Obj]:
    """The objects ``helm template`` would print (a fresh copy per call)."""
    texts = _render(json.dumps(values or {}, sort_keys=True), namespace)
    return [obj for text in texts for obj in load_all(text)]


def notes(values: dict[str, Any] | None = None) -> str:
    rendered = chart().render(
        values=values or {}, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True
    )
    (text,) = [t for p, t in rendered.items() if p.endswith("NOTES.txt")]
    return text


def render_files(*files: str) -> list[Obj]:
    return render(values_of(*files))


def _drop(mapping: dict[str, Any], parent: dict[str, Any], key: str, *names: str) -> None:
    for name in names:
        mapping.pop(name, None)
    if not mapping:
        parent.pop(key)


def normalised(objs: list[Obj]) -> dict[str, Obj]:
    """``kind/name`` -> object, less what Helm and kustomize must differ in: Helm's labels and
    its keep annotation, kustomize's hash suffix on the ConfigMap (and the DaemonSet's
    references to it), and the checksum annotation that rolls Helm's pods instead."""
    out = {}
    for original in objs:
        obj = copy.deepcopy(original)
        meta = obj["metadata"]
        if "labels" in meta:
            _drop(meta["labels"], meta, "labels", *HELM_LABELS)
        if "annotations" in meta:
            _drop(meta["annotations"], meta, "annotations", KEEP_ANNOTATION)
        if obj["kind"] == "ConfigMap":
            meta["name"] = _KUSTOMIZE_HASH.sub("", meta["name"])
        if obj["kind"] == "DaemonSet":
            template = obj["spec"]["template"]
            template["metadata"]["annotations"].pop(CHECKSUM_ANNOTATION, None)
            pod = template["spec"]
            for c in [*pod["initContainers"], *pod["containers"]]:
                for ref in c.get("envFrom", []):
                    if "configMapRef" in ref:
                        ref["configMapRef"]["name"] = _KUSTOMIZE_HASH.sub(
                            "", ref["configMapRef"]["name"]
                        )
        out[f"{obj['kind']}/{meta['name']}"] = obj
    return out


def overlay(directory: Path, kustomization: dict[str, Any]) -> Path:
    """A kustomization in ``directory`` whose ``../../`` paths reach the repository's deploy/."""
    directory.mkdir(parents=True, exist_ok=True)
    there = os.path.relpath(DEPLOY, directory)
    text = yaml.safe_dump(kustomization).replace("../../", f"{there}/")
    (directory / "kustomization.yaml").write_text(text)
    return directory
