"""Chaos in the suite: a few fixed seeds of the harness, and the scenarios issue 23 found.

Each trial runs four real daemons (mutual TLS, a RAM disk each, a network namespace each
where ``ip netns`` works) and checks the invariants of ``tests/chaos/harness.py`` at every
job restart. ``make chaos`` runs 100 seeds; a failure here prints the command that replays
its seed alone.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.tools import certs
from tests.chaos import network
from tests.chaos.__main__ import BACKENDS, report
from tests.chaos.harness import MARKER_BOUND, Trial
from tests.chaos.nodes import Servers
from tests.chaos.plan import Epoch, Fault, Plan, make_plan
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import NODES
from tests.integration.helpers import (
    FAST_ARGS,
    backup_commits,
    config_text,
    make_step,
    payload,
    ram_disk,
    read_tree,
    stored_steps,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import node_tls

pytestmark = pytest.mark.integration

NETNS = network.available()
DEFAULT_RESCAN = ("--rescan-seconds", "2")
"""The daemon's default, in place of the fast timers' 0.3 s."""
SEEDS = (12, 22, 35)
"""Between them: S3 resets and a cut to the coordinator, then rank 0's daemon killed in the
round (12); a full ``file://`` disk, rank 0 cut off from its peers in the round, a lost
node, a kill in the round, a torn save (22); GCS cut bodies, an isolated node, kills, a cut
to the coordinator (35). About 20-25 s each on this 2-core box."""


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("chaos-servers"))
    try:
        yield s
    finally:
        s.close()


def _run(
    plan: Plan, root: Path, servers: Servers, *, bound: float = MARKER_BOUND, known: str = ""
) -> None:
    """Run one trial. A failure that shows issue 23's wedge, or ``known`` in its message, is
    an AssertionError (what the known-bug marks expect); any other a plain test failure."""
    print("\n".join(plan.describe()))
    trial = Trial(plan, root / f"seed-{plan.seed}", servers, netns=NETNS, marker_bound=bound)
    result = trial.run()
    if not result.ok and not result.known and not (known and known in result.message):
        pytest.fail(report(result))
    assert result.ok, report(result)
    assert result.steps_lost == 0


def test_a_plan_is_its_seed() -> None:
    """Replaying a seed replays its plan (the timing around it aside)."""
    every = ("file", "full", "s3", "gcs")
    one = make_plan(42, nodes=NODES, netns=True, backends=every)
    assert one == make_plan(42, nodes=NODES, netns=True, backends=every)
    assert one != make_plan(43, nodes=NODES, netns=True, backends=every)
    plans = [make_plan(s, nodes=NODES, netns=True, backends=every) for s in range(100)]
    kinds = {f.kind for p in plans for e in p.epochs for f in e.faults}
    assert kinds == {"kill", "lose", "isolate", "cut-coordinator", "cut-peers", "store"}
    modes = {f.mode for p in plans for e in p.epochs for f in e.faults if f.kind == "store"}
    assert modes == {"slowdown", "reset", "cut", "latency", "full"}
    assert any(f.rank == 0 and f.kind == "kill" for p in plans for e in p.epochs for f in e.faults)


@pytest.mark.parametrize("seed", SEEDS)
def test_seed(seed: int, tmp_path: Path, servers: Servers) -> None:
    _run(make_plan(seed, nodes=NODES, netns=NETNS, backends=BACKENDS), tmp_path, servers)


ISSUE_23 = (
    Fault("kill", 0, after_save=1, delay=0.2, duration=0.5),  # step 20: rank 0's daemon
    Fault("lose", 1, after_save=2, delay=0.2, duration=0.5),  # step 30: node 1's RAM disk
)
"""Issue 23's wedge: a job saving every 10 steps; rank 0's daemon SIGKILLed at step 20 and
restarted while the job trains on; node 1 lost at step 30; the whole job restarts at once."""
WEDGE_BOUND = 30.0
"""Seconds for the markers in these scenarios (tiny steps, no fault in the round)."""


def test_rank0_daemon_restarted_then_node_lost_then_job_restart(
    tmp_path: Path, servers: Servers
) -> None:
    """With the daemons' default rescan (2 s): rank 0's new incarnation finds a step in
    CHECKPOINT_DIR that its resumed one had not taken yet, ingests it and reports it before
    it joins; the restarted coordinator adopts that report as the old run's, and refuses
    every join of it (a warning each, no backoff) while rank 0's daemon spins."""
    plan = Plan(1_000_001, "file", 100, (Epoch(3, ISSUE_23, 0.0),), flags=DEFAULT_RESCAN)
    _run(plan, tmp_path, servers, bound=WEDGE_BOUND)


def test_rank0_daemon_restarted_then_node_lost_then_job_restart_fast_rescan(
    tmp_path: Path, servers: Servers
) -> None:
    """The same with a 0.3 s rescan restores: the resumed incarnation takes the step first."""
    plan = Plan(1_000_002, "file", 100, (Epoch(3, ISSUE_23, 0.0),))
    _run(plan, tmp_path, servers, bound=WEDGE_BOUND)


def test_rank0_daemon_restarted_while_the_registry_is_full(
    tmp_path: Path, servers: Servers
) -> None:
    """Rank 0's daemon killed while the ``file://`` backup, its registry too, is full (found
    by ``make chaos``, seed 90): on restart it re-claims the job's registry entry to resume,
    and the write fails with ENOSPC until the disk has room. It waits for the store, as the
    uploads do, instead of exiting 1 with a traceback."""
    full = Fault("store", -1, after_save=0, delay=0.0, duration=6.0, mode="full")
    kill0 = Fault("kill", 0, after_save=0, delay=0.5, duration=0.5)
    plan = Plan(1_000_003, "full", 1, (Epoch(2, (full, kill0), 0.0),))
    _run(plan, tmp_path, servers, known="daemon exited with 1")


def test_a_restored_step_is_backed_up(tmp_path: Path) -> None:
    """One node, ``backup-interval-steps: 1``, uploads slowed to 64 KiB/s: steps 10, 20,
    30 saved; the job restarts at once, while a backup ordered to the old incarnation is
    still uploading, and restores 30 from the local tier. Step 30 must reach the bucket
    without a further save: a RAM disk lost now would otherwise lose steps 20-30."""
    job = "restored-step"
    backup = tmp_path / "backup"
    backup.mkdir()
    tls = node_tls(tmp_path / "tls", certs.new_ca())
    with ram_disk(tmp_path / "ram", "64m") as ckpt:
        daemon = DaemonProcess(
            ckpt,
            backup=backup.as_uri(),
            extra_args=(*FAST_ARGS, *tls.args(), "--max-transfer-rate", "64KiB"),
        ).start()
        try:
            text = config_text(job, backup_interval_steps=1)
            write_yaml_atomic(ckpt, text)
            os.unlink(wait_markers(ckpt, job, 0, daemon)[0])
            files = {}
            for step in (10, 20, 30):
                files[step] = payload(step, size=192 << 10)  # 3 s each at 64 KiB/s
                make_step(ckpt, step, files[step])
            wait_until(lambda: 30 in stored_steps(ckpt, job), "step 30 taken", daemon=daemon)
            write_yaml_atomic(ckpt, text)  # the trainer restarts at once
            (marker,) = wait_markers(ckpt, job, 30, daemon)
            assert read_tree(marker) == files[30]
            wait_until(
                lambda: 30 in backup_commits(backup, job),
                "the restored step 30 backed up",
                daemon=daemon,
                timeout=20,  # 10 s with the fix, steps 10-30 uploaded in turn
            )
        finally:
            daemon.stop()
