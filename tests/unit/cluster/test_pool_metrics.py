"""A one-node job's pool copy is counted in ``mtc_transfer_*{kind="replicate_out"}``
once, by the PeerClient that pushed it, and not at all when the holder had it already
(docs/metrics.md: "a push the peer already held is not counted")."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mtc_replicator.cluster.pool import PoolCopies
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.obs.metrics import Metrics, TransferKind


class Recording(Metrics):
    def __init__(self) -> None:
        self.transfers: list[tuple[TransferKind, int]] = []

    def transfer(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        self.transfers.append((kind, nbytes))


class Peers:
    """As ``PeerClient.push_item``: it counts a push the holder did not have, itself."""

    def __init__(self, metrics: Metrics, already_had: bool) -> None:
        self.metrics, self.already_had = metrics, already_had

    async def push_item(
        self, address: str, manifest: Any, data: Path, root: Path, **_: Any
    ) -> bool:
        if not self.already_had:
            self.metrics.transfer(TransferKind.REPLICATE_OUT, manifest.total_bytes, 0.1)
        return self.already_had


@dataclass
class View:
    async def names(self, owner: str) -> list[str]:
        return ["me", "other"]

    async def dial(self, owner: str, name: str, fn: Any) -> Any:
        return await fn(SimpleNamespace(node=name, address="10.0.0.2:7070"))


class Store:
    root = Path("/nonexistent")

    def get(self, item: ItemId) -> object:
        return object()

    def data_path(self, item: ItemId) -> Path:
        return self.root / "data"


@pytest.mark.parametrize(("already_had", "counted"), [(False, 1), (True, 0)])
def test_pool_push_counted_once(already_had: bool, counted: int) -> None:
    metrics = Recording()
    item = ItemId("job", 10, 0, 0)
    manifest = SimpleNamespace(item=item, total_bytes=1234)
    copies = PoolCopies(
        View(),  # type: ignore[arg-type]
        Peers(metrics, already_had),  # type: ignore[arg-type]
        Store(),  # type: ignore[arg-type]
        SimpleNamespace(job_name="job", node_rank=0),  # type: ignore[arg-type]
        me="me",
        owner="ns",
        run_thread=None,  # type: ignore[arg-type]
        trust=None,  # type: ignore[arg-type]
        metrics=metrics,
    )
    asyncio.run(copies._push(manifest))  # type: ignore[arg-type]
    out = [t for t in metrics.transfers if t[0] is TransferKind.REPLICATE_OUT]
    assert len(out) == counted, out
