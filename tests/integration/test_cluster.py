"""Four real daemons on loopback: restore rounds, peer replication, restore from a peer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    read_prerestore,
    read_tree,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration

NODES = 4
FAST = ("--rescan-seconds", "0.3", "--settle-seconds", "2", "--config-wait-seconds", "3")


class Cluster:
    """One daemon per node, each on its own CHECKPOINT_DIR; one shared backup + registry."""

    def __init__(self, root: Path, job: str) -> None:
        self.root = root
        self.job = job
        self.backup = root / "backup"
        self.backup.mkdir()
        self.dirs = [root / f"node{r}" for r in range(NODES)]
        for d in self.dirs:
            d.mkdir()
        self.daemons: list[DaemonProcess | None] = [None] * NODES

    def start(self, rank: int) -> DaemonProcess:
        daemon = DaemonProcess(
            self.dirs[rank],
            backup=self.backup.as_uri(),
            extra_args=FAST,
            log_path=self.root / f"node{rank}.log",
        )
        self.daemons[rank] = daemon.start()
        return daemon

    def daemon(self, rank: int) -> DaemonProcess:
        d = self.daemons[rank]
        assert d is not None
        return d

    def handshake(self, ranks: list[int], **keys: object) -> None:
        for r in ranks:
            text = config_text(
                self.job, rank=r, nodes=NODES, peers_per_node=1, backup_interval_steps=100, **keys
            )
            write_yaml_atomic(self.dirs[r], text)

    def markers(self, rank: int) -> list[str]:
        return sorted(p.name for p in self.dirs[rank].iterdir() if p.name.endswith(".restore"))

    def wait_markers(self, step: int) -> None:
        for r in range(NODES):
            want = [f"{self.job}-s{step}-n{r}-w0.restore"]
            wait_until(
                lambda r=r, want=want: self.markers(r) == want,
                f"rank {r}'s marker {want}",
                daemon=self.daemon(r),
                timeout=60,
            )

    def held(self, rank: int) -> set[tuple[int, str]]:
        """(step, '<rank>-<worker>') of every committed item in the rank's store."""
        root = self.dirs[rank] / ".mtc" / "items" / self.job
        if not root.is_dir():
            return set()
        return {
            (int(step.name), item.name)
            for step in root.iterdir()
            for item in step.iterdir()
            if (item / "MANIFEST.json").exists()
        }

    def stop_all(self) -> None:
        for d in self.daemons:
            if d is not None and d.running:
                d.stop()


@pytest.fixture
def cluster(tmp_path: Path, job: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, job)
    for r in range(NODES):
        c.start(r)
    try:
        yield c
    finally:
        c.stop_all()
        for r in range(NODES):
            log = tmp_path / f"node{r}.log"
            if log.exists():
                print(f"--- node {r} ---\n{log.read_text()[-6000:]}")


def test_fresh_start_then_replication_then_restore_from_a_peer(cluster: Cluster) -> None:
    # Rank 0 (the coordinator's host) last: the others wait for it, then all agree.
    cluster.handshake([3, 1, 2, 0])
    cluster.wait_markers(0)
    for r in range(NODES):
        assert os.path.isfile(cluster.dirs[r] / f"{cluster.job}-s0-n{r}-w0.restore")
        assert read_prerestore(cluster.dirs[r]) == {}
        os.unlink(cluster.dirs[r] / f"{cluster.job}-s0-n{r}-w0.restore")

    files = {r: payload(5, seed=f"rank{r}") for r in range(NODES)}
    for r in range(NODES):
        make_step(cluster.dirs[r], 5, files[r])
    # Each rank's step 5 is committed at home and pushed to its one peer.
    for r in range(NODES):
        wait_until(
            lambda r=r: (5, f"{r}-0") in cluster.held(r),
            f"rank {r} committed step 5",
            daemon=cluster.daemon(r),
        )
    wait_until(
        lambda: all(
            any((5, f"{r}-0") in cluster.held(h) for h in range(NODES) if h != r)
            for r in range(NODES)
        ),
        "a peer copy of every rank's step 5",
        daemon=cluster.daemon(0),
    )

    # Node 2 loses its RAM disk: its daemon restarts on an empty directory.
    cluster.daemon(2).kill()
    shutil.rmtree(cluster.dirs[2])
    cluster.dirs[2].mkdir()
    cluster.start(2)

    # The job restarts: every node writes a new handshake, rank 0 first this time.
    cluster.handshake([0, 2, 1, 3])
    cluster.wait_markers(5)
    for r in range(NODES):
        marker = cluster.dirs[r] / f"{cluster.job}-s5-n{r}-w0.restore"
        assert os.path.islink(marker)
        assert not os.path.isabs(os.readlink(marker))
        assert read_tree(marker) == files[r], f"rank {r} restored other bytes"
    assert read_prerestore(cluster.dirs[2])["restore-source"] == "peer"
    assert read_prerestore(cluster.dirs[0])["restore-source"] == "local"
