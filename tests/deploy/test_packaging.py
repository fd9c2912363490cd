"""The client installs alone: a wheel built from this tree, in an empty venv, beside PyYAML.

Builds the package's wheel from a copy of the working tree (the build writes into its
source), makes an empty venv (no pip of its own: this interpreter's pip installs into it
through ``--python``, with its cache), and checks that pip resolves the wheel to exactly
itself and PyYAML, that ``pip check`` is content with PyYAML alone, and that a real
handshake through ``client`` against a tmpfs directory imports nothing of the daemon's.
Needs the package index for PyYAML (this machine's, or PyPI); skips only when it is
unreachable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PIP_TIMEOUT = 240
# What the daemon's extras bring; none of it may be importable in the client's venv.
HEAVY = (
    "grpc",
    "grpc_health",
    "google",
    "google_crc32c",
    "inotify_simple",
    "uvloop",
    "prometheus_client",
    "cryptography",
    "bitmath",
    "boto3",
    "botocore",
    "torch",
    "numpy",
)
_NETWORK_ERRORS = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeout",
    "ProxyError",
    "Max retries exceeded",
)

# Runs in the client-only venv: a handshake with this script's thread standing in for the
# daemon (it reads and checks the yaml with the daemon's own parser, consumes it, announces
# and links a step), then what got imported.
CLIENT_ROUND_TRIP = r"""
import importlib.util, json, os, sys, threading, time
from pathlib import Path

from mtc_replicator import client
from mtc_replicator.core import contract

heavy = sys.argv[2].split(",")
d = Path(sys.argv[1])
seen = {}

def daemon_stand_in():
    cfg = d / contract.CONFIG_FILE
    deadline = time.monotonic() + 30
    while not cfg.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    parsed = contract.parse_config(cfg.read_text())
    seen["config"] = [parsed.job_name, parsed.framework.value, parsed.node_rank, parsed.nodes]
    step = d / ".mtc" / "views" / "7"
    step.mkdir(parents=True)
    (step / "state").write_bytes(b"weights of step 7")
    cfg.unlink()
    (d / contract.PRERESTORE_FILE).write_text("restore-step: 7\nrestore-source: local\n")
    os.symlink(".mtc/views/7", d / "pkg-s7-n0-w0.restore")

helper = threading.Thread(target=daemon_stand_in)
helper.start()
result = client.handshake(
    d, job_name="pkg", framework="orbax", node_rank=0, nodes=1, timeout=30, poll_interval=0.05
)
helper.join()
seen["restored"] = [result.step, result.source, os.path.basename(result.path),
                    (Path(result.path) / "state").read_bytes().decode()]
try:
    client.save_state_dict(d, 8, {})
except ModuleNotFoundError as exc:
    seen["save_without_torch"] = exc.name
seen["loaded"] = sorted(m for m in sys.modules if m.partition(".")[0] in heavy)
seen["importable"] = sorted(m for m in heavy if importlib.util.find_spec(m) is not None)
print(json.dumps(seen))
"""


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH, which would put the source tree on sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _pip(*args: str, python: Path | None = None) -> subprocess.CompletedProcess[str]:
    target = ("--python", str(python)) if python is not None else ()
    return subprocess.run(
        [sys.executable, "-m", "pip", *target, *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT,
        check=False,
        env=_env(),
    )


def _check(proc: subprocess.CompletedProcess[str]) -> str:
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(marker in output for marker in _NETWORK_ERRORS):
            pytest.skip(f"the package index is unreachable, PyYAML cannot be installed: {output}")
        raise AssertionError(f"pip failed ({proc.returncode}):\n{output}")
    return proc.stdout


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mtc-pkg-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def wheel(workdir: Path) -> Path:
    src = workdir / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE", "NOTICE"):
        shutil.copy2(REPO / name, src / name)
    for package in ("mtc_replicator",):
        shutil.copytree(
            REPO / package,
            src / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
        )
    out = workdir / "dist"
    # No build isolation: this venv's setuptools builds it, offline and in seconds.
    _check(_pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)))
    (built,) = out.glob("mtc_replicator-*.whl")
    return built


@pytest.fixture(scope="module")
def client_venv(workdir: Path, wheel: Path) -> Path:
    """An empty venv with the wheel and PyYAML installed, nothing else."""
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _check(_pip("install", "-q", "--no-deps", str(wheel), "pyyaml>=6.0.1,<7", python=python))
    return python


def _metadata(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(zf.read(name).decode())
    return [Requirement(line) for line in message.get_all("Requires-Dist") or []]


def _extra(req: Requirement) -> str | None:
    if req.marker is None:
        return None
    for extra in ("daemon", "gcs", "s3", "torch", "demo", "interop", "ray", "controller", "dev"):
        if req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            return extra
    return None


def test_wheel_requires_only_pyyaml_and_no_user_facing_extra_pins(wheel: Path) -> None:
    requirements = _metadata(wheel)
    base = [r for r in requirements if _extra(r) is None]
    assert [canonicalize_name(r.name) for r in base] == ["pyyaml"]
    extras = {_extra(r) for r in requirements} - {None}
    assert {"daemon", "torch", "demo", "s3", "gcs", "ray", "controller"} <= extras
    for req in requirements:
        extra = _extra(req)
        if extra == "dev":  # the dev tools, never installed by a user: exact where needed
            continue
        pinned = [s for s in req.specifier if s.operator in ("==", "===")]
        assert not pinned, f"extra {extra!r} pins {req}"
    torch = next(r for r in requirements if canonicalize_name(r.name) == "torch")
    assert torch.specifier.contains("2.13.0")
    assert torch.specifier.contains("2.7.0")
    ray = next(r for r in requirements if canonicalize_name(r.name) == "ray")
    assert ray.specifier.contains("2.60.0"), ray  # what tests/ray runs against


def test_pip_resolves_the_wheel_to_itself_and_pyyaml(workdir: Path, wheel: Path) -> None:
    empty = workdir / "empty-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(empty)], check=True)
    report = workdir / "report.json"
    _check(
        _pip(
            "install", "-q", "--dry-run", "--report", str(report), str(wheel),
            python=empty / "bin" / "python",
        )
    )  # fmt: skip
    installed = json.loads(report.read_text())["install"]
    names = {canonicalize_name(item["metadata"]["name"]) for item in installed}
    assert names == {"mtc-replicator", "pyyaml"}


def test_pip_check_is_content_with_pyyaml_alone(client_venv: Path) -> None:
    out = _check(_pip("check", python=client_venv))
    assert "No broken requirements" in out
    listed = json.loads(_check(_pip("list", "--format", "json", python=client_venv)))
    assert {canonicalize_name(p["name"]) for p in listed} == {"mtc-replicator", "pyyaml"}


def test_client_handshake_round_trip_imports_nothing_of_the_daemon(
    client_venv: Path, tmp_path: Path
) -> None:
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as ramdisk:
        proc = subprocess.run(
            [str(client_venv), "-I", "-c", CLIENT_ROUND_TRIP, ramdisk, ",".join(HEAVY)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=tmp_path,
            env=_env(),
        )
        assert proc.returncode == 0, proc.stderr
        seen = json.loads(proc.stdout)
        assert seen["config"] == ["pkg", "orbax", 0, 1]
        assert seen["restored"] == [7, "local", "7", "weights of step 7"]
        assert os.path.islink(Path(ramdisk) / "7")
    assert seen["save_without_torch"] == "torch"  # torch is imported only when saving
    assert seen["loaded"] == []
    assert seen["importable"] == []


@pytest.mark.parametrize("script", ["mtc-replicator", "mtc", "mtc-csi"])
def test_daemon_scripts_without_the_extra_say_what_to_install(
    client_venv: Path, script: str
) -> None:
    proc = subprocess.run(
        [str(client_venv.parent / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=_env(),
    )
    assert proc.returncode == 2
    assert "pip install 'mtc-replicator[daemon]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_the_wheel_installs_one_top_level_package(wheel: Path) -> None:
    """One namespace: nothing named ``client``, ``csi`` or ``replicator`` at the top."""
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"mtc_replicator"}


def test_the_wheel_carries_the_license_and_notice(wheel: Path) -> None:
    """Apache-2.0 asks for both to travel with every copy; PEP 639 puts them in the
    dist-info's ``licenses/`` and names the license in the metadata."""
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        fields = Parser().parsestr(zf.read(meta).decode())
        texts = {n.rsplit("/", 1)[1]: zf.read(n) for n in names if "/licenses/" in n}
    assert fields["License-Expression"] == "Apache-2.0"
    assert set(texts) == {"LICENSE", "NOTICE"}
    assert b"Apache License" in texts["LICENSE"]
    assert b"Version 2.0, January 2004" in texts["LICENSE"]


def test_a_training_repos_own_client_and_csi_shadow_nothing(
    client_venv: Path, tmp_path: Path
) -> None:
    """A training repository's own ``client.py``, ``csi/`` or ``replicator.py`` in the working
    directory (first on ``sys.path`` for ``python -c`` and scripts run there) is never
    imported in place of ours (each would fail the import if it were)."""
    shadow = "raise ImportError('the training repo shadowed the package')\n"
    for name in ("client.py", "replicator.py", "core.py", "handshake.py"):
        (tmp_path / name).write_text(shadow)
    (tmp_path / "csi").mkdir()
    (tmp_path / "csi" / "__init__.py").write_text(shadow)
    code = (
        "from mtc_replicator.client import job_config\n"
        "print(job_config(job_name='pkg', framework='orbax', node_rank=0, nodes=1).job_name)\n"
    )
    proc = subprocess.run(
        [str(client_venv), "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "pkg"
