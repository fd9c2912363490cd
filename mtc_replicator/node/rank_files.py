"""``Node/AssignRank``'s effect: a pod's rank written into CHECKPOINT_DIR. I/O: that
directory and the CSI plugin's ``owner.json``.

Only for the pod that has the directory now: the controller names the pod it assigned (its
uid), and an assignment for any other (a pod that already went, whose node got a new one) is
refused, so a stale call never hands the new pod someone else's rank. Both files are
written by temp name and rename, readable by the pod's user (mode 0644, the directory's
group), ``jax-init-info.txt`` first, so that ``mtc-rank.json`` appearing means both are
there. The same assignment again rewrites nothing. The CSI plugin removes both files when
the directory passes to another pod (``csi.checkpoint``), before that pod starts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

from mtc_replicator.core.grant import BadGrant, Grant, check_holders
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.rank_file import (
    MAX_RANK_FILE_BYTES,
    RANK_FILES,
    RankRecord,
    jax_init_info,
    rank_file_bytes,
)
from mtc_replicator.local import fsutil
from mtc_replicator.local.grants_file import GrantsFile
from mtc_replicator.node.owner_watch import read_owner_record

log = logging.getLogger(__name__)

RANK_FILE_MODE = 0o644
"""As the daemon's other files for the workload (markers, ``replicator.prerestore``): the
pod's user reads them through the directory's group or as other."""


class AssignRefused(Exception):
    """The assignment is not for the pod on this node (FAILED_PRECONDITION); says why."""


def check_pod(owner_file: Path | None, pod_uid: str) -> None:
    """``pod_uid`` must be the pod the CSI plugin last published CHECKPOINT_DIR for; any
    pod without ``--owner-file`` (no plugin: a local run)."""
    if owner_file is None:
        return
    try:
        owner = read_owner_record(owner_file)
    except BadOwner as exc:
        raise AssignRefused(f"cannot tell which pod has CHECKPOINT_DIR here: {exc}") from None
    if owner.pod_uid != pod_uid:
        raise AssignRefused(
            f"the pod on this node is {owner.pod_uid} ({owner.namespace}/{owner.pod}), not "
            f"{pod_uid or '(none named)'}: a stale assignment for a pod that already went"
        )


def write_rank_files(checkpoint_dir: Path, owner_file: Path | None, record: RankRecord) -> bool:
    """Write ``record``'s two files for the pod on this node (``AssignRefused`` for another
    pod); whether anything changed (False: the same assignment was there already)."""
    check_pod(owner_file, record.pod_uid)
    wanted = (jax_init_info(record), rank_file_bytes(record))
    changed = False
    for name, data in zip(RANK_FILES, wanted, strict=True):
        path = checkpoint_dir / name
        if _current(path) == data:
            continue
        fsutil.atomic_write_bytes(path, data, mode=RANK_FILE_MODE)
        changed = True
    try:
        # The CSI plugin may have handed the directory to a new pod meanwhile (it removes
        # these files first, then records the pod): take them back, it must not read them.
        check_pod(owner_file, record.pod_uid)
    except AssignRefused:
        for name in RANK_FILES:
            (checkpoint_dir / name).unlink(missing_ok=True)
        raise
    return changed


def _current(path: Path) -> bytes | None:
    try:
        return fsutil.read_regular(path, MAX_RANK_FILE_BYTES + 1)
    except OSError:  # missing, or a pod's symlink or FIFO: replaced by the write
        return None


class RankFiles:
    """``AssignRank`` for the daemon: ``assign`` writes on its thread pool, and keeps the
    assignment's grant (``core.grant``) when it names every rank's node."""

    def __init__(
        self,
        checkpoint_dir: Path,
        owner_file: Path | None,
        executor: Executor,
        grants: GrantsFile | None = None,
        own_node: str | None = None,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.owner_file = owner_file
        self._executor = executor
        self.grants = grants
        self.own_node = own_node

    async def assign(self, record: RankRecord, holders: Sequence[str] = ()) -> list[str]:
        """The names written for ``record`` (both, also when they were there already);
        ``holders``: every rank's node, kept as the job's grant (``AssignRefused`` when it
        does not name this node at the pod's rank)."""
        grant = None
        if holders:
            try:
                check_holders(holders, record.nodes, record.rank, self.own_node)
            except BadGrant as exc:
                raise AssignRefused(
                    f"the assignment's bindings are not this node's: {exc}"
                ) from None
            grant = Grant(record.job, record.assignment, tuple(holders))
        loop = asyncio.get_running_loop()
        if grant is not None and self.grants is not None:
            # Before the rank files: a pod that read them writes its handshake at once, and
            # a node that requires grants refuses one that comes before its grant.
            await loop.run_in_executor(self._executor, self.grants.save, grant)
        changed = await loop.run_in_executor(
            self._executor, write_rank_files, self.checkpoint_dir, self.owner_file, record
        )
        log.info(
            "%s rank %d of %d for pod %s of job %s (assignment %s, by %s, coordinator %s)",
            "assigned" if changed else "already assigned",
            record.rank,
            record.nodes,
            record.pod_uid or "(any)",
            record.job,
            record.assignment,
            record.source,
            record.coordinator,
            extra={"job": record.job},
        )
        return list(RANK_FILES)
