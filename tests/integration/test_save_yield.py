"""A save in progress holds the daemons' replication (``--yield-to-saves-seconds``), real
daemons on loopback: the job's writes to the RAM disk do not compete with the daemon's reads."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import NODES, Cluster, running
from tests.integration.helpers import wait_until

HOLD = 6.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, "yielding", ("--yield-to-saves-seconds", str(HOLD)), tls=False)
    with running(c):
        c.fresh_start()
        yield c


def peer_copies(cluster: Cluster, step: int) -> int:
    """How many ranks' items of ``step`` some other rank holds."""
    return sum(
        any((step, f"{r}-0") in cluster.held(h) for h in range(NODES) if h != r)
        for r in range(NODES)
    )


def saving(cluster: Cluster, step: int) -> list[Path]:
    """Every rank's trainer starts writing ``step`` (the Orbax way: a temp directory)."""
    dirs = [d / f"{step}.orbax-checkpoint-tmp-1700000000" for d in cluster.dirs]
    for d in dirs:
        d.mkdir()
        (d / "partial").write_bytes(b"x" * 4096)
    return dirs


def test_a_save_in_progress_holds_replication_until_it_ends_or_the_bound(
    cluster: Cluster,
) -> None:
    # A save of step 2 is under way when step 1 is handed over: step 1 is committed at
    # home at once, but its pushes wait for the save (here: for the bound).
    saving(cluster, 2)
    time.sleep(1.0)  # every daemon's scan has seen the save
    t0 = time.monotonic()
    cluster.write_step(1)
    cluster.wait_saved(1, copies=False)
    time.sleep(1.5)
    assert peer_copies(cluster, 1) == 0, "replication went ahead during the save"
    wait_until(lambda: peer_copies(cluster, 1) == NODES, "step 1 replicated", timeout=30)
    held = time.monotonic() - t0
    assert held >= HOLD - 1.5, f"replicated after {held:.1f}s: the save's hold was not kept"

    # A save that ends releases at once: no waiting for the bound.
    for d in cluster.dirs:
        (d / "2.orbax-checkpoint-tmp-1700000000" / "partial").unlink()
        (d / "2.orbax-checkpoint-tmp-1700000000").rmdir()
    time.sleep(1.0)  # the save is over everywhere
    tmp = saving(cluster, 4)
    time.sleep(1.0)
    t1 = time.monotonic()
    cluster.write_step(3)
    cluster.wait_saved(3, copies=False)
    for d in tmp:
        d.rename(d.with_name("4"))  # published: the save is over
    wait_until(lambda: peer_copies(cluster, 3) == NODES, "step 3 replicated", timeout=30)
    released = time.monotonic() - t1
    assert released < HOLD - 1.0, f"replicated only after {released:.1f}s: the end was missed"
