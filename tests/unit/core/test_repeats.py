"""``core.repeats``: a handshake for the job and rank already served, judged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtc_replicator.client import job_config
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.repeats import (
    CLIENT_DEADLINE,
    Repeat,
    Serving,
    differences,
    judge_repeat,
)


def config(**fields: object) -> JobConfig:
    base: dict[str, object] = {
        "job_name": "llama",
        "framework": "pytorch.distributed",
        "node_rank": 0,
        "nodes": 1,
    }
    if "backup_interval_steps" not in fields:
        base["backup_interval_minutes"] = 30
    return job_config(**{**base, **fields})  # type: ignore[arg-type]


def serving(cfg: JobConfig, **state: object) -> Serving:
    base = Serving(cfg, alive=True, restoring=False, accepted_for=1.0)
    return replace(base, **state)  # type: ignore[arg-type]


ONE = config()
TWO = config(nodes=2, peers_per_node=1)


def test_nothing_served_or_a_dead_incarnation_means_a_new_start() -> None:
    assert judge_repeat(None, ONE) is Repeat.NEW
    assert judge_repeat(serving(ONE, alive=False, restoring=True), ONE) is Repeat.NEW


def test_another_job_or_rank_is_a_new_start() -> None:
    assert judge_repeat(serving(ONE, restoring=True), config(job_name="other")) is Repeat.NEW
    two = serving(TWO, restoring=True)
    assert judge_repeat(two, config(nodes=2, node_rank=1, peers_per_node=1)) is Repeat.NEW


@pytest.mark.parametrize("cfg", [ONE, TWO], ids=["one-node", "two-nodes"])
def test_the_same_config_during_the_restore_is_the_same_start(cfg: JobConfig) -> None:
    state = serving(cfg, restoring=True, accepted_for=CLIENT_DEADLINE * 3)
    assert judge_repeat(state, cfg) is Repeat.SAME


def test_after_the_markers_the_same_config_is_a_restart_even_before_a_save() -> None:
    """The contract's rule: an operator's restore pin waits for exactly such a restart."""
    assert judge_repeat(serving(ONE), ONE) is Repeat.NEW


def test_after_the_markers_a_job_of_several_nodes_starts_anew() -> None:
    """A restart there is every node's: this rank must join the next round."""
    assert judge_repeat(serving(TWO), TWO) is Repeat.NEW


def test_another_config_during_the_restore_is_a_conflict_while_a_client_may_wait() -> None:
    other = config(backup_interval_minutes=5)
    assert judge_repeat(serving(ONE, restoring=True), other) is Repeat.CONFLICT
    late = serving(ONE, restoring=True, accepted_for=CLIENT_DEADLINE)
    assert judge_repeat(late, other) is Repeat.NEW, "nobody waits for the first any more"
    assert judge_repeat(serving(ONE), other) is Repeat.NEW, "after the markers: a restart"


def test_the_differences_name_each_key_both_ways() -> None:
    assert differences(ONE, ONE) == []
    steps = config(nodes=2, peers_per_node=1, backup_interval_steps=10)
    assert differences(ONE, steps) == [
        "nodes: 1 -> 2",
        "peers-per-node: 0 -> 1",
        "backup-interval-minutes: 30 -> (none)",
        "backup-interval-steps: (none) -> 10",
    ]
