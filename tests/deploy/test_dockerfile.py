"""Static checks of the image recipe (no Docker engine here): the properties the DaemonSet
relies on, read from the Dockerfile and pyproject.toml."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.deploy.k8s import DEPLOY, REPO, container

DOCKERFILE = (REPO / "Dockerfile").read_text()


def _stages() -> list[list[str]]:
    """Instructions per stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    stages: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_both_entry_points_are_console_scripts() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    daemonset = yaml.safe_load((DEPLOY / "base" / "daemonset.yaml").read_text())
    pod = daemonset["spec"]["template"]["spec"]
    for name in ("csi-plugin", "replicator"):
        (command,) = container(pod, name)["command"]
        assert command in scripts, f"{command} is not a console script of the package"


def test_multi_stage_from_a_pinned_slim_python() -> None:
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", match.group(1))
    stages = _stages()
    assert len(stages) >= 2
    assert all(s[0].split()[1] == "${PYTHON_IMAGE}" for s in stages)


def test_final_stage_runs_unprivileged_with_mount_tools_and_no_build_tools() -> None:
    final = "\n".join(_stages()[-1])
    assert re.search(r"^USER 65532(:65532)?$", final, re.MULTILINE)
    assert "COPY --from=builder /opt/mtc /opt/mtc" in final
    assert "util-linux" in final
    assert "COPY . " not in final  # only the venv, not the sources
    for tool in ("gcc", "build-essential", "pip install", "git"):
        assert tool not in final, tool


def test_install_has_the_daemon_object_store_and_controller_extras_only() -> None:
    (install,) = [line for line in _stages()[0] if "pip install" in line]
    assert "[daemon,s3,gcs,controller]" in install
    for extra in ("torch", "interop", "dev"):
        assert extra not in install


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    ignored = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "tests", "*.egg-info", ".pytest_cache", ".mypy_cache"} <= ignored
    assert "README.md" not in ignored  # pyproject.toml's readme: the build needs it
