"""The Ray checkpoint ``RayCheckpointer.report`` writes: the newest save, as it was saved.

A report need not follow the save its Ray checkpoint holds (a job reports as often as its
metrics need, and may train on in between), so the checkpoint is written from a host copy
taken when that save was made, never from the live tensors: an asynchronous save's own
staging (``AsyncSaver.staged``, the buffers its write reads, kept until the next save: no
extra copy), or for a synchronous save a copy of the same kind taken here (``HostCopy``:
one more copy of the state in host memory, buffers reused). Owns that copy and the
worker's part of the checkpoint. Does file I/O in the checkpoint's temporary directory;
torch is imported inside the functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mtc_replicator.client.async_save import Staged, dcp_staging_options
from mtc_replicator.client.staging import Staging
from mtc_replicator.core.raytrain import RayMeta

RAY_META_FILE = "mtc-ray.json"
"""In a Ray checkpoint written by ``report``: its step, world size, mode and job."""


def rank_file(world_rank: int) -> str:
    """A worker's state in a ``files``-mode Ray checkpoint."""
    return f"rank-{world_rank}.pt"


class HostCopy:
    """Host copies of a synchronous save's state, for its Ray checkpoint: ``client.staging``
    for a worker's own state dict (``files``), torch's DCP stager for a sharded one
    (``dcp``: DTensors). Each keeps its buffers for the next copy."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._staging: Staging | None = None
        self._stager: Any = None

    def take(self, step: int, state: Mapping[str, Any]) -> Staged:
        if self.mode == "files":
            if self._staging is None:
                self._staging = Staging()
            snap = self._staging.snapshot(state)
            return Staged(step, snap.tree, snap.ready)
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager

            self._stager = DefaultStager(dcp_staging_options())
        return Staged(step, self._stager.stage(dict(state)), _nothing)

    def release(self) -> None:
        if self._staging is not None:
            self._staging.release()
        if self._stager is not None:
            self._stager.close()
        self._staging = self._stager = None


def _nothing() -> None:
    """DCP's stager returns once its copies are done."""


def write_part(
    directory: Path, staged: Staged, mode: str, world_rank: int, meta: RayMeta | None
) -> None:
    """This worker's part of a Ray checkpoint of ``staged`` (Ray merges every worker's
    files into one directory of its storage); ``meta`` is written by world rank 0.
    Collective in ``dcp`` mode (over all workers)."""
    staged.ready()
    if mode == "files":
        import torch

        torch.save(dict(staged.tree), directory / rank_file(world_rank))
    else:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        dcp_save(dict(staged.tree), checkpoint_id=directory)
    if meta is not None:
        (directory / RAY_META_FILE).write_text(json.dumps(meta.to_json()), encoding="utf-8")


def read_meta(checkpoint: Any) -> RayMeta | None:
    """A Ray checkpoint's ``mtc-ray.json`` (None: absent or not ours); read through the
    checkpoint's own filesystem, so also from remote storage."""
    try:
        with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{RAY_META_FILE}") as f:
            return RayMeta.from_json(json.loads(f.read().decode("utf-8")))
    except (OSError, ValueError, AttributeError):
        return None
