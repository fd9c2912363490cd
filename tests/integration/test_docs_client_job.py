"""A two-node PyTorch job written exactly as docs/client.md shows it, against two real daemons
with mutual TLS and a ``file://`` backup on the default 30-minute interval.

Before: ``job_config`` without peer keys gave ``peers-per-node: 0``, so nothing left a node
but the backup's first step; after one node was lost, both ranks restored step 5 of 35,
and nothing (the accepted-handshake line, ``replicator.errors``, ``mtc status``) said so.
"""

from __future__ import annotations

import logging
import shutil
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator import client
from mtc_replicator.core.contract import ERRORS_FILE
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import FAST
from tests.integration.helpers import store_root, stored_steps, wait_until
from tests.tls import node_tls

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

JOB = "llm-7b"
NODES = 2


class TwoNodes:
    """Two daemons as deploy/ runs them: a certificate per node, one shared backup."""

    def __init__(self, root: Path, *extra: str) -> None:
        self.root = root
        self.dirs = [root / f"node{r}" for r in range(NODES)]
        for d in self.dirs:
            d.mkdir()
        (root / "backup").mkdir()
        ca = certs.new_ca()
        self.tls = [node_tls(root / "tls" / f"node{r}", ca, node=f"node{r}") for r in range(NODES)]
        self.extra = extra
        self.daemons: list[DaemonProcess] = []

    def start(self, rank: int) -> DaemonProcess:
        daemon = DaemonProcess(
            self.dirs[rank],
            backup=(self.root / "backup").as_uri(),
            extra_args=(*FAST, *self.tls[rank].args(), *self.extra),
            log_path=self.root / f"node{rank}.log",
        ).start()
        if rank < len(self.daemons):
            self.daemons[rank] = daemon
        else:
            self.daemons.append(daemon)
        return daemon

    def lose(self, rank: int) -> None:
        """The node is lost: its daemon killed, its RAM disk and the store beside it gone."""
        self.daemons[rank].kill()
        shutil.rmtree(self.dirs[rank])
        shutil.rmtree(store_root(self.dirs[rank]), ignore_errors=True)
        self.dirs[rank].mkdir()
        self.start(rank)

    def stop(self) -> None:
        for d in self.daemons:
            if d.running:
                d.stop()


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[TwoNodes]:
    two = TwoNodes(tmp_path, "--metrics", "127.0.0.1:0")
    for r in range(NODES):
        two.start(r)
    try:
        yield two
    finally:
        two.stop()


def handshake_as_documented(nodes: TwoNodes, **extra: int) -> list[client.RestoreResult]:
    """Every rank runs docs/client.md's handshake at once, as a job's ranks do."""

    def one(rank: int) -> client.RestoreResult:
        return client.handshake(
            nodes.dirs[rank],
            job_name=JOB,
            framework="pytorch.distributed",
            node_rank=rank,
            nodes=NODES,
            backup_interval_minutes=30,
            timeout=60,
            **extra,  # type: ignore[arg-type]
        )

    with ThreadPoolExecutor(NODES) as pool:
        return list(pool.map(one, range(NODES)))


def state_of(rank: int, step: int) -> dict[str, object]:
    torch.manual_seed(rank * 1000 + step)
    return {"w": torch.randn(256, 64), "step": step}


def test_a_job_as_documented_survives_a_lost_node_at_its_newest_step_from_a_peer(
    nodes: TwoNodes,
) -> None:
    first = handshake_as_documented(nodes)
    assert [r.step for r in first] == [None, None]
    for step in range(5, 40, 5):
        for rank in range(NODES):
            client.save_state_dict(nodes.dirs[rank], step, state_of(rank, step))
    # Each rank's newest step held at home and on the other node (its peer copy).
    for rank in range(NODES):
        other = 1 - rank
        wait_until(
            lambda r=rank, o=other: 35 in stored_steps(nodes.dirs[o], JOB, rank=r),
            f"rank {rank}'s step 35 on node {other}",
            daemon=nodes.daemons[other],
            timeout=60,
        )

    nodes.lose(1)
    again = handshake_as_documented(nodes)

    assert [r.step for r in again] == [35, 35], "a lost node rolled the job back"
    assert [r.source for r in again] == ["local", "peer"]
    for rank, result in enumerate(again):
        assert result.path is not None
        loaded = client.load_state_dict(result.path)
        assert torch.equal(loaded["w"], state_of(rank, 35)["w"])


def test_a_job_with_no_copy_off_its_nodes_is_told_at_the_handshake(
    nodes: TwoNodes, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="mtc_replicator.client"):
        handshake_as_documented(nodes, peers_per_node=0)
    lines = [r.getMessage() for r in caplog.records]
    told = [line for line in lines if "no other node holds a copy" in line]
    assert len(told) == NODES, "each rank is told once, through replicator.errors"
    assert all("peers-per-node: 1" in line for line in told)
    for rank in range(NODES):
        assert not (nodes.dirs[rank] / ERRORS_FILE).exists()  # relayed, then deleted
        daemon = nodes.daemons[rank]
        assert "peers=NONE" in daemon.log()
        assert daemon.metrics is not None
        with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=5) as page:
            body = page.read().decode()
        assert f'mtc_off_node_copies{{mtc_job="{JOB}"}} 0.0' in body


def test_the_default_peer_is_said_in_the_log_and_the_metric(nodes: TwoNodes) -> None:
    handshake_as_documented(nodes)
    for rank in range(NODES):
        daemon = nodes.daemons[rank]
        assert f"peers=copies to [{1 - rank}]" in daemon.log()
        assert daemon.metrics is not None
        with urllib.request.urlopen(f"http://{daemon.metrics}/metrics", timeout=5) as page:
            body = page.read().decode()
        assert f'mtc_off_node_copies{{mtc_job="{JOB}"}} 1.0' in body
