"""The Ray checkpointer's plumbing that needs neither Ray nor torch: how a failure on one
worker reaches every worker, and the worker places it gathers."""

from __future__ import annotations

import pytest

from mtc_replicator.client.handshake import HandshakeError
from mtc_replicator.client.ray_train import (
    RayCheckpointer,
    SharedNodes,
    _all_or_none,
    _encode_place,
    _place,
    _resolve_dir,
)
from mtc_replicator.core.raytrain import RayTrainRefused, WorkerPlace


def test_a_refusal_reaches_the_caller_as_its_own_class_naming_the_worker() -> None:
    def refuse() -> None:
        raise SharedNodes("the replicator at /ckpt serves job 'a'")

    with pytest.raises(SharedNodes, match=r"^worker 0: the replicator at /ckpt serves job 'a'$"):
        _all_or_none(None, refuse)


def test_any_other_failure_becomes_a_handshake_error_with_its_type() -> None:
    def fail() -> None:
        raise TimeoutError("no restore marker")

    with pytest.raises(HandshakeError, match=r"worker 0: TimeoutError: no restore marker"):
        _all_or_none(None, fail)


def test_results_come_back_in_rank_order() -> None:
    assert _all_or_none(None, lambda: 7) == [7]


def test_places_travel_as_text_and_bad_text_is_refused() -> None:
    place = WorkerPlace(world_rank=5, local_rank=1, local_world_size=2, node_rank=2)
    assert _place(_encode_place(place)) == place
    with pytest.raises(ValueError, match="not a worker place"):
        _place("5,1,2")


def test_the_checkpoint_dir_comes_from_the_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MTC_CHECKPOINT_DIR", raising=False)
    with pytest.raises(RayTrainRefused, match="set MTC_CHECKPOINT_DIR"):
        _resolve_dir(None)
    monkeypatch.setenv("MTC_CHECKPOINT_DIR", "/ckpt")
    assert str(_resolve_dir(None)) == "/ckpt"
    assert str(_resolve_dir(lambda: "/node-a")) == "/node-a"


def test_arguments_are_checked_and_save_needs_a_restore_first() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        RayCheckpointer(mode="sharded")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ray_checkpoint_every"):
        RayCheckpointer(ray_checkpoint_every=-1)
    with pytest.raises(RuntimeError, match=r"call restore\(\) first"):
        RayCheckpointer().save(1, {})
