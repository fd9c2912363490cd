"""The client's PyTorch helpers: atomic step publication, ``.save`` files and DCP."""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.client import (
    RestoreResult,
    load_distributed,
    load_state_dict,
    node_process_group,
    save_distributed,
    save_file,
    save_state_dict,
    share_restore,
    torch_io,
)
from mtc_replicator.core import contract
from tests.torch_trees import assert_same, zeros_like

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
CheckpointException = pytest.importorskip("torch.distributed.checkpoint").CheckpointException


def state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model": {
            "weight": torch.randn(4, 3, generator=generator),
            "bias": torch.arange(3, dtype=torch.float64),
        },
        "step": 7,
    }


def ingest_and_mark(ckpt: Path, step: int) -> Path:
    """Play the daemon and Orbax-style client: move ``<N>`` into the store, link it back."""
    store = ckpt / contract.STORE_DIR / "job" / str(step)
    store.parent.mkdir(parents=True)
    os.rename(ckpt / str(step), store)
    os.symlink(os.path.relpath(store, ckpt), ckpt / str(step))
    return ckpt / str(step)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


# --- torch.save of a state dict --------------------------------------------------------------


def test_save_then_load_round_trips_through_a_restore_symlink(ckpt: Path) -> None:
    saved = state()

    path = save_state_dict(ckpt, 7, saved)

    assert path == ckpt / "7"
    assert path.is_dir()
    assert not path.is_symlink()
    assert os.listdir(ckpt) == ["7"]  # No temp dir left behind.
    assert os.listdir(path) == ["state.pt"]
    restored = ingest_and_mark(ckpt, 7)
    assert_same(load_state_dict(restored), saved)


def test_a_failing_save_leaves_no_step_visible(ckpt: Path) -> None:
    broken = {**state(), "callback": lambda: None}  # Pickling fails mid-way through the file.

    with pytest.raises(AttributeError, match="pickle"):
        save_state_dict(ckpt, 7, broken)

    assert os.listdir(ckpt) == []


def test_a_temp_dir_of_an_interrupted_save_is_replaced(ckpt: Path) -> None:
    leftover = ckpt / "step=7-unfinished"
    leftover.mkdir()
    (leftover / "half-written").write_bytes(b"\0" * 10)

    path = save_state_dict(ckpt, 7, state(), filename="model.pt")

    assert sorted(os.listdir(ckpt)) == ["7"]
    assert os.listdir(path) == ["model.pt"]
    assert_same(load_state_dict(path, filename="model.pt"), state())


def test_a_step_is_never_saved_over_an_existing_name(ckpt: Path) -> None:
    os.symlink(".mtc/job/7", ckpt / "7")  # A renamed restore marker of the same step.

    with pytest.raises(FileExistsError):
        save_state_dict(ckpt, 7, state())

    assert os.readlink(ckpt / "7") == ".mtc/job/7"
    assert os.listdir(ckpt) == ["7"]


@pytest.mark.parametrize("step", [-1, True, "7"])
def test_a_bad_step_is_rejected(ckpt: Path, step: Any) -> None:
    with pytest.raises(ValueError, match="step"):
        save_state_dict(ckpt, step, state())
    assert os.listdir(ckpt) == []


def test_loading_something_else_than_a_state_dict_fails_clearly(ckpt: Path) -> None:
    torch.save([torch.zeros(1)], ckpt / "list.pt")

    with pytest.raises(TypeError, match="not a state dict"):
        load_state_dict(ckpt / "list.pt")


def _zip_crcs_hold(path: Path) -> bool:
    with zipfile.ZipFile(path) as archive:
        return archive.testzip() is None


@pytest.mark.parametrize("kind", ["step", "file"])
def test_saves_skip_the_zip_crc32_that_torch_load_never_checks(ckpt: Path, kind: str) -> None:
    def save(step: int, **options: Any) -> Path:
        if kind == "step":
            return save_state_dict(ckpt, step, state(), **options) / "state.pt"
        return save_file(ckpt, step, state(), job="llama", rank=0, worker=0, **options)

    fast, checked = save(1), save(2, zip_crc32=True)

    assert not _zip_crcs_hold(fast)  # No CRCs: a third of a save's time on tmpfs.
    assert _zip_crcs_hold(checked)
    assert_same(load_state_dict(fast), state())
    assert_same(load_state_dict(checked), state())
    assert torch.serialization.get_crc32_options() is True  # The caller's setting is back.


@pytest.mark.parametrize("setting", [True, False])
def test_the_callers_crc32_setting_comes_back_after_a_failing_save(
    ckpt: Path, setting: bool
) -> None:
    torch.serialization.set_crc32_options(setting)
    try:
        with pytest.raises(AttributeError, match="pickle"):
            save_state_dict(ckpt, 7, {"f": lambda: None})
        assert torch.serialization.get_crc32_options() is setting
    finally:
        torch.serialization.set_crc32_options(True)


def test_concurrent_saves_turn_the_crc32_switch_back_when_the_last_one_ends() -> None:
    switch = torch_io._ZipCrc32Off()

    with switch.held():
        with switch.held():
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is False  # The other save still runs.
    assert torch.serialization.get_crc32_options() is True


# --- .save files (framework pytorch) ---------------------------------------------------------


def test_save_file_publishes_the_protocol_name_atomically(ckpt: Path) -> None:
    saved = state()

    path = save_file(ckpt, 12, saved, job="llama", rank=3, worker=5)

    assert path == ckpt / "llama-s12-n3-w5.save"
    assert contract.parse_save_name(path.name) == contract.NameParts("llama", 12, 3, 5)
    assert os.listdir(ckpt) == [path.name]  # The .tmp name is gone.
    assert_same(load_state_dict(path), saved)


def test_a_failing_save_file_leaves_neither_the_name_nor_the_temp(ckpt: Path) -> None:
    with pytest.raises(AttributeError, match="pickle"):
        save_file(ckpt, 12, {"f": lambda: None}, job="llama", rank=0, worker=0)

    assert os.listdir(ckpt) == []


def test_save_file_rejects_unsafe_names_and_existing_files(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="job"):
        save_file(ckpt, 1, {}, job="../x", rank=0, worker=0)
    with pytest.raises(ValueError, match="worker"):
        save_file(ckpt, 1, {}, job="llama", rank=0, worker=-1)
    save_file(ckpt, 1, {}, job="llama", rank=0, worker=0)
    with pytest.raises(FileExistsError):
        save_file(ckpt, 1, state(), job="llama", rank=0, worker=0)
    assert load_state_dict(ckpt / "llama-s1-n0-w0.save") == {}


# --- torch.distributed.checkpoint -------------------------------------------------------------


def tensors() -> dict[str, Any]:
    saved = state()
    del saved["step"]
    return saved


def test_dcp_without_a_process_group(ckpt: Path) -> None:
    assert not dist.is_initialized()
    saved = tensors()

    path = save_distributed(ckpt, 3, saved)

    assert os.listdir(ckpt) == ["3"]
    assert ".metadata" in os.listdir(path)
    target = zeros_like(saved)
    load_distributed(ingest_and_mark(ckpt, 3), target)
    assert_same(target, saved)


@pytest.fixture
def gloo(tmp_path: Path) -> Iterator[None]:
    """A single-process gloo group over a FileStore: no sockets, no other processes."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("gloo")
@pytest.mark.parametrize("node_group", [False, True])
def test_dcp_with_a_process_group(ckpt: Path, node_group: bool) -> None:
    group = node_process_group(local_world_size=1) if node_group else None
    saved = tensors()

    path = save_distributed(ckpt, 4, saved, process_group=group)

    assert path == ckpt / "4"
    assert os.listdir(ckpt) == ["4"]
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp"]
    target = zeros_like(saved)
    load_distributed(ingest_and_mark(ckpt, 4), target, process_group=group)
    assert_same(target, saved)


@pytest.mark.usefixtures("gloo")
def test_a_failing_dcp_save_leaves_no_step_visible(ckpt: Path) -> None:
    (ckpt / "5").mkdir()  # Rank 0's preparation fails; every rank must hear of it.

    with pytest.raises(FileExistsError):
        save_distributed(ckpt, 5, tensors())

    shutil.rmtree(ckpt / "5")
    with pytest.raises(CheckpointException):
        save_distributed(ckpt, 5, {**tensors(), "f": lambda: None})

    assert os.listdir(ckpt) == []


@pytest.mark.usefixtures("gloo")
def test_the_default_group_must_not_span_several_nodes(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # This "node" runs 8 of the job's ranks...
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 16)  # ...of 16.

    with pytest.raises(ValueError, match="node_process_group"):
        save_distributed(ckpt, 1, tensors())

    assert os.listdir(ckpt) == []


def test_node_process_group_needs_the_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        node_process_group()


@pytest.mark.usefixtures("gloo")
def test_share_restore_hands_rank_0s_result_to_the_group(ckpt: Path) -> None:
    result = RestoreResult(step=9, path=ckpt / "9", source="local")
    assert share_restore(result) == result


def test_share_restore_without_a_group_returns_the_own_result(ckpt: Path) -> None:
    result = RestoreResult(step=None, path=None)
    assert share_restore(result) is result
    with pytest.raises(ValueError, match="own result"):
        share_restore(None)
