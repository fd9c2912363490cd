"""Real Orbax in two JAX processes, each started from the ``jax-init-info.txt`` the node stack
wrote (``mtc.v1.Node/AssignRank``, as mtc-controller calls it), on two real daemons.

The job trains (steps 0..2) with pod i on node i. Then it restarts with its pods placed the
other way round: pod 0 on node 1, pod 1 on node 0. The controller's code asks each daemon
what it holds (``Node/Status``) and assigns with ``core.ranks``: each pod gets the rank whose
bytes its node holds, so pod 0 becomes process 1. Orbax reads the file with no shell glue,
``jax.distributed.initialize`` runs with those indexes, and both processes restore step 2
from their own node (``restore-source: local``), every shard as saved.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator.controller.sticky import Replicators
from mtc_replicator.core.ranks import Pod, assign
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import FAST_ARGS, read_prerestore, wait_until

pytest.importorskip(
    "orbax.checkpoint",
    reason="the real Orbax client is not installed (`make test` installs the [interop] extra)",
)

pytestmark = [pytest.mark.interop, pytest.mark.integration]

DRIVER = Path(__file__).resolve().parents[1] / "interop" / "orbax_driver.py"
TIMEOUT = 150
JOB = "orbax-sticky"


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    backup = tmp_path / "backup"
    backup.mkdir()
    started = [
        DaemonProcess(
            tmp_path / f"node{i}" / "ckpt",
            backup=backup.as_uri(),
            extra_args=FAST_ARGS,
            log_path=tmp_path / f"node{i}.log",
        ).start()
        for i in range(2)
    ]
    yield started
    for d in started:
        if d.running:
            d.stop(timeout=10)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hand_ranks(
    daemons: list[DaemonProcess], ranks: dict[int, int], assignment: str, source: str
) -> None:
    """What mtc-controller does once the pods are placed: each node's replicator is told its
    pod's rank and the address of the pod that got rank 0."""
    coordinator = f"127.0.0.1:{_port()}"
    for node, rank in ranks.items():
        request = pb.AssignRankRequest(
            job=JOB,
            pod_uid=f"pod-on-node{node}-{assignment}",
            rank=rank,
            nodes=len(ranks),
            coordinator=coordinator,
            assignment=assignment,
            source=source,
        )
        written = Replicators(None).assign(daemons[node].address, request)
        assert "jax-init-info.txt" in written


def run_drivers(daemons: list[DaemonProcess], mode: str, *extra: str) -> list[dict[str, Any]]:
    """One real Orbax process per node, both at once (JAX's coordinator needs them all)."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(DRIVER),
                "--dir",
                str(d.checkpoint_dir),
                "--run-name",
                JOB,
                "--mode",
                mode,
                "--processes",
                "2",
                "--timeout",
                str(TIMEOUT),
                "--backup-interval-minutes",
                "30",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for d in daemons
    ]
    results = []
    for d, p in zip(daemons, procs, strict=True):
        out, err = p.communicate(timeout=TIMEOUT + 30)
        lines = out.strip().splitlines()
        if p.returncode != 0 or not lines:
            pytest.fail(
                f"driver {mode} on {d.checkpoint_dir} exited {p.returncode}\n{err[-5000:]}\n"
                f"--- daemon ---\n{d.log()[-4000:]}"
            )
        results.append(json.loads(lines[-1]))
    return results


def test_orbax_starts_from_the_ranks_the_node_stack_wrote_and_restores_locally(
    daemons: list[DaemonProcess],
) -> None:
    # First start: pod i on node i keeps its index.
    hand_ranks(daemons, {0: 0, 1: 1}, "first", "index")
    trained = run_drivers(daemons, "train", "--steps", "3", "--save-every", "1")
    assert all(r["saved_steps"] == [0, 1, 2] for r in trained), trained
    replicators = Replicators(None)
    for node, d in enumerate(daemons):
        wait_until(
            lambda d=d, node=node: 2 in replicators.holdings(d.address, JOB).get(node, set()),
            f"node {node} holds its rank's step 2",
            daemon=d,
        )

    # The restart puts pod 0 on node 1 and pod 1 on node 0; ranks follow the bytes.
    placed = {0: 1, 1: 0}  # pod index -> node
    held = {f"node{n}": replicators.holdings(d.address, JOB) for n, d in enumerate(daemons)}
    a = assign([Pod(f"pod-{i}", i, f"node{n}") for i, n in placed.items()], held, 2)
    ranks = {placed[i]: a.ranks[f"pod-{i}"] for i in placed}
    assert ranks == {1: 1, 0: 0}  # pod 0 (on node 1) takes rank 1: not its index
    assert (a.local, a.by_index) == (2, 0)
    hand_ranks(daemons, ranks, "second", "holdings")
    for node, d in enumerate(daemons):
        info = (d.checkpoint_dir / "jax-init-info.txt").read_text().splitlines()
        assert int(info[0]) == ranks[node]

    resumed = run_drivers(daemons, "resume")
    for node, r in enumerate(resumed):
        assert r["process_index"] == ranks[node]
        assert r["restored_step"] == 2
        assert r["checksum"] == r["expected_checksum"], r
        assert read_prerestore(daemons[node].checkpoint_dir)["restore-source"] == "local"
