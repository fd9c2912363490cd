"""The ``mtc.v1.Node`` service: a node's status for ``mtc status``, ``mtc drop``, ``mtc
upload``, and the peer probe.

``Status`` is read-only and cheap: the answer is assembled from what the daemon has in memory (the
store's index, the running incarnation, the peer client's last contacts); no disk or
network I/O in the handler. The probe asks every peer of the running job's health service
now and then, so a peer that died between two checkpoints shows as unreachable within
``PROBE_EVERY`` plus the probe's own timeout, not at the next push. ``Drop`` removes a
job's items through the daemon (``node.reclaim``), which owns the store; ``Upload`` uploads
a kept job's step to the backup (``node.kept_upload``); ``AssignRank`` writes a pod's rank
into CHECKPOINT_DIR (``node.rank_files``; only the controller's certificate reaches it:
``transport.identity``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio

from mtc_replicator import __version__
from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator._pb.mtc.v1 import node_pb2_grpc
from mtc_replicator.core.contacts import Contact
from mtc_replicator.core.foreign import DropRefused, HeldJob, UploadRefused
from mtc_replicator.core.jobname import is_job_name
from mtc_replicator.core.layout import off_node_copies
from mtc_replicator.core.rank_file import BadRankRecord, RankRecord
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.agent import Incarnation
from mtc_replicator.node.kept_upload import KeptUpload, UploadFailed
from mtc_replicator.node.rank_files import AssignRefused
from mtc_replicator.node.reclaim import Dropped, ForeignItems
from mtc_replicator.transport.peer_client import PeerClient

log = logging.getLogger(__name__)

SERVICE = "mtc.v1.Node"
PROBE_EVERY = 5.0
"""Seconds between two health probes of the running job's peers."""


def peer_addresses(incarnation: Incarnation | None) -> dict[int, str]:
    """The other ranks of the running job and where they are, as its coordinator said."""
    if incarnation is None or incarnation.member is None:
        return {}
    own = incarnation.config.node_rank
    addresses = incarnation.member.addresses
    return {r: a for r, a in sorted(addresses.items()) if r != own}


def peer_targets(incarnations: Sequence[Incarnation]) -> set[str]:
    """Where the running jobs' other ranks are: every peer this node may contact."""
    return {a for i in incarnations for a in peer_addresses(i).values()}


def _contact(rank: int, address: str, contact: Contact | None) -> pb.PeerContact:
    if contact is None:
        return pb.PeerContact(rank=rank, address=address)
    return pb.PeerContact(
        rank=rank,
        address=address,
        contacted=True,
        reachable=contact.reachable,
        last_contact_at=contact.at,
        last_answer_at=contact.last_answer_at or 0.0,
        error=contact.error or "",
    )


def incarnation_tag(incarnation_id: str) -> str:
    """What ``Status`` shows of an incarnation: the first 12 hex digits of its id's SHA-256.

    The id itself is what the coordinator takes as proof that a report comes from that
    rank's running incarnation (``core.coordination``); a caller of ``Status`` may hold any
    node certificate, so it gets a tag that tells incarnations apart and proves nothing.
    """
    return hashlib.sha256(incarnation_id.encode()).hexdigest()[:12]


def node_status(
    store: LocalStore,
    incarnations: Sequence[Incarnation],
    peers: PeerClient | None,
    address: str,
    job: str | None = None,
    *,
    foreign: Mapping[str, HeldJob] | None = None,
    node: str | None = None,
) -> pb.NodeStatusResponse:
    """Every job this node serves (its ``incarnations``: the root's and its job
    directories') or holds items of (or ``job`` only); ``foreign``: the jobs held that do
    not run here, as last surveyed (``node.reclaim``)."""
    held: dict[str, dict[int, set[int]]] = {}
    for item in store.manifests(job):
        held.setdefault(item.job, {}).setdefault(item.rank, set()).add(item.step)
    running = {i.config.job_name: i for i in incarnations if job in (None, i.config.job_name)}
    jobs = []
    for name in sorted(set(held) | set(running)):
        by_rank = held.get(name, {})
        status = pb.JobStatus(job=name)
        own: int | None = None
        incarnation = running.get(name)
        if incarnation is not None:
            own = incarnation.config.node_rank
            status.active = True
            status.incarnation = incarnation_tag(incarnation.id)
            status.rank = own
            status.nodes = incarnation.config.nodes
            status.phase = incarnation.phase.value
            status.off_node_copies = off_node_copies(incarnation.config)
            member = incarnation.member
            if member is not None:
                status.coordinator = member.coordinator or ""
                if member.last_replicated is not None:
                    status.last_replicated = member.last_replicated
                # The job's newest committed backup, as its coordinator last said (read
                # from the bucket when it started): the source of
                # mtc_newest_step{tier="backup"}, and known after a restart too.
                if member.backed_up is not None:
                    status.last_backed_up = member.backed_up
            for rank, peer in peer_addresses(incarnation).items():
                seen = peers.contacts.get(peer) if peers is not None else None
                status.peers.append(_contact(rank, peer, seen))
        gone = (foreign or {}).get(name)
        if incarnation is None and gone is not None:
            if gone.committed is not None:
                status.committed_backup_step = gone.committed
            status.kept_without_backup = not gone.backed_up
        status.local_steps.extend(sorted(by_rank.get(own, ())) if own is not None else ())
        for rank, steps in sorted(by_rank.items()):
            if rank != own:
                status.peer_copies.append(pb.HeldCopies(rank=rank, steps=sorted(steps)))
        jobs.append(status)
    return pb.NodeStatusResponse(address=address, version=__version__, jobs=jobs, node=node or "")


class LiveStatus:
    """``Status``'s answer (``node_status``) from the daemon's parts as they are at the call:
    the running incarnations, the peers' last contacts, the jobs held that do not run here."""

    def __init__(
        self,
        store: LocalStore,
        incarnations: Callable[[], Sequence[Incarnation]],
        peers: PeerClient,
        *,
        address: str,
        foreign: ForeignItems,
        node: str | None,
    ) -> None:
        self.store = store
        self.incarnations = incarnations
        self.peers = peers
        self.address = address
        self.foreign = foreign
        self.node = node

    def __call__(self, job: str | None) -> pb.NodeStatusResponse:
        return node_status(
            self.store,
            self.incarnations(),
            self.peers,
            self.address,
            job,
            foreign=self.foreign.last,
            node=self.node,
        )


Drop = Callable[[str, bool], Awaitable[Dropped]]
"""``drop(job, even_if_only_copy)``: drop a job's items; raises ``DropRefused``."""
Upload = Callable[[str, int | None], Awaitable[KeptUpload]]
"""``upload(job, step)``: upload a kept job's step (``node.kept_upload``); raises
``UploadRefused`` or ``UploadFailed``."""
Assign = Callable[[RankRecord, Sequence[str]], Awaitable[list[str]]]
"""``assign(record, holders)``: write a pod's rank files and keep the grant ``holders``
make (``node.rank_files``); the names written; raises ``AssignRefused`` when the pod is not
the one on this node, or the holders do not name this node at its rank."""


class NodeServicer(node_pb2_grpc.NodeServicer):
    """``mtc.v1.Node``; ``status(job)`` assembles the answer (``node_status``), ``drop``
    performs ``Drop``, ``upload`` ``Upload`` and ``assign`` ``AssignRank`` (None:
    UNIMPLEMENTED)."""

    def __init__(
        self,
        status: Callable[[str | None], pb.NodeStatusResponse],
        drop: Drop | None = None,
        upload: Upload | None = None,
        assign: Assign | None = None,
    ) -> None:
        self.status = status
        self.drop = drop
        self.upload = upload
        self.assign = assign

    async def Status(
        self,
        request: pb.NodeStatusRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.NodeStatusResponse:
        job = request.job or None
        if job is not None and not is_job_name(job):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a job name: {job!r:.80}")
        return self.status(job)

    async def Drop(
        self,
        request: pb.DropRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.DropResponse:
        job = request.job
        await _admit("Drop", job, self.drop is not None, context)
        assert self.drop is not None
        try:
            gone = await self.drop(job, request.even_if_only_copy)
        except DropRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        reply = pb.DropResponse(job=job, bytes=gone.bytes)
        for rank, steps in sorted(gone.steps.items()):
            reply.dropped.append(pb.HeldCopies(rank=rank, steps=sorted(steps)))
        if gone.committed is not None:
            reply.committed_backup_step = gone.committed
        return reply

    async def Upload(
        self,
        request: pb.UploadRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.UploadResponse:
        job = request.job
        await _admit("Upload", job, self.upload is not None, context)
        assert self.upload is not None
        step = request.step if request.HasField("step") else None
        try:
            done = await self.upload(job, step)
        except UploadRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except UploadFailed as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        return pb.UploadResponse(
            job=job,
            step=done.step,
            uploaded=[i.key for i in done.uploaded],
            bytes=done.bytes,
            committed=done.committed,
            already_committed=done.already_committed,
            missing_ranks=sorted({i.rank for i in done.missing}),
            backup=done.backup,
            seconds=done.seconds,
        )

    async def AssignRank(
        self,
        request: pb.AssignRankRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.AssignRankResponse:
        if self.assign is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this daemon assigns no ranks")
        assert self.assign is not None
        try:
            record = RankRecord(
                job=request.job,
                rank=request.rank,
                nodes=request.nodes,
                coordinator=request.coordinator,
                pod_uid=request.pod_uid,
                assignment=request.assignment,
                source=request.source,
            )
        except BadRankRecord as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad assignment: {exc}")
        try:
            written = await self.assign(record, tuple(request.holders))
        except AssignRefused as exc:
            log.warning("refused an assignment: %s", exc, extra={"job": record.job})
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.AssignRankResponse(written=written)

    def register(self, server: grpc.aio.Server) -> None:
        node_pb2_grpc.add_NodeServicer_to_server(self, server)


async def probe_peers(
    peers: PeerClient, addresses: Callable[[], Collection[str]], every: float = PROBE_EVERY
) -> None:
    """Health-probe the running jobs' peers every ``every`` seconds, until cancelled."""
    while True:
        targets = sorted(set(addresses()))
        if targets:
            results = await asyncio.gather(
                *(peers.probe(a) for a in targets), return_exceptions=True
            )
            for address, result in zip(targets, results, strict=True):
                if isinstance(result, Exception):
                    log.debug("probe of %s failed: %s", address, result)
        await asyncio.sleep(every)


async def _admit(
    what: str, job: str, served: bool, context: grpc.aio.ServicerContext[Any, Any]
) -> None:
    """An operator's call on one job's items (``Drop``, ``Upload``): a job name, a daemon
    that does it, and a warning line naming the caller, before anything is touched."""
    if not is_job_name(job):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a job name: {job!r:.80}")
    if not served:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"this daemon does no {what}")
    log.warning("%s of job %s asked by %s", what, job, context.peer(), extra={"job": job})
