"""``client.async_save``: a save returns after the snapshot, what it writes is the state at
the call, failures of the background are told, one save at a time, staging reused, and
SIGTERM finishes the save in flight. Real torch, real files; in-process."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from mtc_replicator.client import AsyncSaveError, AsyncSaver, load_distributed, load_state_dict
from tests.torch_trees import zeros_like

torch = pytest.importorskip("torch")


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


def state(n: int = 4, size: int = 1000) -> dict[str, Any]:
    return {
        "model": {f"w{i}": torch.full((size,), float(i)) for i in range(n)},
        "optim": [torch.arange(size, dtype=torch.float64), {"lr": 0.1}],
        "step": 7,
    }


def clone(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: clone(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone(v) for v in tree]
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def assert_equal(actual: Any, expected: Any) -> None:
    """``tests.torch_trees.assert_same``, lists included."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key, value in expected.items():
            assert_equal(actual[key], value)
    elif isinstance(expected, list):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_equal(a, e)
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    else:
        assert actual == expected


def tensors(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from tensors(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from tensors(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


class Gate:
    """A phase hook that holds the background write at one phase until released."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, phase: str) -> None:
        if phase == self.phase and threading.current_thread() is not threading.main_thread():
            self.reached.set()
            assert self.release.wait(30), "the test never released the save"


Saves = dict[str, Callable[[AsyncSaver, int, dict[str, Any]], Any]]
SAVES: Saves = {
    "step-dir": lambda s, step, st: s.save_state_dict(step, st),
    "save-file": lambda s, step, st: s.save_file(step, st, job="j", rank=0, worker=0),
}


def load(ckpt: Path, how: str, step: int) -> dict[str, Any]:
    return load_state_dict(ckpt / (str(step) if how == "step-dir" else f"j-s{step}-n0-w0.save"))


@pytest.mark.parametrize("how", SAVES)
def test_the_restore_is_the_state_at_the_call_though_the_loop_changed_it(
    ckpt: Path, how: str
) -> None:
    gate = Gate("write")
    live = state()
    expected = clone(live)
    with AsyncSaver(ckpt, phase_hook=gate) as saver:
        pending = SAVES[how](saver, 3, live)
        assert gate.reached.wait(30)
        for _ in range(3):  # the loop goes on while the file is being written
            for t in tensors(live):
                t.add_(1)
        live["model"]["w0"] = torch.zeros(5)
        assert not pending.done()
        gate.release.set()
        assert pending.wait(30) == pending.path
    assert_equal(load(ckpt, how, 3), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_save_is_the_state_at_the_call(ckpt: Path) -> None:
    live = {"w": torch.arange(100.0), "b": torch.ones(3, 3)}
    expected = clone(live)
    with AsyncSaver(ckpt) as saver:
        pending = saver.save_distributed(4, live)
        for t in live.values():
            t.mul_(-1)
        assert pending is not None
        assert pending.wait(30) == ckpt / "4"
        live2 = {"w": torch.arange(100.0) * 2, "b": torch.zeros(3, 3)}
        assert saver.save_distributed(5, live2) is not None  # its stager's buffers reused
        saver.wait()
    restored = zeros_like(expected)
    load_distributed(ckpt / "4", restored)
    assert_equal(restored, expected)
    assert sorted(os.listdir(ckpt)) == ["4", "5"]


def test_a_failure_surfaces_on_wait_and_nothing_of_the_step_is_left(ckpt: Path) -> None:
    broken = {**state(), "hook": lambda: None}  # the pickling fails in the background
    with AsyncSaver(ckpt) as saver:
        pending = saver.save_state_dict(1, broken)
        assert pending is not None
        with pytest.raises(AsyncSaveError, match="step 1") as raised:
            saver.wait(30)
        assert isinstance(raised.value.__cause__, AttributeError)
        assert os.listdir(ckpt) == []
        saver.save_state_dict(2, state())  # told once: the next save goes ahead
    assert os.listdir(ckpt) == ["2"]


def test_an_unwaited_failure_surfaces_on_the_next_call(ckpt: Path) -> None:
    saver = AsyncSaver(ckpt)
    saver.save_file(1, {"hook": lambda: None}, job="j", rank=0, worker=0)
    with pytest.raises(AsyncSaveError, match="step 1"):
        saver.save_file(2, state(), job="j", rank=0, worker=0)
    assert os.listdir(ckpt) == []  # no .tmp left, and the refused step 2 was not started
    saver.save_file(2, state(), job="j", rank=0, worker=0)
    saver.close()
    assert os.listdir(ckpt) == ["j-s2-n0-w0.save"]


def test_one_save_in_flight_the_next_waits_or_is_skipped(ckpt: Path) -> None:
    gate = Gate("write")
    with AsyncSaver(ckpt, when_busy="skip", phase_hook=gate) as saver:
        saver.save_state_dict(1, state())
        assert gate.reached.wait(30)
        assert saver.busy
        assert saver.save_state_dict(2, state()) is None  # skipped: step 1 is still writing
        gate.release.set()
        assert saver.wait(30) == ckpt / "1"
    assert os.listdir(ckpt) == ["1"]

    with AsyncSaver(ckpt, when_busy="wait") as saver:
        saver.save_state_dict(3, state())
        saver.save_state_dict(4, state())  # waits: step 3 is published when this returns
        assert (ckpt / "3" / "state.pt").is_file()
    assert sorted(os.listdir(ckpt)) == ["1", "3", "4"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_staging_is_allocated_once_and_memory_stays_bounded_over_20_saves(ckpt: Path) -> None:
    live = {f"t{i}": torch.rand(1 << 17) for i in range(16)}  # 8 MiB
    size = 8 << 20
    with AsyncSaver(ckpt) as saver:
        saver.save_state_dict(0, live)
        saver.wait()
        first = {path: t.data_ptr() for path, t in saver.staging.buffers().items()}
        rss = rss_bytes()
        for step in range(1, 20):
            for t in live.values():
                t.add_(1)
            saver.save_state_dict(step, live)
            shutil.rmtree(ckpt / str(step - 1))  # as the daemon takes each step away
        saver.wait()
        grown = rss_bytes() - rss
        assert saver.staging.allocations == 16
        assert {p: t.data_ptr() for p, t in saver.staging.buffers().items()} == first
        assert saver.staging.nbytes == size
        assert grown < size, f"RSS grew by {grown} bytes over 19 saves of {size}"
        assert torch.equal(load_state_dict(ckpt / "19")["t3"], live["t3"])

        # A tensor that changes shape gets a new buffer; one that goes, frees its own.
        del live["t0"]
        live["t1"] = torch.rand(10)
        saver.save_state_dict(20, live)
        assert saver.staging.allocations == 17
        assert saver.staging.nbytes == size - (1 << 20) + 40


def test_the_device_path_with_cpu_tensors_standing_in(ckpt: Path) -> None:
    """The CUDA path's staging logic (pinned buffers where an allocator exists, the device
    copies and their wait before writing) run with CPU tensors: not measured on a GPU here."""
    gate = Gate("write")
    live = state()
    expected = clone(live)
    with AsyncSaver(ckpt, offload=("cpu",), phase_hook=gate) as saver:
        saver.save_state_dict(1, live)
        snap_bytes = sum(t.numel() * t.element_size() for t in tensors(live))
        assert gate.reached.wait(30)
        for t in tensors(live):
            t.zero_()
        gate.release.set()
        saver.wait()
        buffers = list(saver.staging.buffers().values())
        pinnable = torch.cuda.is_available()
        assert all(bool(b.is_pinned()) == pinnable for b in buffers)
        assert saver.staging.nbytes == snap_bytes
    assert_equal(load_state_dict(ckpt / "1"), expected)


def test_sigterm_finishes_the_save_then_calls_the_previous_handler(ckpt: Path) -> None:
    seen: list[bool] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append((ckpt / "1" / "state.pt").is_file())

    before = signal.signal(signal.SIGTERM, previous)
    try:
        saver = AsyncSaver(ckpt)
        saver.finish_on_sigterm()
        saver.save_state_dict(1, state(8, 1 << 16))
        signal.raise_signal(signal.SIGTERM)
        assert seen == [True]  # published before the previous handler ran
        assert signal.getsignal(signal.SIGTERM) is previous
        saver.close()
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("offload", [("cuda",), ("cpu",)])
def test_staged_is_the_newest_save_as_saved_until_the_next_one(
    ckpt: Path, offload: tuple[str, ...]
) -> None:
    """What a copy of the newest save elsewhere (Ray's checkpoint) is written from: the
    state at the save, though the loop changed it and the write is still going on; the
    next save's, once it is made; a skipped save leaves it; nothing after close()."""
    gate = Gate("write")
    live = state()
    expected = clone(live)
    saver = AsyncSaver(ckpt, when_busy="skip", offload=offload, phase_hook=gate)
    assert saver.staged is None
    saver.save_file(3, live, job="j", rank=0, worker=0)
    assert gate.reached.wait(30)
    for t in tensors(live):
        t.add_(1)
    live["optim"][1]["lr"] = 0.5  # not a tensor: copied at the save, too
    assert saver.save_file(4, live, job="j", rank=0, worker=0) is None  # skipped
    staged = saver.staged
    assert staged is not None
    staged.ready()  # beside the writer, which has not waited yet
    assert staged.step == 3
    assert_equal(staged.tree, expected)
    gate.release.set()
    saver.wait(30)
    assert_equal(saver.staged.tree if saver.staged else None, expected)
    saver.save_file(5, live, job="j", rank=0, worker=0)
    assert saver.staged is not None
    assert saver.staged.step == 5
    assert_equal(saver.staged.tree, live)
    saver.close()
    assert saver.staged is None
    assert_equal(load(ckpt, "save-file", 3), expected)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_saves_staged_state_is_the_state_at_the_call(ckpt: Path) -> None:
    live = {"w": torch.arange(100.0), "b": torch.ones(3, 3), "step": 4}
    expected = clone(live)
    with AsyncSaver(ckpt) as saver:
        saver.save_distributed(4, live)
        for t in tensors(live):
            t.mul_(-1)
        staged = saver.staged
        assert staged is not None
        staged.ready()
        assert staged.step == 4
        assert_equal(staged.tree, expected)
        saver.wait(30)
        saver.save_distributed(5, live)
        assert saver.staged is not None
        assert saver.staged.step == 5
        assert_equal(saver.staged.tree, live)
