"""``torch.distributed.checkpoint`` through ``mtc_replicator/client/`` with several real processes
(gloo)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from mtc_replicator.client import load_distributed, node_process_group, save_distributed
from tests.torch_trees import assert_same, zeros_like

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _save_and_load(rank: int, ckpt: Path, group: Any, node_ranks: range) -> None:
    """Save step 8 of this node and load it back on the node's ranks."""
    ckpt.mkdir(exist_ok=True)
    saved = {
        "replicated": torch.arange(6.0),  # Identical on every rank, as with DDP.
        f"own{rank}": torch.full((3,), float(rank)),
    }
    path = save_distributed(ckpt, 8, saved, process_group=group)
    assert sorted(os.listdir(ckpt)) == ["8"]  # Published by one rename, after all wrote.
    files = sorted(os.listdir(path))
    assert files == [".metadata", *(f"__{r}_0.distcp" for r in range(len(node_ranks)))]
    # Each node in turn loads with every other node's files out of reach.
    leader = rank == node_ranks[0]
    nodes = sorted(ckpt.parent.glob("node*"))
    for node in nodes:
        dist.barrier()
        if node != ckpt:
            continue
        others = [(n, n.with_name("." + n.name)) for n in nodes if n != node]
        if leader:
            for other, away in others:
                other.rename(away)
        dist.barrier(group=group)
        target = zeros_like(saved)
        load_distributed(path, target, process_group=group)
        assert_same(target, saved)
        dist.barrier(group=group)
        if leader:
            for other, away in others:
                away.rename(other)
    dist.barrier()


def _dcp_rank(rank: int, world: int, root: str) -> None:
    """One rank of a 2-rank job, saved as one node and then as two nodes (spawned)."""
    store = dist.FileStore(os.path.join(root, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        # One node running both ranks: they share one <N>/ and the default group.
        os.environ["LOCAL_WORLD_SIZE"] = str(world)
        _save_and_load(rank, Path(root) / "single" / "node0", None, range(world))
        dist.barrier()
        _async_saves(rank, Path(root) / "single-async")
        dist.barrier()
        # Two nodes of one rank each, each with its own RAM disk and its own node group.
        os.environ["LOCAL_WORLD_SIZE"] = "1"
        group = node_process_group()
        _save_and_load(rank, Path(root) / "multi" / f"node{rank}", group, range(rank, rank + 1))
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_dcp_with_two_ranks_on_one_node_and_on_two_nodes(tmp_path: Path) -> None:
    """Synchronous saves on one and on two nodes; asynchronous ones (``AsyncSaver``, its
    DCP collectives and the rename's agreement in its background thread) on one."""
    (tmp_path / "single").mkdir()
    (tmp_path / "multi").mkdir()
    mp = pytest.importorskip("torch.multiprocessing")
    mp.spawn(_dcp_rank, args=(2, str(tmp_path)), nprocs=2, join=True)


def _async_saves(rank: int, ckpt: Path) -> None:
    """Two asynchronous saves of this node's ranks while the loop changes its tensors."""
    from mtc_replicator.client import AsyncSaver

    ckpt.mkdir(exist_ok=True)
    live = {"replicated": torch.arange(6.0), f"own{rank}": torch.full((3,), float(rank))}
    expected = {k: v.clone() for k, v in live.items()}
    with AsyncSaver(ckpt) as saver:
        pending = saver.save_distributed(8, live)
        for t in live.values():
            t.add_(100)  # the loop goes on: step 8 keeps the state at its call
        saver.save_distributed(9, live)  # waits for step 8, every rank alike
        assert pending is not None
        assert pending.done()
    assert sorted(os.listdir(ckpt)) == ["8", "9"]
    for step, want in ((8, expected), (9, live)):
        target = zeros_like(want)
        load_distributed(ckpt / str(step), target)
        assert_same(target, want)
