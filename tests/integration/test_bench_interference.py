"""The interference benchmark (scripts/bench_interference.py) runs end to end, tiny: real
daemons, the stand-in trainer and its mirror, every configuration, the save-cost section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_interference.py"


def test_the_interference_bench_reports_every_configuration() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    args = ["--size-mib", "4", "--steps", "6", "--save-every", "3", "--warmup", "0"]
    args += ["--repeats", "1", "--save-rounds", "1", "--rates", "64MiB", "--no-tls"]
    args += ["--matmul", "16", "--matmuls", "1", "--copy-mib", "1", "--copies", "1"]
    args += ["--drain-seconds", "30", "--json"]

    command = [sys.executable, str(SCRIPT), *args]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240)

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    configs = {c["config"]: c for c in report["configs"]}
    assert sorted(configs) == ["a", "b", "c1"]
    assert configs["c1"]["flags"] == "--max-transfer-rate 64MiB"
    for config in configs.values():
        assert (config["plain"]["n"], config["save"]["n"]) == (4, 2), config
    for name in ("b", "c1"):
        # The last save is always waited for; an older one may be superseded.
        assert configs[name]["replicated"]["count"] >= 1, configs[name]
        assert configs[name]["backed_up"]["count"] >= 1, configs[name]
    assert len(report["save_cost"]["client"]) == len(report["save_cost"]["torch.save"]) == 1
    assert report["client_vs_torch"] > 0
