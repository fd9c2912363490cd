"""The prepared run for a lent machine (``scripts/device_cores.sh``) can install what the
daemon imports there, where nothing can be fetched: ``scripts/device_wheels.sh`` names every
package of the ``daemon`` extra and the base dependencies, and both scripts parse."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _name(requirement: str) -> str:
    """A requirement's project name, normalized (PEP 503)."""
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_wheels_script_names_every_package_the_daemon_needs() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = {
        _name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["daemon"]]
    }
    script = (REPO / "scripts" / "device_wheels.sh").read_text()
    listed = re.search(r"names=\(([^)]*)\)", script)
    assert listed is not None, "device_wheels.sh lists its packages in names=(...)"
    assert needed <= {_name(n) for n in listed[1].split()}


def test_the_device_scripts_parse() -> None:
    for script in ("device_wheels.sh", "device_cores.sh"):
        done = subprocess.run(
            ["bash", "-n", str(REPO / "scripts" / script)],
            check=False,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
