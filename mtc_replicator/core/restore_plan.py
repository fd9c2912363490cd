"""The restore round's plan: which step every rank restores, and where each item comes from.

Pure: the coordinator calls ``plan_round`` with the joins it holds (each live rank's
inventory) and the committed backups, and re-plans with failed copies excluded. It holds no
other state, so a restarted coordinator recomputes the same plan from re-joins
(docs/architecture.md, "Restore rounds"). Agents perform the fetches and verify every byte
against ``Fetch.digest``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

from mtc_replicator.core.backup_layout import CommitRecord
from mtc_replicator.core.contract import JobConfig
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.policy import Source, worker_slots


@dataclass(frozen=True)
class NodeInventory:
    """What one rank reported when it joined: its address and every item it holds."""

    rank: int
    address: str
    """Where its peer service listens, ``host:port``."""
    items: Mapping[ItemId, str]
    """Every committed item in its store (its own and peer copies) -> manifest digest."""


@dataclass(frozen=True)
class SourceKey:
    """One copy of one item: what the caller excludes after it failed or was corrupt."""

    holder: int | None
    """The live rank serving it; None for the backup."""
    item: ItemId
    restorer: int | None = None
    """Excluded for this rank's restore only; None: for every rank's. A rank's report is
    its word alone, so it must not take a copy away from the others (or its holder)."""


@dataclass(frozen=True)
class Fetch:
    """One way to obtain an item of the restored step."""

    source: Source
    """LOCAL when the restoring rank holds it, PEER for another live rank, else BACKUP."""
    item: ItemId
    """The item to fetch: the target itself, or (``equivalent``) another rank's item."""
    holder: int | None
    """The rank serving it; None for the backup."""
    digest: str
    """The manifest digest the copy must have; verify against it, never trust the holder."""
    equivalent: bool = False
    """A data-parallel equivalent of the target, not the target's own bytes."""
    pending: bool = False
    """PEER only: the holder obtains the item during this round (it downloads it from the
    backup, or relays it from another holder), so a pull waits for it, within bounds."""
    producers: tuple[str, ...] | None = None
    """The nodes that held ``item``'s rank when its step can have been produced
    (``core.rank_holders``): the copy counts only if its manifest's attestation names one
    of them. None: not known. The coordinator sets it on the assignments it hands out, not
    the plan."""

    @property
    def key(self) -> SourceKey:
        return SourceKey(self.holder, self.item)

    @property
    def origin(self) -> Source:
        """The tier the bytes come from: a pending pull relays the backup's."""
        return Source.BACKUP if self.pending else self.source


class _Tier(IntEnum):
    """Order of preference: fastest first, the exact item before an equivalent at a speed."""

    LOCAL = 0
    PEER = 1
    LOCAL_EQUIVALENT = 2
    PEER_EQUIVALENT = 3
    BACKUP = 4
    BACKUP_EQUIVALENT = 5


_TIERS = {
    (Source.LOCAL, False): _Tier.LOCAL,
    (Source.PEER, False): _Tier.PEER,
    (Source.LOCAL, True): _Tier.LOCAL_EQUIVALENT,
    (Source.PEER, True): _Tier.PEER_EQUIVALENT,
    (Source.BACKUP, False): _Tier.BACKUP,
    (Source.BACKUP, True): _Tier.BACKUP_EQUIVALENT,
}
_SERVED_BY_PEERS = (_Tier.PEER, _Tier.PEER_EQUIVALENT)
_FROM_BACKUP = (_Tier.BACKUP, _Tier.BACKUP_EQUIVALENT)

FAN_OUT = 4
"""Ranks one holder serves a backup object to, at most, as their first choice: with up to
``FAN_OUT + 1`` ranks needing the object, the downloader serves all the others; with more,
they form a ``FAN_OUT``-ary tree under it, each relaying to the next level, so no node's
link carries the object more than ``FAN_OUT`` times and the depth grows as its log."""


def _tier(fetch: Fetch) -> _Tier:
    return _TIERS[fetch.source, fetch.equivalent]


@dataclass(frozen=True)
class RoundPlan:
    """The step every rank restores, and per item where to get it, in the order to try."""

    step: int
    sources: Mapping[ItemId, tuple[Fetch, ...]]
    """Every (rank, worker) item of ``step``; each has at least one source."""
    candidates: tuple[int, ...]
    """Every restorable step, newest first (``candidates[0] == step``): for diagnostics."""

    def for_rank(self, rank: int) -> dict[ItemId, tuple[Fetch, ...]]:
        """What ``rank`` must restore, with its sources (a copy)."""
        return dict(self._by_rank.get(rank, {}))

    @functools.cached_property
    def _by_rank(self) -> dict[int, dict[ItemId, tuple[Fetch, ...]]]:
        # Built once: every rank asks for its part, so a scan per call costs N^2 per round.
        by_rank: dict[int, dict[ItemId, tuple[Fetch, ...]]] = {}
        for item, fetches in sorted(self.sources.items()):
            by_rank.setdefault(item.rank, {})[item] = fetches
        return by_rank

    def load(self) -> dict[int, int]:
        """Items each live rank serves to other ranks as their first choice."""
        served = Counter(s[0].holder for s in self.sources.values() if s[0].source is Source.PEER)
        return {h: n for h, n in served.items() if h is not None}

    def restore_source(self, rank: int) -> Source:
        """The slowest first-choice tier among ``rank``'s items (``restore-source``)."""
        order = list(Source)
        return max((s[0].origin for s in self.for_rank(rank).values()), key=order.index)


_Held = dict[ItemId, dict[int, str]]


def _index(config: JobConfig, inventories: Mapping[int, NodeInventory]) -> _Held:
    """item -> {live rank holding it: digest}, for this job's well-formed items only."""
    slots = worker_slots(config)
    held: _Held = {}
    for rank, inventory in inventories.items():
        if inventory.rank != rank:
            raise ValueError(f"inventory of rank {inventory.rank} filed under rank {rank}")
        for item, digest in inventory.items.items():
            # Another job's items, or ranks and workers this config cannot have (a stale
            # config, a hostile report), can never be part of this job's restore.
            if (
                item.job == config.job_name
                and 0 <= item.rank < config.nodes
                and item.worker in slots
            ):
                held.setdefault(item, {})[rank] = digest
    return held


def _expected_digest(
    item: ItemId, copies: Mapping[int, str], backup: CommitRecord | None
) -> str | None:
    """The one digest that counts as ``item``'s content, or None when it cannot be told.

    Copies of one step can differ when a job went back to an older step and saved the
    newer step number again: a peer may still hold the abandoned timeline's bytes. The
    committed backup is the authority where it has the item: it is the one record no join
    can rewrite, while an inventory is only a claim (a forged joiner posing as a missing
    rank can name any digest for "its own" items). Then the owner's own copy (it replaced
    its old copy when it saved again), then the peers if they agree. Disagreeing peers with
    no authority are all refused: mixing timelines would be a wrong restore, and an older
    step is a safe one. An owner that disagrees with the backup loses rather than voids the
    step, so one false claim cannot push every rank back to an older step or a fresh start.
    """
    if backup is not None and backup.has(item):
        return backup.items[item.key]
    if item.rank in copies:
        return copies[item.rank]
    digests = set(copies.values())
    return digests.pop() if len(digests) == 1 else None


def _item_sources(
    config: JobConfig,
    target: ItemId,
    held: _Held,
    backup: CommitRecord | None,
    exclude: Collection[SourceKey],
) -> list[Fetch]:
    """Every usable copy of ``target`` or (with data parallelism) of an equivalent, unordered."""
    found: list[Fetch] = []
    # equivalent_ranks is empty without data parallelism, so equivalents only appear with it.
    candidates = [target] + [
        dataclasses.replace(target, rank=e) for e in config.equivalent_ranks(target.rank)
    ]
    for item in candidates:
        equivalent = item != target
        copies = held.get(item, {})
        expected = _expected_digest(item, copies, backup)
        if expected is None:
            continue
        for holder, digest in copies.items():
            if digest == expected and not _excluded(exclude, holder, item, target.rank):
                source = Source.LOCAL if holder == target.rank else Source.PEER
                found.append(Fetch(source, item, holder, digest, equivalent))
        if (
            backup is not None
            and backup.has(item)
            and backup.items[item.key] == expected
            and not _excluded(exclude, None, item, target.rank)
        ):
            found.append(Fetch(Source.BACKUP, item, None, expected, equivalent))
    return found


def _excluded(
    exclude: Collection[SourceKey], holder: int | None, item: ItemId, restorer: int
) -> bool:
    """Whether the copy of ``item`` at ``holder`` is ruled out for ``restorer``'s restore."""
    return SourceKey(holder, item) in exclude or SourceKey(holder, item, restorer) in exclude


def _step_sources(
    config: JobConfig,
    step: int,
    held: _Held,
    backups: Mapping[int, CommitRecord],
    exclude: Collection[SourceKey],
) -> dict[ItemId, list[Fetch]] | None:
    """Sources of every item of ``step``, or None when some item has none."""
    backup = backups.get(step)
    if backup is not None and (backup.job != config.job_name or backup.step != step):
        backup = None
    found: dict[ItemId, list[Fetch]] = {}
    for rank in range(config.nodes):
        for worker in worker_slots(config):
            target = ItemId(config.job_name, step, rank, worker)
            options = _item_sources(config, target, held, backup, exclude)
            if not options:
                return None
            found[target] = options
    return found


def _steps(config: JobConfig, held: _Held, backups: Mapping[int, CommitRecord]) -> list[int]:
    steps = {i.step for i in held} | {s for s, b in backups.items() if b.job == config.job_name}
    return sorted(steps, reverse=True)


def restorable_steps(
    config: JobConfig,
    inventories: Mapping[int, NodeInventory],
    backups: Mapping[int, CommitRecord],
    *,
    exclude: Collection[SourceKey] = (),
) -> list[int]:
    """Every step whose every (rank, worker) item has a usable source, newest first."""
    held = _index(config, inventories)
    excluded = frozenset(exclude)
    return [
        s
        for s in _steps(config, held, backups)
        if _step_sources(config, s, held, backups, excluded) is not None
    ]


@dataclass(frozen=True)
class PassedOver:
    """A step the plan passed over only because members reported its copies failed for
    their own restore: it is complete, and every other rank could restore it."""

    step: int
    reporters: tuple[int, ...]
    """The ranks whose reports ruled its copies out (for their own restore)."""


def passed_over_by_reports(
    config: JobConfig,
    inventories: Mapping[int, NodeInventory],
    backups: Mapping[int, CommitRecord],
    exclude: Collection[SourceKey],
    chosen: int | None,
) -> PassedOver | None:
    """The newest step newer than ``chosen`` (None: a fresh start) that the copies ruled
    out for everyone leave restorable: the members' own reports alone passed it over.

    Such a report is a member's word for its own restore, and it may be a lie (a node
    certificate is enough to send one): the round goes on without the step, but the
    operator is told which ranks' reports cost it, and no rank deletes its copies of it
    (``core.aside``).
    """
    shared = frozenset(k for k in exclude if k.restorer is None)
    if len(shared) == len(exclude):
        return None
    for step in restorable_steps(config, inventories, backups, exclude=shared):
        if chosen is not None and step <= chosen:
            return None
        reporters = {k.restorer for k in exclude if k.restorer is not None and k.item.step == step}
        return PassedOver(step, tuple(sorted(r for r in reporters if r is not None)))
    return None


def plan_round(
    config: JobConfig,
    inventories: Mapping[int, NodeInventory],
    backups: Mapping[int, CommitRecord],
    *,
    exclude: Collection[SourceKey] = (),
    only_step: int | None = None,
) -> RoundPlan | None:
    """The last-known-good step and where each of its items comes from; None: start fresh.

    ``inventories`` are the live ranks' joins; ``backups`` the committed backup steps.
    The newest step wins whose every item is available from a live copy (the rank's own,
    a peer copy, or with data parallelism an equivalent rank's item) or from the backup.
    Per item the sources are ordered LOCAL, PEER, LOCAL then PEER equivalent, BACKUP,
    BACKUP equivalent. A backup object that is several ranks' first choice is downloaded by
    one of them and pulled from it by the others (``_fan_out``). Among peers, first choices
    are spread so that the busiest holder serves as few items as possible (ties to the lower
    rank), a downloader's pending pulls counted. ``exclude`` rules out copies
    that failed (for one restoring rank, or with ``restorer`` None for all); re-planning
    then falls back to other sources or an older step. A copy is a source only when its
    digest is the committed backup's, or without one the owner's own copy's.
    ``only_step`` (an operator's restore pin) considers that step alone.
    """
    held = _index(config, inventories)
    excluded = frozenset(exclude)
    candidates: list[int] = []
    chosen: dict[ItemId, list[Fetch]] | None = None
    for step in _steps(config, held, backups):
        if only_step is not None and step != only_step:
            continue
        found = _step_sources(config, step, held, backups, excluded)
        if found is not None:
            candidates.append(step)
            chosen = chosen if chosen is not None else found
    if chosen is None:
        return None
    return RoundPlan(candidates[0], _order(chosen), tuple(candidates))


def _order(options: Mapping[ItemId, list[Fetch]]) -> dict[ItemId, tuple[Fetch, ...]]:
    """Sort each item's sources by tier; fan backup objects out; spread peer first choices."""
    best = {target: min(_tier(f) for f in found) for target, found in options.items()}
    before, after = _fan_out(options, best)
    # A relay's pulls are its load like any other first choice: balance around them.
    relayed = Counter(f[0].holder for f in before.values() if f[0].holder is not None)
    requests = {
        target: sorted(
            {f.holder for f in found if _tier(f) == best[target] and f.holder is not None}
        )
        for target, found in options.items()
        if best[target] in _SERVED_BY_PEERS
    }
    assigned = balance(requests, relayed)
    load = Counter(assigned.values()) + relayed

    return {
        target: (
            *before.get(target, ()),
            *sorted(
                found, key=functools.partial(_fetch_order, best[target], assigned.get(target), load)
            ),
            *after.get(target, ()),
        )
        for target, found in sorted(options.items())
    }


def _fan_out(
    options: Mapping[ItemId, list[Fetch]], best: Mapping[ItemId, _Tier]
) -> tuple[dict[ItemId, list[Fetch]], dict[ItemId, list[Fetch]]]:
    """Pending pulls to try before (and, for a downloader, after) each target's own sources.

    When several ranks' first choice is the same backup object (data-parallel replicas after
    every RAM disk was lost), one downloads it: the object's owner if it is among them, else
    the lowest rank. The others pull it over the peer plane: from the downloader, or with
    more than ``FAN_OUT`` of them from a relay in a ``FAN_OUT``-ary tree (heap order by
    rank), then from the relay's own ancestors, then from the backup themselves. The
    downloader falls back, after its backup sources, to the first relay, which by then has
    gone to the backup itself. A holder waits for a pull only while it tries its first
    choice or a source that is not pending (``cluster.rounds``), and first choices point
    up the tree, so waits never go round in a circle.
    """
    groups: dict[Fetch, list[ItemId]] = {}
    for target, found in sorted(options.items()):
        if best[target] in _FROM_BACKUP:
            first = min((f for f in found if _tier(f) == best[target]), key=lambda f: f.item.rank)
            groups.setdefault(dataclasses.replace(first, equivalent=False), []).append(target)
    before: dict[ItemId, list[Fetch]] = {}
    after: dict[ItemId, list[Fetch]] = {}
    for download, targets in groups.items():
        if len(targets) < 2:
            continue
        obj = download.item
        by_rank = {t.rank: t for t in targets}
        root = obj.rank if obj.rank in by_rank else min(by_rank)
        tree = [root, *sorted(r for r in by_rank if r != root)]

        def pull(
            restorer: int, holder: int, obj: ItemId = obj, digest: str = download.digest
        ) -> Fetch:
            return Fetch(Source.PEER, obj, holder, digest, obj.rank != restorer, pending=True)

        for i in range(1, len(tree)):
            ancestors = []
            j = i
            while j > 0:
                j = (j - 1) // FAN_OUT
                ancestors.append(tree[j])
            before[by_rank[tree[i]]] = [pull(tree[i], h) for h in ancestors]
        after[by_rank[root]] = [pull(root, tree[1])]
    return before, after


def _fetch_order(
    best: _Tier, first_choice: int | None, load: Counter[int], fetch: Fetch
) -> tuple[int, int, int, int, int]:
    tier = _tier(fetch)
    # Only the balanced tier's pick jumps ahead; fallbacks go least loaded first.
    first = 0 if tier == best and fetch.holder == first_choice else 1
    holder = -1 if fetch.holder is None else fetch.holder
    return (tier, first, load[holder], holder, fetch.item.rank)


def balance(
    requests: Mapping[ItemId, Sequence[int]], base: Mapping[int, int] | None = None
) -> dict[ItemId, int]:
    """Assign each request one of its holders so the busiest holder serves as few as possible.

    ``base`` is load the holders carry already (relays' pending pulls), counted but fixed.

    Greedy on the most constrained requests first, then shift requests along alternating
    paths from a holder with load L to one with load <= L - 2 until none is left: an
    assignment without such a path minimises every holder-load norm, the maximum included
    (Harvey et al., "Semi-matchings for bipartite graphs and load balancing", 2003). Ties go
    to the lower rank, so every run gives the same plan.
    """
    assigned: dict[ItemId, int] = {}
    load: Counter[int] = Counter(base or {})
    for req in sorted(requests, key=lambda r: (len(requests[r]), r)):
        if not requests[req]:
            raise ValueError(f"{req} has no holder")
        holder = min(requests[req], key=lambda h: (load[h], h))
        assigned[req] = holder
        load[holder] += 1
    while (path := _cost_reducing_path(requests, assigned, load)) is not None:
        for req, holder in path:
            load[assigned[req]] -= 1
            assigned[req] = holder
            load[holder] += 1
    return assigned


def _cost_reducing_path(
    requests: Mapping[ItemId, Sequence[int]], assigned: Mapping[ItemId, int], load: Counter[int]
) -> list[tuple[ItemId, int]] | None:
    """Moves (request -> new holder) that take one item off a busiest-first holder."""
    serving: dict[int, list[ItemId]] = {}
    for req, holder in sorted(assigned.items()):
        serving.setdefault(holder, []).append(req)
    for start in sorted(serving, key=lambda h: (-load[h], h)):
        parent: dict[int, tuple[ItemId, int] | None] = {start: None}
        queue = deque([start])
        while queue:
            holder = queue.popleft()
            for req in serving.get(holder, []):
                for other in sorted(requests[req]):
                    if other in parent:
                        continue
                    parent[other] = (req, holder)
                    if load[other] <= load[start] - 2:
                        path: list[tuple[ItemId, int]] = []
                        node = other
                        while (step := parent[node]) is not None:
                            path.append((step[0], node))
                            node = step[1]
                        return path
                    queue.append(other)
    return None
