"""The release workflow (.github/workflows/release.yml) cannot run here: what it promises is
checked on its text. Nothing publishes before the whole suite passed on the tagged commit,
the tag must be the package's version, and the image is built for both architectures."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def _workflow() -> dict[str, Any]:
    loaded = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _needs(job: dict[str, Any]) -> set[str]:
    needs = job.get("needs", [])
    return {needs} if isinstance(needs, str) else set(needs)


def test_it_runs_on_version_tags_only() -> None:
    triggers = _workflow()[True]  # YAML 1.1 reads the key `on` as True
    assert set(triggers) == {"push"}
    (pattern,) = triggers["push"]["tags"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    as_regex = "^" + pattern.replace(".", r"\.") + "$"
    assert re.match(as_regex, f"v{version}")
    assert not re.match(as_regex, "latest")


def test_every_publishing_job_waits_for_the_suite() -> None:
    jobs = _workflow()["jobs"]
    steps = " ".join(str(s.get("run", "")) for s in jobs["test"]["steps"])
    assert "bash .ci/run" in steps
    assert "GITHUB_REF_NAME" in steps

    def upstream(name: str) -> set[str]:
        seen = set()
        todo = list(_needs(jobs[name]))
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(_needs(jobs[n]))
        return seen

    for name in ("pypi", "image", "chart", "release"):
        assert "test" in upstream(name), name


def test_the_image_is_multi_arch_and_the_wheel_is_checked() -> None:
    jobs = _workflow()["jobs"]
    build = next(s for s in jobs["image"]["steps"] if "build-push-action" in s.get("uses", ""))
    assert set(build["with"]["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    runs = " ".join(str(s.get("run", "")) for s in jobs["dist"]["steps"])
    assert "python -m build" in runs
    assert "twine check --strict" in runs
    assert jobs["pypi"]["permissions"] == {"id-token": "write"}  # no stored token


def test_the_chart_is_released_at_the_package_s_version() -> None:
    """The chart job checks the tag against Chart.yaml, which must say the package's version
    now (the image's tag is the chart's appVersion), and pushes the package it built."""
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "mtc-replicator" / "Chart.yaml").read_text())
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (chart["version"], chart["appVersion"]) == (version, version)
    runs = " ".join(str(s.get("run", "")) for s in _workflow()["jobs"]["chart"]["steps"])
    assert "helm package deploy/helm/mtc-replicator" in runs
    assert 'helm push chart/mtc-replicator-"${GITHUB_REF_NAME#v}".tgz' in runs
    assert "version: ${GITHUB_REF_NAME#v}" in runs
