"""Which node holds each rank of a job: a rank is bound to the node that joined as it. Pure.

The coordinator learns a caller's node from its certificate (``core.identity``). A rank is
bound to the first node admitted as it in a round; from then on joins, restore reports and
progress reports for that rank from any other node are refused (logged and counted by the
coordinator's host), through the round and the steady state after it. Ranks change hands
only in a round rank 0's new incarnation opens: that frees every rank but rank 0, whose
coordinator lives on rank 0's node. A restarted rank 0 daemon reads the released round's
holders back from its store (``local.holders_file``) and adopts only reports from them.

``None`` is a caller of no known node (TLS off, or an in-process call): nothing to check.
A shared certificate (``core.identity.LEGACY``, under ``--tls-shared-certificate``) could be
any node, so it neither is refused nor holds a rank against a certificate that names a node:
while a cluster moves to per-node certificates, a rank's daemon restarted with its own
certificate keeps its rank (the named node then holds it).

Each rank's HISTORY is every node bound to it so far (the newest ``MAX_HISTORY``, ``LEGACY``
included), kept when rank 0's new incarnation frees the bindings, each with the step from
which it can have produced the rank's items: the step its first released round restored (0
after a fresh start; 0 for a node bound to a rank that is running: one a restarted
coordinator adopts, which has run since a round it never saw, or the node's own name taking
over a rank held under the shared certificate). A node bound in a round not yet released has
produced nothing. A restoring rank counts a copy of an item of step s only if its manifest's
attestation names one of the nodes whose tenure began at or before s (``producers``,
``Fetch.producers``). The history is COMPLETE when this coordinator saw a plan find no item
anywhere (no inventory item, no committed backup: a fresh job) and every binding named its
node, or it was restored from a record that was complete. Otherwise (a coordinator on a new
host after rank 0's node and store were lost or rank 0 moved to another node, a record of a
version without history, TLS off) the producers of older items are not known:
``producers`` is None. A node's record follows the job only while the node runs its rank 0
(``local.holders_file.HoldersFile.keep_only``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtc_replicator.core.identity import LEGACY

MAX_RANKS = 1 << 20
MAX_HISTORY = 8
"""Nodes remembered per rank, the newest: a rank moves only when rank 0 restarts the job,
and its older items are pruned long before eight moves."""
MAX_NODE_CHARS = 253
"""A node name is a DNS-1123 subdomain (``core.identity``)."""


Tenures = Mapping[str, int | None]
"""A rank's nodes, oldest binding first, each with the first step it can have produced
(None: bound in a round not released yet, so nothing)."""


MAX_INCARNATION_CHARS = 64


@dataclass(frozen=True)
class Released:
    """The round rank 0's incarnation ``rank0`` released: a restart of the coordinator's
    daemon before rank 0's own agent published its markers serves the same round again
    (``core.coordination.JobCoordinator.resume_released``), so the ranks that took theirs
    are never asked into another one."""

    round: int
    rank0: str
    """The incarnation of rank 0 that released it: only that one is served again."""
    step: int | None
    """The restored step; None: a fresh start."""
    incarnations: Mapping[int, str]
    """Each rank's incarnation in the round."""


@dataclass(frozen=True)
class SavedHolders:
    """What a released round leaves for a restart of the coordinator's daemon."""

    nodes: Mapping[int, str]
    """Each bound rank's node."""
    history: Mapping[int, Tenures] = field(default_factory=dict)
    """Each rank's nodes ever bound (``RankHolders.history``)."""
    complete: bool = False
    """The history names every node that can have produced an item of the job."""
    released: Released | None = None
    """The round released last, when this node's rank 0 released it."""


@dataclass
class RankHolders:
    """Each bound rank's node, and how many calls were refused for coming from another."""

    nodes: dict[int, str] = field(default_factory=dict)
    refused: int = 0
    rank0: str | None = None
    """The incarnation of rank 0 the bindings were made under."""
    history: dict[int, dict[str, int | None]] = field(default_factory=dict)
    """Each rank's nodes ever bound, oldest binding first, the newest ``MAX_HISTORY``, each
    with the first step it can have produced (None: not released yet)."""
    complete: bool = False
    """A plan found no item anywhere, or a complete record was restored (see ``known``)."""
    unnamed: bool = False
    """A rank was bound with no known node (TLS off, an in-process call): its items'
    producers are not known, so the history never is (``known``)."""
    changes: int = 0
    """Counts changes of ``history`` and ``known``: the host saves the record when it moves."""
    granted: Mapping[int, str] | None = None
    """The controller's grant for the running job (``core.grant``), when one is in force:
    each rank's node decided before anyone joins, so no first come takes a rank."""

    @property
    def known(self) -> bool:
        """Whether the history names every node that can have produced an item."""
        return self.complete and not self.unnamed

    def check(self, rank: int, node: str | None) -> str:
        """Why ``node`` may not act as ``rank`` ("" if it may); a refusal is counted."""
        if node is None or node == LEGACY:
            return ""
        if self.granted is not None:
            owner = self.granted.get(rank)
            if owner == node:
                return ""
            self.refused += 1
            return (
                f"rank {rank} is granted to node {str(owner)[:100]!r} by mtc-controller's "
                f"assignment, not {node[:100]!r}"
            )
        held = self.nodes.get(rank)
        if held is None or held in (node, LEGACY):
            return ""
        self.refused += 1
        return (
            f"rank {rank} is held by node {held[:100]!r}, not {node[:100]!r}: a rank changes "
            "nodes only in a round rank 0 opens"
        )

    def bind(self, rank: int, node: str | None, *, running: bool = False) -> None:
        """``rank`` is ``node``'s from now on, unless it is bound already (to a named node).
        ``running``: adopted in steady state, it may have produced any step of the rank."""
        if node is None:
            if not self.unnamed:
                self.unnamed = True
                self.changes += 1
            return
        if self.nodes.get(rank) in (None, LEGACY):
            self.nodes[rank] = node
            self._remember(rank, node, 0 if running else None)

    def _remember(self, rank: int, node: str, since: int | None) -> None:
        tenures = self.history.setdefault(rank, {})
        if node in tenures:
            since = _earliest(tenures.pop(node), since)  # an earlier tenure counts still
        tenures[node] = since
        while len(tenures) > MAX_HISTORY:
            del tenures[next(iter(tenures))]
        self.changes += 1

    def rank0_joins(self, incarnation: str) -> None:
        """Rank 0's incarnation joins: a new one (the job restarted) frees every other rank
        for the nodes its round admits (their history stays); the first one known frees
        nothing."""
        if self.rank0 is not None and incarnation != self.rank0:
            self.nodes = {r: n for r, n in self.nodes.items() if r == 0}
        self.rank0 = incarnation

    def planned(self, *, fresh: bool) -> None:
        """A plan was made; ``fresh``: it found no item in any inventory or backup, so every
        item from now on is produced under bindings this history records."""
        if fresh and not self.complete:
            self.complete = True
            self.changes += 1

    def released(self, step: int | None) -> None:
        """The round restoring ``step`` (None: a fresh start) was released: its holders
        produce from that step on (a re-save of the restored step included)."""
        for rank, node in self.nodes.items():
            tenures = self.history.get(rank)
            if tenures is not None and node in tenures and tenures[node] is None:
                tenures[node] = 0 if step is None else step
                self.changes += 1

    def producers(self, rank: int, step: int) -> tuple[str, ...] | None:
        """The nodes that can have produced ``rank``'s items of ``step``; None: not known."""
        if not self.known:
            return None
        tenures = self.history.get(rank, {})
        return tuple(n for n, since in tenures.items() if since is not None and since <= step)

    def saved(self) -> SavedHolders:
        """The record to keep for a restart of this daemon."""
        history = {r: dict(t) for r, t in self.history.items()}
        return SavedHolders(dict(self.nodes), history, self.known)

    def restore(self, saved: SavedHolders, *, bindings: bool = True) -> None:
        """A restarted coordinator takes back the saved history, and (``bindings``, when it
        adopts the running ranks) the released round's holders."""
        if bindings:
            for rank, node in saved.nodes.items():
                self.nodes.setdefault(rank, node)
        for rank in saved.history.keys() | saved.nodes.keys():
            older = dict(saved.history.get(rank, {}))
            held = saved.nodes.get(rank)
            if held is not None and held not in older:
                older[held] = 0  # a record of a version without history: it ran, since when?
            newer = self.history.get(rank, {})
            merged = {n: s for n, s in older.items() if n not in newer}
            for node, since in newer.items():
                merged[node] = _earliest(older.get(node), since)
            self.history[rank] = dict(list(merged.items())[-MAX_HISTORY:])
        if saved.complete and not self.complete:
            self.complete = True
        self.changes += 1


def _earliest(a: int | None, b: int | None) -> int | None:
    """The earlier of two tenures' first steps (None: a tenure not begun)."""
    if a is None or b is None:
        return b if a is None else a
    return min(a, b)


def holders_json(saved: SavedHolders) -> dict[str, Any]:
    return {
        "holders": {str(r): n for r, n in sorted(saved.nodes.items())},
        "history": {
            str(r): [[n, s] for n, s in t.items()] for r, t in sorted(saved.history.items())
        },
        "complete": saved.complete,
    } | ({} if saved.released is None else {"released": _released_json(saved.released)})


def _released_json(released: Released) -> dict[str, Any]:
    return {
        "round": released.round,
        "rank0": released.rank0,
        "step": released.step,
        "incarnations": {str(r): i for r, i in sorted(released.incarnations.items())},
    }


def _incarnation(value: Any) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_INCARNATION_CHARS):
        raise ValueError(f"bad entry {value!r:.40}: not an incarnation id")
    return value


def _released(body: Any, ranks: int) -> Released | None:
    """The ``released`` entry of a saved body; ``ValueError`` unless it names one round of
    every rank of the job."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise ValueError("bad 'released'")  # noqa: TRY004 (a bad file, one error type)
    round_, step, incarnations = body.get("round"), body.get("step"), body.get("incarnations")
    if not (type(round_) is int and round_ > 0):
        raise ValueError("bad 'released' round")
    if not (step is None or (type(step) is int and step >= 0)):
        raise ValueError("bad 'released' step")
    if not (isinstance(incarnations, dict) and len(incarnations) == ranks):
        raise ValueError("bad 'released' incarnations: one per rank of the job")
    by_rank = {_rank(k, ranks): _incarnation(v) for k, v in incarnations.items()}
    return Released(round_, _incarnation(body.get("rank0")), step, by_rank)


def _rank(key: Any, ranks: int) -> int:
    if not (isinstance(key, str) and key.isdigit()):
        raise ValueError(f"bad entry {key!r:.40}: not a rank")
    rank = int(key)
    if not 0 <= rank < min(ranks, MAX_RANKS):
        raise ValueError(f"rank {rank} is out of range")
    return rank


def _node(value: Any) -> str:
    if not (isinstance(value, str) and len(value) <= MAX_NODE_CHARS):
        raise ValueError(f"bad entry {value!r:.40}: not a node name")
    return value


def _tenure(value: Any) -> tuple[str, int | None]:
    """One ``[node, first step]`` of a saved history."""
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"bad history entry {value!r:.40}")
    node, since = value
    if not (since is None or (type(since) is int and since >= 0)):
        raise ValueError(f"bad history entry {value!r:.40}: not a step")
    return _node(node), since


def holders_from_json(body: Any, ranks: int) -> SavedHolders:
    """The record in a saved body; ``ValueError`` unless every entry is a rank of the job
    and a node name. A record without ``history`` (an older version's) is incomplete."""
    holders = body.get("holders") if isinstance(body, dict) else None
    if not isinstance(holders, dict):
        raise ValueError("no 'holders' object")  # noqa: TRY004 (a bad file, one error type)
    nodes: dict[int, str] = {}
    for key, node in holders.items():
        nodes[_rank(key, ranks)] = _node(node)
    history_body = body.get("history", {})
    complete = body.get("complete", False)
    if not (isinstance(history_body, dict) and isinstance(complete, bool)):
        raise ValueError("bad 'history' or 'complete'")  # noqa: TRY004 (a bad file)
    history: dict[int, dict[str, int | None]] = {}
    for key, entries in history_body.items():
        if not isinstance(entries, list) or len(entries) > MAX_HISTORY:
            raise ValueError(f"bad history of rank {key!r:.40}")
        history[_rank(key, ranks)] = dict(_tenure(e) for e in entries)
    return SavedHolders(nodes, history, complete, _released(body.get("released"), ranks))
