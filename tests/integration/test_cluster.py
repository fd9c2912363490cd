"""Four real daemons on loopback: restore rounds, peer replication, restore from a peer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.cluster import NODES, Cluster, assert_restored
from tests.integration.helpers import (
    ERRORS,
    backup_commits,
    item_dir,
    make_step,
    payload,
    read_prerestore,
    read_tree,
    wait_until,
)
from tests.proc import cpu_seconds
from tests.tls import operator_flags

pytestmark = pytest.mark.integration


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
    cluster.clear(2)
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


def test_all_local_copies_intact_restore_locally(cluster: Cluster) -> None:
    cluster.fresh_start()
    cluster.save(3)
    files = cluster.save(5)
    cluster.handshake([1, 0, 3, 2])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    assert [cluster.source(r) for r in range(NODES)] == ["local"] * NODES


def test_every_node_wiped_restores_from_the_backup(cluster: Cluster) -> None:
    cluster.keys["backup_interval_steps"] = 1
    cluster.fresh_start()
    cluster.save(3)
    files = cluster.save(5)
    cluster.wait_backup(5)
    cluster.wipe_all()
    cluster.handshake([2, 3, 0, 1])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    assert [cluster.source(r) for r in range(NODES)] == ["backup"] * NODES


def test_two_nodes_lost_the_layout_still_covers_restore_from_peers(cluster: Cluster) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    holder = {r: cluster.holder(r, 5) for r in range(NODES)}
    lost = next(
        (a, b)
        for a in range(NODES)
        for b in range(a + 1, NODES)
        if holder[a] not in (a, b) and holder[b] not in (a, b)
    )
    for r in lost:
        cluster.wipe(r)
    cluster.handshake([0, 1, 2, 3])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    for r in range(NODES):
        assert cluster.source(r) == ("peer" if r in lost else "local"), r


def test_two_nodes_lost_the_layout_does_not_cover_an_older_backup(cluster: Cluster) -> None:
    # The first complete step goes to the backup at once; the next not (interval 100 steps).
    cluster.fresh_start()
    old = cluster.save(3)
    cluster.wait_backup(3)
    cluster.save(5)
    assert 5 not in backup_commits(cluster.backup, cluster.job)
    # Rank 1 and the holder of its only copy: its step 5 is gone from the cluster.
    lost = (1, cluster.holder(1, 5))
    for r in lost:
        cluster.wipe(r)
    cluster.handshake([3, 2, 1, 0])
    cluster.wait_markers(3)
    assert_restored(cluster, 3, old)
    for r in lost:
        assert cluster.source(r) == "backup"


def test_data_parallelism_restores_from_the_equivalent_and_one_replica_uploads(
    cluster: Cluster,
) -> None:
    # Replicas {0, 1} and {2, 3}: rank 2's equivalent is rank 0, rank 3's is rank 1.
    cluster.keys["assume_data_parallelism"] = 2
    cluster.fresh_start()
    files = cluster.save(5, copies=False)
    cluster.wait_backup(5)  # the first complete step goes to the backup at once
    uploaded = {
        p.name.removesuffix(".manifest.json")
        for p in (cluster.backup / cluster.job / "5").glob("*/*.manifest.json")
    }
    assert uploaded == {"0-0", "1-0"}, "only replica 0 uploads"

    cluster.wipe(2)
    cluster.handshake([2, 0, 3, 1])
    cluster.wait_markers(5)
    marker = cluster.restored(2, 5)
    assert "0-0" in Path(os.readlink(marker)).parts, os.readlink(marker)
    assert read_tree(marker) == files[0], "rank 2 restored other bytes than its equivalent's"
    for r in (0, 1, 3):
        assert read_tree(cluster.restored(r, 5)) == files[r]
        assert cluster.source(r) == "local"


def test_a_flipped_byte_in_the_peer_copy_is_detected(cluster: Cluster) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    cluster.wait_backup(5)
    owner = 1
    holder = cluster.holder(owner, 5)
    cluster.daemon(owner).kill()
    cluster.clear(owner)
    copy = item_dir(cluster.dirs[holder], cluster.job, 5, owner) / "data" / "state/array_0.bin"
    with open(copy, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    cluster.start(owner)
    cluster.handshake([0, 1, 2, 3])
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    # Another source (the backup or another live copy) served it; the workload is told.
    errors = cluster.errors(owner)
    assert re.search(rf"step 5: peer copy of \S+/s5/n{owner}-w0 is corrupt", errors), errors


@pytest.mark.parametrize("cluster_extra", [("--report-after-seconds", "1")])
def test_a_rank_that_never_joins_is_named_in_the_errors(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.handshake([0, 1, 2])
    for r in (0, 1, 2):
        wait_until(
            lambda r=r: "waiting for rank 3 of job" in cluster.errors(r),
            f"rank {r}'s {ERRORS} naming rank 3",
            daemon=cluster.daemon(r),
            timeout=8,
        )
    assert time.monotonic() - t0 < 15
    cluster.handshake([3])
    cluster.wait_markers(0)


@pytest.mark.parametrize(
    "order", [[0, 1, 2, 3], [1, 2, 3, 0], [2, 0, 3, 1]], ids=["first", "last", "interleaved"]
)
def test_restart_orderings_converge_on_one_round(cluster: Cluster, order: list[int]) -> None:
    cluster.fresh_start()
    files = cluster.save(5)
    cluster.handshake(order, max_delay=0.5)
    cluster.wait_markers(5)
    assert_restored(cluster, 5, files)
    for r in range(NODES):
        assert cluster.source(r) == "local"

        def rounds(r: int = r) -> list[str]:
            return re.findall(r"restore round done: step=(\S+)", cluster.daemon(r).log())

        # The line is logged just after the markers appear: wait for it, then check them all.
        wait_until(lambda: len(rounds()) >= 2, f"rank {r}'s second round", daemon=cluster.daemon(r))
        assert rounds() == ["None", "5"], f"rank {r}: {rounds()}"


def test_mtc_backups_restore_pins_the_next_round_to_an_older_backup(cluster: Cluster) -> None:
    cluster.keys["backup_interval_steps"] = 1
    cluster.fresh_start()
    old = cluster.save(3)
    cluster.wait_backup(3)
    cluster.save(5)
    cluster.wait_backup(5)
    mtc = [sys.executable, "-m", "mtc_replicator.tools.cli", "backups", "restore"]
    args = [cluster.backup.as_uri(), "--job", cluster.job, "--step", "3", "--yes"]
    if cluster.ca is not None:  # daemons with TLS honour only an operator's signed pin
        args += operator_flags(cluster.root / "operator", cluster.ca)
    done = subprocess.run([*mtc, *args], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cluster.handshake([1, 2, 3, 0])
    cluster.wait_markers(3)
    assert_restored(cluster, 3, old)
    # The pin served its round and is gone: the next restart is the usual last-known-good.
    wait_until(
        lambda: not (cluster.backup / "_control" / cluster.job / "restore-pin.json").exists(),
        "the used pin removed",
        daemon=cluster.daemon(0),
    )


@pytest.mark.parametrize("cluster_extra", [("--rescan-seconds", "2")])
def test_idle_daemons_in_steady_state_use_under_10_percent_of_a_core(cluster: Cluster) -> None:
    # Replicated, reported, nothing to do: what each daemon costs a training node at rest,
    # at the default rescan (2 s). Earlier boxes measured under 2% a daemon even with the
    # tests' 0.3 s rescans; this one (2026-11-28) 5-9% with those and 3-4.5% at 2 s, on the
    # commit before that day's work as well, nearly all of it in gRPC's and TLS's C threads
    # (py-spy: Python held the GIL about 2% of the time). The bound is for what the test
    # is for: a pass that wakes itself again, a busy loop, costs most of a core.
    cluster.fresh_start()
    cluster.save(5)
    time.sleep(2)
    pids = [cluster.daemon(r).pid for r in range(NODES)]
    before = [cpu_seconds(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(10)
    elapsed = time.monotonic() - t0
    shares = [(cpu_seconds(p) - b) / elapsed for p, b in zip(pids, before, strict=True)]
    assert max(shares) < 0.10, shares


@pytest.mark.parametrize(
    ("cluster_extra", "kept"),
    [((), (25, 30)), (("--keep-steps", "3"), (20, 25, 30))],
    ids=["default", "keep-steps-3"],
)
def test_each_node_keeps_its_newest_steps_and_its_peers_copies_of_them(
    cluster: Cluster, kept: tuple[int, ...]
) -> None:
    """What docs/deploy.md's RAM disk sizing counts (K own steps, K copies per peer): in
    steady state a multi-node job keeps its newest two steps (the safety rules' minimum)
    and its peer's copies of them; ``--keep-steps 3`` keeps three of each."""
    cluster.fresh_start()
    for step in (5, 10, 15, 20, 25, 30):
        cluster.save(step)

    def layout(r: int) -> tuple[set[int], set[tuple[int, str]]]:
        held = cluster.held(r)
        own = {s for s, item in held if item == f"{r}-0"}
        return own, {(s, item) for s, item in held if item != f"{r}-0"}

    for r in range(NODES):
        (pusher,) = {item for _, item in layout(r)[1]} or {"none"}
        want = (set(kept), {(s, pusher) for s in kept})
        wait_until(lambda r=r, want=want: layout(r) == want, f"rank {r} keeps {kept}",
                   daemon=cluster.daemon(r))  # fmt: skip
