"""The Ray checkpointer's plumbing that needs neither Ray nor torch: how a failure on one
worker reaches every worker, the worker places it gathers, the node's claim (real files in a
temporary CHECKPOINT_DIR) and the checkpoint a restore is asked to continue from."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from mtc_replicator.client import load_state_dict
from mtc_replicator.client.handshake import HandshakeError
from mtc_replicator.client.ray_collectives import all_or_none, decode_place, encode_place
from mtc_replicator.client.ray_train import (
    CLAIM_FILE,
    RAY_META_FILE,
    ElasticWorkers,
    ForeignCheckpoint,
    RayCheckpointer,
    SharedNodes,
    _handed_step,
    _read_claim,
    _resolve_dir,
    _Session,
)
from mtc_replicator.core.raytrain import Claim, RayTrainRefused, WorkerPlace, layout_of


def test_a_refusal_reaches_the_caller_as_its_own_class_naming_the_worker() -> None:
    def refuse() -> None:
        raise SharedNodes("the replicator at /ckpt serves job 'a'")

    with pytest.raises(SharedNodes, match=r"^worker 0: the replicator at /ckpt serves job 'a'$"):
        all_or_none(None, refuse)


def test_any_other_failure_becomes_a_handshake_error_with_its_type() -> None:
    def fail() -> None:
        raise TimeoutError("no restore marker")

    with pytest.raises(HandshakeError, match=r"worker 0: TimeoutError: no restore marker"):
        all_or_none(None, fail)


def test_results_come_back_in_rank_order() -> None:
    assert all_or_none(None, lambda: 7) == [7]


def test_places_travel_as_text_and_bad_text_is_refused() -> None:
    place = WorkerPlace(world_rank=5, local_rank=1, local_world_size=2, node_rank=2)
    assert decode_place(encode_place(place)) == place
    with pytest.raises(ValueError, match="not a worker place"):
        decode_place("5,1,2")


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


def _session(
    tmp_path: Path, job: str = "trial-a", **options: Any
) -> tuple[RayCheckpointer, _Session]:
    """A checkpointer past its handshake on a one-worker node (local rank 0, which writes
    the node's claim), with no Ray: what restore() leaves behind."""
    place = WorkerPlace(world_rank=0, local_rank=0, local_world_size=1, node_rank=0)
    ckpt = RayCheckpointer(tmp_path, **options)
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


def test_every_save_renews_the_claim_a_skipped_one_too(tmp_path: Path) -> None:
    """``save`` alone keeps the node's claim (no ``report`` needed): also when the save is
    skipped because the previous one is still being written."""
    torch = pytest.importorskip("torch")
    from mtc_replicator.client.async_save import AsyncSaver

    release = threading.Event()

    def hold(phase: str) -> None:
        if phase == "write" and threading.current_thread() is not threading.main_thread():
            assert release.wait(30)

    ckpt, session = _session(tmp_path, when_busy="skip")
    ckpt._saver = AsyncSaver(tmp_path, when_busy="skip", phase_hook=hold)
    try:
        assert ckpt.save(1, {"w": torch.zeros(4)}) is not None
        stale = Claim("trial-a", 1, 1234.0, holder=session.holder)
        (tmp_path / CLAIM_FILE).write_text(json.dumps(stale.to_json()))
        assert ckpt.save(2, {"w": torch.ones(4)}) is None  # skipped: step 1 is being written
        claim = _read_claim(tmp_path)
        assert claim is not None
        assert claim.at > stale.at
    finally:
        release.set()
        ckpt.close()


class _Reports:
    """Stands in for ``ray.train.report``: what each report handed Ray, the checkpoint's
    files read before ``report`` deletes its temporary directory."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], dict[str, Any] | None]] = []

    def __call__(self, metrics: dict[str, Any], checkpoint: Any = None) -> None:
        files = None
        if checkpoint is not None:
            path = Path(checkpoint.path)
            files = {
                "meta": json.loads((path / RAY_META_FILE).read_text()),
                "state": load_state_dict(path / "rank-0.pt"),
            }
        self.seen.append((metrics, files))


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_later_report_writes_the_newest_save_as_it_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """Saves at steps 1 and 2, a step trained without a save, then a report: its Ray
    checkpoint holds step 2's tensors (and the values beside them), not the live ones."""
    torch = pytest.importorskip("torch")
    import ray.train

    reports = _Reports()
    monkeypatch.setattr(ray.train, "report", reports)
    ckpt, _ = _session(tmp_path, ray_checkpoint_every=2, asynchronous=asynchronous)
    live: dict[str, Any] = {"w": torch.zeros(1000), "lr": 0.1}
    for step in (1, 2, 3):
        live["w"].add_(1)
        live["lr"] /= 2
        if step < 3:
            ckpt.save(step, live)
    ckpt.report({"step": 3})
    ckpt.report({"step": 4})  # no save since: metrics only
    ckpt.close()
    assert [m for m, _ in reports.seen] == [{"step": 3}, {"step": 4}]
    files = reports.seen[0][1]
    assert files is not None
    assert files["meta"]["step"] == 2
    assert torch.equal(files["state"]["w"], torch.full((1000,), 2.0))
    assert files["state"]["lr"] == 0.025
    assert reports.seen[1][1] is None


def test_a_ray_checkpoint_without_a_copy_of_the_newest_save_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Synchronous saves keep a copy only with ``ray_checkpoint_every`` set, and
    ``close()`` frees it: a Ray checkpoint asked for without it says so."""
    torch = pytest.importorskip("torch")
    import ray.train

    reports = _Reports()
    monkeypatch.setattr(ray.train, "report", reports)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    ckpt, _ = _session(tmp_path / "a", asynchronous=False)
    ckpt.report({"step": 0}, ray_checkpoint=True)  # nothing saved yet: metrics only
    ckpt.save(1, {"w": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="only with ray_checkpoint_every > 0"):
        ckpt.report({"step": 1}, ray_checkpoint=True)
    late, _ = _session(tmp_path / "b", ray_checkpoint_every=1)
    late.save(1, {"w": torch.zeros(4)})
    late.close()
    with pytest.raises(RuntimeError, match=r"report before close\(\)"):
        late.report({"step": 1})
    assert reports.seen == [({"step": 0}, None)]


@pytest.mark.parametrize("mode", ["files", "dcp"])
def test_a_synchronous_saves_host_copy_keeps_the_state_at_the_save(mode: str) -> None:
    """What Ray's checkpoint of a synchronous save is written from (``dcp``: DCP's stager)."""
    torch = pytest.importorskip("torch")
    from mtc_replicator.client.ray_checkpoint import HostCopy

    copy = HostCopy(mode)
    live = {"w": torch.arange(10.0), "opt": {"lr": 0.1, "m": torch.ones(3)}}
    for step in (1, 2):
        staged = copy.take(step, live)
        live["w"].add_(100)
        live["opt"]["m"].zero_()
        live["opt"]["lr"] = 0.5
        staged.ready()
        assert staged.step == step
        assert torch.equal(staged.tree["w"], live["w"] - 100)
        assert torch.equal(staged.tree["opt"]["m"], torch.ones(3) if step == 1 else torch.zeros(3))
        assert staged.tree["opt"]["lr"] == (0.1 if step == 1 else 0.5)
    copy.release()
