"""Where the daemon's store may live (``mtc_replicator.core.storedir``): pure rules."""

from __future__ import annotations

from pathlib import PurePosixPath as P

import pytest

from mtc_replicator.core.storedir import default_store_dir, placement_problem


def test_the_default_is_a_sibling_named_after_checkpoint_dir() -> None:
    assert default_store_dir(P("/var/lib/mtc/ramdisk/checkpoint")) == P(
        "/var/lib/mtc/ramdisk/checkpoint.mtc-store"
    )
    # Daemons sharing a parent (the demo's nodes) get one store each.
    assert default_store_dir(P("/dev/shm/n0")) != default_store_dir(P("/dev/shm/n1"))


@pytest.mark.parametrize(
    ("store", "same_fs", "problem"),
    [
        ("/ram/store", True, None),
        ("/ram/checkpoint.mtc-store", True, None),
        ("/ram", True, None),  # CHECKPOINT_DIR inside the store: pods still see none of it
        ("/ram/checkpoint", True, "inside CHECKPOINT_DIR"),
        ("/ram/checkpoint/.mtc", True, "inside CHECKPOINT_DIR"),
        ("/ram/checkpoint/a/b", False, "inside CHECKPOINT_DIR"),
        ("/var/store", False, "not on the filesystem"),
    ],
)
def test_placement(store: str, same_fs: bool, problem: str | None) -> None:
    found = placement_problem(P("/ram/checkpoint"), P(store), same_filesystem=same_fs)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found
        assert "--store-dir" in found
