"""The released round's rank holders of each job rank 0 coordinates, kept in the store. I/O.

A coordinator restarted with its daemon takes the running ranks back from their progress
reports (``core.coordination.JobCoordinator.resume_steady``); without a record, the first
report naming a rank would be believed, whoever sent it. The record is one JSON file per
job in the store (``rank-holders/<job>.json``, beside CHECKPOINT_DIR, out of the pods'
reach; the RAM disk survives a daemon restart), written when a round is released and when a
restarted coordinator binds a rank. It keeps the released round too, so that rank 0's
daemon killed before its own markers serves that round again
(``core.rank_holders.Released``). It also keeps each rank's history of nodes (the producers
a restore accepts, ``core.rank_holders``), which any later coordinator of the job on this
node reads back, as long as this node kept running rank 0: once a handshake makes it
another rank (Ray Train renumbers nodes at every restart), another node coordinates and
records the job, so the record here stops following it and is removed (``keep_only``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path

from mtc_replicator.core.rank_holders import SavedHolders, holders_from_json, holders_json
from mtc_replicator.local import fsutil

log = logging.getLogger(__name__)

DIR_NAME = "rank-holders"
MAX_FILE_BYTES = 4 << 20


class HoldersFile:
    """``store_root/rank-holders/<job>.json``."""

    def __init__(self, store_root: Path) -> None:
        self.root = store_root / DIR_NAME

    def _path(self, job: str) -> Path:
        # Job names are checked before a coordinator is hosted: no separators.
        return self.root / f"{job}.json"

    def save(self, job: str, saved: SavedHolders) -> None:
        """Record the holders and their history (raises ``OSError``)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsutil.atomic_write_bytes(self._path(job), json.dumps(holders_json(saved)).encode())

    def keep_only(self, jobs: Collection[str]) -> None:
        """Remove every job's record but those of ``jobs``: this node no longer coordinates
        them.
        Come back to rank 0 later, it must not take its old record for the whole history
        (it would refuse the items the nodes that held ranks meanwhile made)."""
        try:
            names = [p.name for p in self.root.iterdir()]
        except FileNotFoundError:
            return
        for name in names:
            if name.removesuffix(".json") not in jobs:
                try:
                    (self.root / name).unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("cannot remove %s: %s", self.root / name, exc)
                else:
                    log.info("forgot the rank holders recorded in %s", name)

    def load(self, job: str, ranks: int) -> SavedHolders | None:
        """The record; None when there is no usable one (said in the log)."""
        try:
            raw = fsutil.read_regular(self._path(job), MAX_FILE_BYTES)
            return holders_from_json(json.loads(raw), ranks)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self._path(job), exc)
            return None
