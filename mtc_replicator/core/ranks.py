"""Which rank each pod of a restarted job takes: the one whose bytes its node holds. Pure.

On Kubernetes a restart recreates every pod and the scheduler places them on the pool's
nodes in no particular order, while the workload takes its rank from the pod's index. Rank
r then lands on a node holding some other rank's steps and pulls its own over the network.
Here each pod is given a rank its node holds at the step the restore will want, so that as
many ranks as possible restore from their own RAM disk:

- The step aimed at is the newest step every rank of the job is held at by some node of the
  job's pods (all nodes survived, or a lost node's ranks have peer copies elsewhere); where
  no step is whole, the step that most ranks are held at (the newest of those).
- A maximum matching of pods to ranks over "my node holds rank r at that step" (augmenting
  paths, each pod trying its own index first, so that a pod back on its node keeps its
  rank and nothing moves that need not); a pod left unmatched takes its own index if free,
  else the lowest free rank.
- All or nothing: an assignment is made only for exactly one pod per index ``0..N-1``;
  anything else is refused with the reason, and the caller falls back to the indexes.

``local`` counts the pods whose node holds their rank at that step; ``by_index`` is the same
count had every pod kept its index: the figure without sticky ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

Holdings = Mapping[str, Mapping[int, Collection[int]]]
"""node -> rank -> the steps of that rank the node holds whole (own or a peer's copy)."""


class NoAssignment(ValueError):
    """The pods are not one per index of the job: the caller keeps the indexes."""


@dataclass(frozen=True)
class Pod:
    name: str
    """Who the pod is (``namespace/name`` or its uid)."""
    index: int
    """The rank the workload takes without us: its index in the job."""
    node: str


@dataclass(frozen=True)
class Assignment:
    ranks: Mapping[str, int]
    """Pod name -> rank."""
    indexes: Mapping[str, int]
    """Pod name -> its index (the rank it would have taken)."""
    step: int | None
    """The step the matching aimed at; None: no node holds any step (a fresh job)."""
    local: int
    """Pods whose node holds their assigned rank at ``step``."""
    by_index: int
    """Pods whose node holds their own index at ``step``: ``local`` without sticky ranks."""

    @property
    def moved(self) -> int:
        """Pods given a rank other than their index."""
        return sum(1 for p, r in self.ranks.items() if r != self.indexes[p])


def check_pods(pods: Sequence[Pod], ranks: int) -> None:
    """One pod per index ``0..ranks-1``, each on a named node; else ``NoAssignment``."""
    if ranks < 1:
        raise NoAssignment(f"a job has at least one rank, not {ranks}")
    if len(pods) != ranks:
        raise NoAssignment(f"{len(pods)} pods for {ranks} ranks: waiting for all of them")
    seen: dict[int, str] = {}
    for p in pods:
        if not 0 <= p.index < ranks:
            raise NoAssignment(f"pod {p.name} has index {p.index}, outside 0..{ranks - 1}")
        if p.index in seen:
            raise NoAssignment(f"pods {seen[p.index]} and {p.name} both have index {p.index}")
        if not p.node:
            raise NoAssignment(f"pod {p.name} is on no node yet")
        seen[p.index] = p.name


def target_step(pods: Sequence[Pod], holdings: Holdings, ranks: int) -> int | None:
    """The newest step all ranks are held at by the pods' nodes, else the step most ranks
    are held at (newest first); None when they hold nothing of the job."""
    covered: dict[int, set[int]] = {}
    for node in {p.node for p in pods}:
        for rank, steps in holdings.get(node, {}).items():
            if 0 <= rank < ranks:
                for step in steps:
                    covered.setdefault(step, set()).add(rank)
    if not covered:
        return None
    return max(covered, key=lambda s: (len(covered[s]), s))


def assign(
    pods: Sequence[Pod], holdings: Holdings, ranks: int, fixed: Mapping[str, int] | None = None
) -> Assignment:
    """Each pod's rank; ``NoAssignment`` unless the pods are one per index. ``fixed``: pods
    that run already with a rank they keep (one pod of a StatefulSet replaced): the others
    share the rest."""
    check_pods(pods, ranks)
    step = target_step(pods, holdings, ranks)
    order = sorted(pods, key=lambda p: p.index)
    owner: dict[int, str] = {}  # rank -> pod
    of: dict[str, int] = {}  # pod -> rank
    for name, r in sorted((fixed or {}).items()):
        if 0 <= r < ranks and r not in owner and any(p.name == name for p in order):
            owner[r], of[name] = name, r
    held = {
        p.name: _held_at(holdings.get(p.node, {}), step, ranks) - set(owner)
        if p.name not in of
        else {of[p.name]}
        for p in order
    }
    # Greedy first (a pod's own index, then the others it holds), then augmenting paths for
    # the pods left over: most restarts are settled by the greedy pass alone.
    for p in order:
        if p.name in of:
            continue
        for r in _preferred(held[p.name], p.index):
            if r not in owner:
                owner[r], of[p.name] = p.name, r
                break
    for p in order:
        if p.name not in of:
            _augment(p.name, held, owner, of, {q.name: q.index for q in order})
    free = sorted(set(range(ranks)) - set(owner))
    free_set = set(free)
    for p in order:  # the rest: their own index if free, else the lowest free rank
        if p.name not in of and p.index in free_set:
            of[p.name] = p.index
            free_set.discard(p.index)
    rest = sorted(free_set)
    for p in order:
        if p.name not in of:
            of[p.name] = rest.pop(0)
    held_any = {p.name: _held_at(holdings.get(p.node, {}), step, ranks) for p in order}
    local = sum(1 for p in order if of[p.name] in held_any[p.name])
    by_index = sum(1 for p in order if p.index in held_any[p.name])
    return Assignment(dict(of), {p.name: p.index for p in order}, step, local, by_index)


def _held_at(by_rank: Mapping[int, Collection[int]], step: int | None, ranks: int) -> set[int]:
    if step is None:
        return set()
    return {r for r, steps in by_rank.items() if 0 <= r < ranks and step in steps}


def _preferred(held: set[int], index: int) -> list[int]:
    return ([index] if index in held else []) + sorted(held - {index})


def _augment(
    start: str,
    held: Mapping[str, set[int]],
    owner: dict[int, str],
    of: dict[str, int],
    index: Mapping[str, int],
) -> bool:
    """Kuhn's augmenting path from ``start``, iterative (no recursion limit on big jobs)."""
    visited: set[int] = set()
    # Each frame: a pod and the ranks it has still to try.
    stack: list[tuple[str, list[int]]] = [(start, _preferred(held[start], index[start]))]
    path: list[tuple[str, int]] = []  # (pod, rank it would take)
    while stack:
        pod, options = stack[-1]
        while options and options[0] in visited:
            options.pop(0)
        if not options:
            stack.pop()
            if path:
                path.pop()
            continue
        r = options.pop(0)
        visited.add(r)
        holder = owner.get(r)
        path.append((pod, r))
        if holder is None:
            for p, rank in path:  # flip the path: each pod takes the rank it reached
                owner[rank], of[p] = p, rank
            return True
        stack.append((holder, _preferred(held[holder], index[holder])))
    return False
