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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtc_replicator.core.identity import LEGACY

MAX_RANKS = 1 << 20


@dataclass
class RankHolders:
    """Each bound rank's node, and how many calls were refused for coming from another."""

    nodes: dict[int, str] = field(default_factory=dict)
    refused: int = 0
    rank0: str | None = None
    """The incarnation of rank 0 the bindings were made under."""

    def check(self, rank: int, node: str | None) -> str:
        """Why ``node`` may not act as ``rank`` ("" if it may); a refusal is counted."""
        if node is None or node == LEGACY:
            return ""
        held = self.nodes.get(rank)
        if held is None or held in (node, LEGACY):
            return ""
        self.refused += 1
        return (
            f"rank {rank} is held by node {held[:100]!r}, not {node[:100]!r}: a rank changes "
            "nodes only in a round rank 0 opens"
        )

    def bind(self, rank: int, node: str | None) -> None:
        """``rank`` is ``node``'s from now on, unless it is bound already (to a named node)."""
        if node is not None and self.nodes.get(rank) in (None, LEGACY):
            self.nodes[rank] = node

    def rank0_joins(self, incarnation: str) -> None:
        """Rank 0's incarnation joins: a new one (the job restarted) frees every other rank
        for the nodes its round admits; the first one known frees nothing."""
        if self.rank0 is not None and incarnation != self.rank0:
            self.nodes = {r: n for r, n in self.nodes.items() if r == 0}
        self.rank0 = incarnation

    def restore(self, saved: Mapping[int, str]) -> None:
        """A restarted coordinator takes back the released round's holders."""
        for rank, node in saved.items():
            self.nodes.setdefault(rank, node)


def holders_json(nodes: Mapping[int, str]) -> dict[str, Any]:
    return {"holders": {str(r): n for r, n in sorted(nodes.items())}}


def holders_from_json(body: Any, ranks: int) -> dict[int, str]:
    """The holders in a saved body; ``ValueError`` unless every entry is a rank of the job
    and a node name."""
    holders = body.get("holders") if isinstance(body, dict) else None
    if not isinstance(holders, dict):
        raise ValueError("no 'holders' object")  # noqa: TRY004 (a bad file, one error type)
    out: dict[int, str] = {}
    for key, node in holders.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(node, str)):
            raise ValueError(f"bad entry {key!r:.40}: {node!r:.40}")
        rank = int(key)
        if not 0 <= rank < min(ranks, MAX_RANKS):
            raise ValueError(f"rank {rank} is out of range")
        out[rank] = node
    return out
