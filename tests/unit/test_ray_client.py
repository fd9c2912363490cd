"""The Ray checkpointer's plumbing that needs neither Ray nor torch: how a failure on one
worker reaches every worker, the worker places it gathers, the node's claim (real files in a
temporary CHECKPOINT_DIR) and the checkpoint a restore is asked to continue from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from mtc_replicator.client.handshake import HandshakeError
from mtc_replicator.client.ray_train import (
    CLAIM_FILE,
    RAY_META_FILE,
    ElasticWorkers,
    ForeignCheckpoint,
    RayCheckpointer,
    SharedNodes,
    _all_or_none,
    _encode_place,
    _handed_step,
    _place,
    _read_claim,
    _resolve_dir,
    _Session,
)
from mtc_replicator.core.raytrain import Claim, RayTrainRefused, WorkerPlace, layout_of


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


def _session(tmp_path: Path, job: str = "trial-a") -> tuple[RayCheckpointer, _Session]:
    """A checkpointer past its handshake on a one-worker node (local rank 0, which writes
    the node's claim), with no Ray: what restore() leaves behind."""
    place = WorkerPlace(world_rank=0, local_rank=0, local_world_size=1, node_rank=0)
    ckpt = RayCheckpointer(tmp_path)
    session = _Session(ckpt, tmp_path, place, layout_of([place], 1), job, None, None)
    ckpt._session = session
    session.write_claim()
    return ckpt, session


def test_close_releases_the_claim_this_incarnation_wrote(tmp_path: Path) -> None:
    ckpt, session = _session(tmp_path)
    claim = _read_claim(tmp_path)
    assert claim is not None
    assert (claim.job, claim.holder) == ("trial-a", session.holder)
    ckpt.close()
    assert not (tmp_path / CLAIM_FILE).exists()
    ckpt.close()  # twice: nothing left to release, no error


@pytest.mark.parametrize("job", ["trial-b", "trial-a"])
def test_close_leaves_a_claim_someone_else_wrote_since(tmp_path: Path, job: str) -> None:
    """Another job took the node after this claim's lease ran out, or another incarnation
    of the same job did (Ray restarted its workers): their claim stays."""
    ckpt, _ = _session(tmp_path)
    theirs = Claim(job, 1, 1234.0, holder="someone-else")
    (tmp_path / CLAIM_FILE).write_text(json.dumps(theirs.to_json()))
    ckpt.close()
    assert _read_claim(tmp_path) == theirs


def test_a_with_block_releases_on_its_normal_end_and_keeps_the_claim_on_an_error(
    tmp_path: Path,
) -> None:
    ok, failed = tmp_path / "ok", tmp_path / "failed"
    ok.mkdir()
    failed.mkdir()
    with _session(ok)[0]:
        pass
    assert not (ok / CLAIM_FILE).exists()
    with pytest.raises(RuntimeError, match="boom"), _session(failed)[0]:
        raise RuntimeError("boom")
    assert (failed / CLAIM_FILE).exists()  # Ray restarts the job's workers on these nodes


class _Checkpoint:
    """What restore reads of a ray.train.Checkpoint: its path and filesystem (a local one)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.filesystem = self

    def open_input_stream(self, path: str) -> BinaryIO:
        return open(path, "rb")


def _ray_checkpoint(tmp_path: Path, **meta: Any) -> _Checkpoint:
    path = tmp_path / "checkpoint_000001"
    path.mkdir()
    (path / RAY_META_FILE).write_text(json.dumps(meta))
    return _Checkpoint(path)


def test_a_restore_continues_from_its_own_jobs_checkpoint(tmp_path: Path) -> None:
    handed = _ray_checkpoint(tmp_path, step=6, mode="files", job="sweep-b", **{"world-size": 2})
    assert _handed_step(handed, "sweep-b", 2) == 6
    with pytest.raises(ElasticWorkers, match="saved with 2 workers and now runs 4"):
        _handed_step(handed, "sweep-b", 4)


def test_a_restore_asked_to_continue_from_another_jobs_checkpoint_is_refused(
    tmp_path: Path,
) -> None:
    handed = _ray_checkpoint(tmp_path, step=6, mode="files", job="sweep-a", **{"world-size": 2})
    with pytest.raises(ForeignCheckpoint, match="job 'sweep-b' was asked to continue from job"):
        _handed_step(handed, "sweep-b", 2)
    with pytest.raises(ForeignCheckpoint, match=r"RayCheckpointer\.report did not write"):
        _handed_step(_Checkpoint(tmp_path / "elsewhere"), "sweep-b", 2)


def test_a_checkpoint_to_continue_from_must_be_a_ray_checkpoint() -> None:
    with pytest.raises(TypeError, match=r"wrap a path as ray.train.Checkpoint\(path\)"):
        RayCheckpointer().restore(checkpoint="/s/sweep-a/checkpoint_000001")
