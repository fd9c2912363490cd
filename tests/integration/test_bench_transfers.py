"""The transfer benchmarks run end to end, tiny: ``scripts/bench_peer.py`` (every push and
pull, plaintext and over mutual TLS, against the raw copy) and ``scripts/bench_restore.py``
(peer, local and backup restores with their baselines); and the raw copy both compare
against moves every byte, in plaintext and over TLS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtc_replicator.tools import certs
from scripts.bench_peer import raw_copy
from tests.tls import node_tls

pytestmark = pytest.mark.integration

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
def test_the_raw_copy_moves_every_byte(tmp_path: Path, tls: bool) -> None:
    src = tmp_path / "src"
    (src / "state").mkdir(parents=True)
    (src / "meta").write_bytes(b"x" * 11)  # shorter than a slice, then files across slices
    (src / "state" / "a.bin").write_bytes(os.urandom(5 << 20 | 123))
    (src / "state" / "empty").write_bytes(b"")
    tls_dir = node_tls(tmp_path / "tls", certs.new_ca(), node="n1").root if tls else None

    copied = raw_copy(src, tmp_path / "dest", tls_dir, warm=1 << 20)

    assert _tree(tmp_path / "dest") == _tree(src)
    assert copied["bytes"] == (5 << 20 | 123) + 11
    assert copied["seconds"] > 0
    assert {"cpu", "sender_cpu"} <= set(copied)


def test_the_peer_bench_measures_every_transfer() -> None:
    command = [sys.executable, str(SCRIPTS / "bench_peer.py"), "--size-mib", "8", "--files", "2"]
    done = subprocess.run(
        [*command, "--rounds", "1"], check=False, capture_output=True, text=True, timeout=240
    )

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for row in (
        "push to daemon B, data channel (crc32c, commit)",
        "push to daemon B, data channel, mutual TLS 1.3",  # B must take rank 0 from the bench
        "pull from daemon A', data channel, mutual TLS 1.3",
        "pull from daemon A, gRPC chunks (restore from peer)",
    ):
        assert row in done.stdout, done.stdout


def test_the_restore_bench_measures_every_case() -> None:
    command = [sys.executable, str(SCRIPTS / "bench_restore.py"), "--size-mib", "8"]
    command += ["--rounds", "1", "--backup-rounds", "1", "--json"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    cases = {"raw", "raw_tls", "peer", "local", "raw_plain", "peer_plain"}
    assert set(result["median"]) == cases | {"cp", "backup"}
    assert all(seconds > 0 for seconds in result["median"].values())
    assert set(result["cpu_seconds"]) == cases
    assert "n1 pull itself (s)" in result["timelines"]["peer"]


def test_a_pinned_raw_copy_runs_each_end_on_its_own_cores(tmp_path: Path) -> None:
    """``pins`` plays two nodes on one machine: the sender on the first set, the receiver
    on the second, each process held there (what ``bench_restore --node-cores`` relies on)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs 2 cores to give each end one of its own")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3 << 20))

    copied = raw_copy(src, tmp_path / "dest", pins=((cores[0],), (cores[1],)))

    assert _tree(tmp_path / "dest") == _tree(src)
    assert (copied["sender_cores"], copied["cores"]) == ([cores[0]], [cores[1]])


def test_the_restore_bench_plays_nodes_on_cores_of_their_own() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--node-cores 1 needs 2 cores")
    command = [sys.executable, str(SCRIPTS / "bench_restore.py"), "--size-mib", "8"]
    command += ["--rounds", "1", "--backup-rounds", "0", "--no-tls", "--node-cores", "1"]
    done = subprocess.run([*command, "--json"], check=False, capture_output=True, text=True)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["node_cores"] == 1
    assert set(result["median"]) == {"raw_plain", "peer_plain"}
    assert "on 1 core(s) of its own" in done.stdout
    too_many = subprocess.run(
        [*command[:-1], str(len(os.sched_getaffinity(0)))],
        check=False,
        capture_output=True,
        text=True,
    )
    assert too_many.returncode == 2
    assert "needs" in too_many.stderr
