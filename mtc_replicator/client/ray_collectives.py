"""The small collectives ``RayCheckpointer``'s workers run among themselves: one gloo group
for objects (whatever the job's backend), a gather, "all or none" (a failure anywhere raises
on every worker, so none waits for ever), each node's group, and a worker's place as text.
torch is imported inside the functions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from mtc_replicator.client.handshake import HandshakeError
from mtc_replicator.core import raytrain
from mtc_replicator.core.raytrain import RayLayout, RayTrainRefused, WorkerPlace

log = logging.getLogger(__name__)


def collective_group() -> Any:
    """A gloo group over all workers for our small object collectives (the default group
    may be NCCL); None when torch.distributed is not initialized (a single worker)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def gather(group: Any, value: object) -> list[Any]:
    if group is None:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def all_or_none(group: Any, action: Callable[[], object]) -> list[Any]:
    """Run ``action`` on every worker and gather the results; if it failed anywhere, raise
    on every worker (a refusal's own class where it is one), so that none waits forever."""
    try:
        mine: tuple[str, object] = ("ok", action())
    except RayTrainRefused as exc:
        log.error("refused: %s: %s", type(exc).__name__, exc)
        mine = ("refused", f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        log.error("failed: %s: %s", type(exc).__name__, exc)
        mine = ("error", f"{type(exc).__name__}: {exc}")
    gathered = gather(group, mine)
    for rank, (kind, value) in enumerate(gathered):
        if kind == "ok":
            continue
        name, _, text = str(value).partition(": ")
        refusal = getattr(raytrain, name, None)
        if kind == "refused" and isinstance(refusal, type) and issubclass(refusal, Exception):
            raise refusal(f"worker {rank}: {text}")
        raise HandshakeError(f"worker {rank}: {value}")
    return [value for _, value in gathered]


def node_group(layout: RayLayout, place: WorkerPlace, *, cpu: bool = False) -> Any:
    """This node's ranks as a process group; every worker creates every node's group.
    ``cpu``: on gloo whatever the job's backend, as an asynchronous DCP save needs (its
    background thread runs the collectives of the plan and the rename on it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = None
    for members in layout.node_members:
        group = dist.new_group(ranks=list(members), backend="gloo" if cpu else None)
        if place.world_rank in members:
            mine = group
    return mine


_PLACE = re.compile(r"(\d+),(\d+),(\d+),(\d+)")


def encode_place(place: WorkerPlace) -> str:
    return f"{place.world_rank},{place.local_rank},{place.local_world_size},{place.node_rank}"


def decode_place(text: str) -> WorkerPlace:
    match = _PLACE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a worker place: {text!r}")
    w, lr, lws, nr = (int(g) for g in match.groups())
    return WorkerPlace(w, lr, lws, nr)
