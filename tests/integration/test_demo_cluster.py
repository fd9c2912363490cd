"""`mtc demo --nodes 4` (what `make demo` runs): 4 daemons, a 4-rank gloo job, end to end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo trains a PyTorch model; `make test` installs torch")


def table_rows(stdout: str, label: str) -> dict[int, tuple[int, str, str]]:
    """rank -> (step, source, result) from the demo's restore table ``label``."""
    return {r: (s, src, res) for r, (s, src, _, _, res) in digest_rows(stdout, label).items()}


def digest_rows(stdout: str, label: str) -> dict[int, tuple[int, str, str, str, str]]:
    """rank -> (step, source, checkpoint digest, model digest, result) from the table."""
    section = stdout.split(f"restore table ({label}):", 1)[1]
    header = section.splitlines()[1]
    assert re.search(r"\bcheckpoint\s+model\s+result$", header), header
    rows = re.findall(
        r"^\[demo\]\s+(\d+)\s+(\d+)\s+(\w+)\s+\w+\s+(\w+)\s+(\w+)\s+(OK|FAIL)$", section, re.M
    )
    return {int(r): (int(s), src, c, m, res) for r, s, src, c, m, res in rows[:4]}


@pytest.mark.integration
def test_cluster_demo_restores_from_peer_then_backup(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mtc_replicator.tools.cli",
            "demo",
            "--nodes",
            "4",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    assert "FAIL" not in out.stdout
    peer = table_rows(out.stdout, "peer restore")
    assert {r: src for r, (_, src, _) in peer.items()} == {
        0: "local",
        1: "local",
        2: "peer",
        3: "local",
    }
    assert len({step for step, _, _ in peer.values()}) == 1
    backup = table_rows(out.stdout, "backup restore")
    assert sorted(backup) == [0, 1, 2, 3]
    assert {src for _, src, _ in backup.values()} == {"backup"}
    assert len({step for step, _, _ in backup.values()}) == 1
    assert {res for _, _, res in [*peer.values(), *backup.values()]} == {"OK"}
    # What is compared is said: each rank's checkpoint differs (it records its rank), the
    # model inside is the same on every rank (before: "model replicas identical" above a
    # column of four different digests labelled "weights").
    for label in ("peer restore", "backup restore"):
        rows = digest_rows(out.stdout, label)
        assert len({c for _, _, c, _, _ in rows.values()}) == 4
        assert len({m for _, _, _, m, _ in rows.values()}) == 1
    assert "replicas identical" not in out.stdout
    assert "distinct model digests across ranks" in out.stdout
