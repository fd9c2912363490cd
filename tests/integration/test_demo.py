"""`mtc demo` is the project's main job: it must pass end to end, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo trains a PyTorch model; `make test` installs torch")


@pytest.mark.integration
def test_demo_passes_every_check(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mtc_replicator.tools.cli", "demo", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    # Both tiers were really exercised, not just reported.
    assert "OK   restore source: got local" in out.stdout
    assert "OK   restore source: got backup" in out.stdout
    assert "FAIL" not in out.stdout
