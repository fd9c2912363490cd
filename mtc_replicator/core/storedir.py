"""Where the daemon's store lives: outside CHECKPOINT_DIR, on its filesystem. Pure, no I/O.

Training pods see CHECKPOINT_DIR (the CSI plugin mounts it into them), so the store of
every job's committed items must not be inside it; taking a step from the workload is a
rename, so the store must be on the same filesystem. Only the hard-link views that restore
markers point at stay in CHECKPOINT_DIR (``.mtc/views/``), since the pod must read them.
"""

from __future__ import annotations

from pathlib import PurePosixPath

STORE_SUFFIX = ".mtc-store"
VIEWS_DIR = "views"
"""Below ``CHECKPOINT_DIR/.mtc``: the only part of the daemon's files a pod may see."""


def default_store_dir(checkpoint_dir: PurePosixPath) -> PurePosixPath:
    """The store when ``--store-dir`` is not given: a sibling, ``<CHECKPOINT_DIR>.mtc-store``.

    One per CHECKPOINT_DIR (several daemons may share a parent, as the demo's do), and on
    the same filesystem whenever CHECKPOINT_DIR is a directory of the RAM disk rather than
    its mount point.
    """
    return checkpoint_dir.parent / f"{checkpoint_dir.name}{STORE_SUFFIX}"


def placement_problem(
    checkpoint_dir: PurePosixPath, store_dir: PurePosixPath, *, same_filesystem: bool
) -> str | None:
    """Why the store cannot live at ``store_dir`` (both paths resolved), or None.

    Inside CHECKPOINT_DIR every pod could read every job's items and plant its own; on
    another filesystem taking a step would be a copy, not a rename.
    """
    if store_dir == checkpoint_dir or checkpoint_dir in store_dir.parents:
        return (
            f"the store {store_dir} is inside CHECKPOINT_DIR {checkpoint_dir}, which training "
            "pods can read and write: give --store-dir (MTC_STORE_DIR) a directory outside it, "
            "on the same filesystem"
        )
    if not same_filesystem:
        return (
            f"the store {store_dir} is not on the filesystem of CHECKPOINT_DIR "
            f"{checkpoint_dir} (taking a step must be a rename): give --store-dir "
            "(MTC_STORE_DIR) a directory of the same RAM disk outside CHECKPOINT_DIR, for "
            "example make CHECKPOINT_DIR and the store two directories of the RAM disk"
        )
    return None
