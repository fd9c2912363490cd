"""The client saving into a full RAM disk, on a real small tmpfs: it says how full, and
leaves no partial step behind.

Before: torch's zip writer failed with "unexpected pos 704 vs 598", or a bare ENOSPC, and
the job's log said nothing about CHECKPOINT_DIR.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.client import CheckpointDirFull, save_file, save_state_dict
from tests.integration.helpers import mount_tmpfs, unmount

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.integration

FULL = re.compile(r"CHECKPOINT_DIR full: (\d+) bytes free, the step needs (\d+)")
Save = Callable[[Path, int, dict[str, Any]], Path]
SAVES: dict[str, Save] = {
    "step-dir": save_state_dict,
    "save-file": lambda d, step, state: save_file(d, step, state, job="j", rank=0, worker=0),
}


@pytest.fixture
def small_ram_disk(tmp_path: Path) -> Iterator[Path]:
    ram = tmp_path / "ram"
    ram.mkdir()
    if not mount_tmpfs(ram, "1m"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        (ram / "checkpoint").mkdir()
        yield ram / "checkpoint"
    finally:
        unmount(ram)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("how", SAVES)
def test_a_step_larger_than_the_free_space_is_refused_before_writing(
    small_ram_disk: Path, how: str
) -> None:
    free = free_bytes(small_ram_disk)
    state = {"w": torch.zeros(free // 2)}  # 4 bytes a float: twice the room
    with pytest.raises(CheckpointDirFull) as raised:
        SAVES[how](small_ram_disk, 5, state)
    found = FULL.search(str(raised.value))
    assert found is not None, str(raised.value)
    assert (int(found[1]), int(found[2])) == (free, 2 * free)
    assert os.listdir(small_ram_disk) == []


@pytest.mark.parametrize("how", SAVES)
def test_a_save_that_runs_out_of_room_midway_says_so_and_leaves_nothing(
    small_ram_disk: Path, how: str
) -> None:
    free = free_bytes(small_ram_disk)
    # The tensors fit; torch's zip headers and pickle do not: the write itself fails.
    state = {"w": torch.zeros((free - 256) // 4)}
    with pytest.raises(CheckpointDirFull) as raised:
        SAVES[how](small_ram_disk, 6, state)
    assert FULL.search(str(raised.value)), str(raised.value)
    assert os.listdir(small_ram_disk) == []
    assert free_bytes(small_ram_disk) == free
