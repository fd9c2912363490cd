"""What the peer service is told of the jobs this node serves: who may push a job's items
here and who may read them. No I/O of its own (the store's index, the grants in memory).

The peer service (``transport.peer_servicer``) admits a push against the incarnation that
runs its job here (``core.admission.Served``): its config, its newest own step, its owner
and the nodes bound to the ranks that push to it, by the controller's grant when one is in
force (from the first second), else by the coordinator's word (from its first answer on).
While this node serves a granted run, only the grant's nodes read the job's items.
"""

from __future__ import annotations

from collections.abc import Callable

from mtc_replicator.core.admission import Served
from mtc_replicator.local.grants_file import GrantsFile
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.agent import Incarnation


class ServedJobs:
    """The jobs this node serves, as the peer service asks of them."""

    def __init__(
        self,
        running: Callable[[str], Incarnation | None],
        store: LocalStore,
        grants: GrantsFile,
        own: str | None,
    ) -> None:
        """``running``: the incarnation that runs a job here, if any (``node.tenancy``);
        ``own``: this node's name as its certificate says (None: not known)."""
        self.running = running
        self.store = store
        self.grants = grants
        self.own = own

    def served(self, job: str) -> Served | None:
        """What peers may push here of ``job``: the incarnation that runs it (None: none
        does), and its newest own step."""
        running = self.running(job)
        if running is None:
            return None
        config = running.config
        own = [i.step for i in self.store.manifests(config.job_name) if i.rank == config.node_rank]
        member = running.member
        granted = self.grants.holders(config.job_name, config.nodes, config.node_rank, self.own)
        holders = granted or ({} if member is None else member.rank_nodes)
        bound = granted is not None or (member is not None and member.answered)
        return Served(config, max(own, default=None), running.owner, holders, bound)

    def readers(self, job: str) -> frozenset[str] | None:
        """The nodes that may read ``job``'s items here (None: any node of the CA)."""
        running = self.running(job)
        return self.grants.readers(job, None if running is None else running.config, self.own)
