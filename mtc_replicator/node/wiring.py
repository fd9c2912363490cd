"""The daemon's parts, wired once, in the order they can exist. No I/O of its own beyond what
the parts' constructors do (the TLS files, the store's directory, clients of the buckets).

1. ``unbound``: what needs no port, built when the process starts (``Unbound``): the TLS
   material, the store, the buckets and the registry, the thread pool, the coordinators
   this node may host (``host``), the job directories (``tenancy``) and the jobs that no
   longer run here.
2. The daemon opens the store and binds its ports (``node.daemon``).
3. ``assemble``: the rest, in one function, into one frozen set (``Wired``): the peer
   client, the coordinator calls of the hosted jobs (``coordinator_calls``, beside
   ``host``: two objects, two names), the incarnations' context, the root's supervisor, and
   the services registered on the bound server. Each consumer is handed what it uses, all
   of it there: nothing waits for the port with a None.

The services answer from parts of their own modules: push admission ``node.served``, node
status ``node.status.LiveStatus``, file events ``node.file_events``, restore-pin reports
``node.pin_reports``, ``mtc drop`` and the room for a push ``node.reclaim.Reclaim``.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import SERVICE as COORDINATOR_SERVICE
from mtc_replicator.cluster.registry import Registry, open_registry
from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.pacing import PaceRules
from mtc_replicator.core.signed import RecordTrust
from mtc_replicator.local.grants_file import GrantsFile
from mtc_replicator.local.holders_file import HoldersFile
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import LocalStore
from mtc_replicator.local.usedpins import UsedPins
from mtc_replicator.node.agent import AgentContext
from mtc_replicator.node.bucket_probes import BucketProbes
from mtc_replicator.node.file_events import FileEvents
from mtc_replicator.node.kept_upload import KeptUploads
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.owner_watch import handed_over
from mtc_replicator.node.pin_reports import PinRefusals
from mtc_replicator.node.pool_node import PoolNode
from mtc_replicator.node.rank_files import RankFiles
from mtc_replicator.node.reclaim import ForeignItems, Reclaim
from mtc_replicator.node.served import ServedJobs
from mtc_replicator.node.startup import open_backups, open_pool, open_tls
from mtc_replicator.node.status import SERVICE as NODE_SERVICE
from mtc_replicator.node.status import LiveStatus, NodeServicer
from mtc_replicator.node.supervisor import Neighbours, Supervisor
from mtc_replicator.node.tenancy import Tenancy
from mtc_replicator.obs.metrics import Metrics
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.restore_pins import StorePins
from mtc_replicator.transport.attesting import manifest_trust
from mtc_replicator.transport.datachannel import DataListener
from mtc_replicator.transport.grpc_server import RpcServer
from mtc_replicator.transport.obtaining import Obtaining
from mtc_replicator.transport.operator_signing import pin_trust
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.peer_servicer import PeerServicer, ServiceRules
from mtc_replicator.transport.peerwire import SERVICE as PEER_SERVICE
from mtc_replicator.transport.receiving import Receiving
from mtc_replicator.transport.signing import record_trust
from mtc_replicator.transport.tls import TlsMaterial


@dataclass(frozen=True)
class Unbound:
    """The daemon's parts that need no port."""

    opts: DaemonOptions
    metrics: Metrics
    tls: TlsMaterial | None
    """Mutual TLS for every network path; None: plaintext."""
    node_name: str | None
    """The node this daemon's certificate names (``LEGACY`` under a shared one); None
    without TLS."""
    store: LocalStore
    grants: GrantsFile
    trust: RecordTrust
    """Which signed records (``COMMIT``s, registry entries) are believed, and our seal."""
    manifests: ManifestTrust
    pacer: Pacer
    """The node's outgoing bytes: replication and backups under the limit, restores first."""
    backups: BackupStore | None
    registry: Registry | None
    executor: ThreadPoolExecutor
    """The one pool of blocking work, which the shutdown waits for."""
    env: dict[str, str]
    """The variables a ``replicator.yaml`` may name (``--expand-vars``), as set at start."""
    obtaining: Obtaining
    pool: PoolNode | None
    host: CoordinatorHost
    """The coordinators this node hosts (rank 0's of its jobs): their state machines."""
    tenancy: Tenancy
    """The job directories served: the root's and those in ``jobs/``."""
    foreign: ForeignItems
    """Items of jobs that no longer run here: given back when backed up."""
    reclaim: Reclaim
    """Drops of jobs that no longer run here: on request, for room, by TTL."""
    receiving: Receiving
    """Incoming items, checked and taken in: pushes served and pulls made alike."""
    kept_uploads: KeptUploads
    """``mtc upload``: a kept job's step to the backup, on demand."""
    buckets: BucketProbes
    pin_refusals: PinRefusals
    """Restore pins refused while they stand, told to the job's incarnations."""

    @property
    def own(self) -> str | None:
        """This node's name for grants and rank checks (None: no TLS, or a shared one)."""
        return self.node_name or None


def unbound(opts: DaemonOptions, metrics: Metrics) -> Unbound:
    """Build what needs no port. Raises ``TlsError`` or ``ValueError`` for unusable TLS
    files or options."""
    tls, node_name = open_tls(opts)
    own = node_name or None  # no identity without TLS, or under a shared one
    store = LocalStore(opts.checkpoint_dir, opts.store_dir)
    grants = GrantsFile.opened(store.root, required=opts.require_rank_grant)
    trust = record_trust(tls, accept_unsigned=opts.accept_unsigned_records)
    pacer = Pacer(
        PaceRules(rate=opts.max_transfer_rate, yield_to_saves=opts.yield_to_saves_seconds)
    )
    backups = open_backups(opts, trust, pacer)
    executor = ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="mtc-io")
    manifests = manifest_trust(tls, node_name, accept_unsigned=opts.accept_unsigned_records)
    registry = (
        open_registry(opts.registry, trust, timeout=opts.storage_timeout) if opts.registry else None
    )
    tenancy = Tenancy(opts.checkpoint_dir, lambda c: grants.missing(c, own))
    metrics.jobs_from(tenancy.running_jobs)
    foreign = ForeignItems(
        store, backups, ttl=opts.foreign_job_ttl, metrics=metrics, current=tenancy.running_jobs
    )
    reclaim = Reclaim(foreign, executor, tenancy.running_jobs)
    env = {k: os.environ[k] for k in opts.expand_vars if k in os.environ}
    kept_uploads = KeptUploads(
        store,
        backups,
        executor,
        foreign,
        current=tenancy.running_jobs,
        env=env,
        cancelled=pacer.halted.is_set,
        metrics=metrics,
    )
    return Unbound(
        opts=opts,
        metrics=metrics,
        tls=tls,
        node_name=node_name,
        store=store,
        grants=grants,
        trust=trust,
        manifests=manifests,
        pacer=pacer,
        backups=backups,
        registry=registry,
        executor=executor,
        env=env,
        obtaining=Obtaining(),
        pool=open_pool(opts, registry, manifests, store, executor),
        host=CoordinatorHost(),
        tenancy=tenancy,
        foreign=foreign,
        reclaim=reclaim,
        receiving=Receiving(store, executor, make_room=reclaim.room_for_push, metrics=metrics),
        kept_uploads=kept_uploads,
        buckets=BucketProbes(backups, registry),
        pin_refusals=PinRefusals(metrics, tenancy.incarnation_of),
    )


@dataclass(frozen=True)
class Wired:
    """The daemon's parts once its port is bound: assembled once (``assemble``), never
    changed."""

    parts: Unbound
    advertise: str
    """The address other nodes reach this one at."""
    peers: PeerClient
    coordinator_calls: Coordinators
    """The calls of the coordinators in ``parts.host``, both transports' (gRPC, and in
    process for a one-node job)."""
    ctx: AgentContext
    """What every incarnation of the root's directory is handed."""
    events: FileEvents
    stop: asyncio.Event
    supervisor: Supervisor
    """The root's handshakes and the incarnations they start."""

    def job_dir(self, name: str, path: Path, beside: Neighbours) -> Supervisor:
        """The supervisor of ``jobs/<name>/``, reached at ``path`` (``node.tenancy``)."""
        ctx = replace(self.ctx, checkpoint_dir=path, closed_files=set(), job_dir=name)
        opts = replace(self.parts.opts, checkpoint_dir=path)
        return _supervisor(
            self.parts, opts, ctx, advertise=self.advertise, stop=self.stop, beside=beside
        )


def assemble(
    parts: Unbound,
    rpc: RpcServer,
    channel: DataListener | None,
    advertise: str,
    *,
    stop: asyncio.Event,
    wake: asyncio.Event,
    loop: asyncio.AbstractEventLoop,
) -> Wired:
    """Everything that follows the bound port, and the Peer, Coordinator and Node services
    registered on ``rpc`` (bound, not started); ``channel``: the data channel, if any;
    ``stop`` and ``wake``: the daemon's loop's; ``loop``: where the pin reports of threads
    land."""
    opts = parts.opts
    peers = PeerClient(
        executor=parts.executor,
        metrics=parts.metrics,
        tls=parts.tls,
        pacer=parts.pacer,
        receiving=parts.receiving,
        data_streams=opts.data_streams,
    )
    calls = _coordinator_calls(parts, loop)
    ctx = AgentContext(
        checkpoint_dir=opts.checkpoint_dir,
        store=parts.store,
        backups=parts.backups,
        executor=parts.executor,
        peers=peers,
        coordinator_calls=calls,
        advertise=advertise,
        settle_seconds=opts.settle_seconds,
        rescan_seconds=opts.rescan_seconds,
        env=parts.env,
        registry=parts.registry,
        tls=parts.tls,
        report_after=opts.report_after_seconds,
        metrics=parts.metrics,
        obtaining=parts.obtaining,
        pacer=parts.pacer,
        foreign=parts.foreign,
        keep_steps=opts.keep_steps,
        manifests=parts.manifests,
        pool=parts.pool,
    )
    root = _supervisor(
        parts, opts, ctx, advertise=advertise, stop=stop, beside=parts.tenancy.beside(None)
    )
    parts.tenancy.root = root
    wired = Wired(parts, advertise, peers, calls, ctx, FileEvents(wake), stop, root)
    served = ServedJobs(parts.tenancy.incarnation_of, parts.store, parts.grants, parts.own)
    rpc.add_service(PEER_SERVICE, _peer_servicer(parts, channel, served).register)
    rpc.add_service(COORDINATOR_SERVICE, CoordinatorServicer(calls).register)
    ranks = RankFiles(opts.checkpoint_dir, opts.owner_file, parts.executor, parts.grants, parts.own)
    status = LiveStatus(
        parts.store,
        parts.tenancy.incarnations,
        peers,
        address=advertise,
        foreign=parts.foreign,
        node=parts.own,
    )
    node = NodeServicer(status, parts.reclaim.drop, parts.kept_uploads.upload, ranks.assign)
    rpc.add_service(NODE_SERVICE, node.register)
    return wired


def _supervisor(
    parts: Unbound,
    opts: DaemonOptions,
    ctx: AgentContext,
    *,
    advertise: str,
    stop: asyncio.Event,
    beside: Neighbours,
) -> Supervisor:
    return Supervisor(
        opts,
        ctx,
        foreign=parts.foreign,
        buckets=parts.buckets,
        host=parts.host,
        registry=parts.registry,
        advertise=lambda: advertise,
        stop=stop,
        neighbours=beside,
    )


def _peer_servicer(
    parts: Unbound, channel: DataListener | None, served: ServedJobs
) -> PeerServicer:
    """What peers call here: pushes admitted against the job served, pulls served."""
    opts = parts.opts
    return PeerServicer(
        parts.receiving,
        served.served,
        rules=ServiceRules(
            opts.max_step_lead,
            opts.idle_timeout_seconds,
            max_item_files=opts.max_item_files,
            data_streams=opts.data_streams,
            min_rate=opts.min_transfer_rate,
        ),
        metrics=parts.metrics,
        channel=channel,
        obtaining=parts.obtaining,
        pacer=parts.pacer,
        handed_over=lambda: handed_over(opts.owner_file, parts.store.root),
        trust=parts.manifests,
        pool=None if parts.pool is None else parts.pool.holding,
        readers=served.readers,
    )


def _coordinator_calls(parts: Unbound, loop: asyncio.AbstractEventLoop) -> Coordinators:
    """The calls of the coordinators ``parts.host`` holds, with the backup's steps, pins
    and commits."""
    backups = parts.backups
    pins = None
    if backups is not None:
        on_failure, on_refused = parts.pin_refusals.from_threads(loop)
        pins = StorePins(
            backups.objects,
            parts.trust,
            pin_trust=pin_trust(parts.tls, accept_unsigned=parts.opts.accept_unsigned_records),
            used=UsedPins(parts.store.root),
            on_failure=on_failure,
            on_refused=on_refused,
        )
    return Coordinators(
        parts.host,
        lambda job: backups.committed_steps(job) if backups else {},
        holders=HoldersFile(parts.store.root),
        on_rank_refused=functools.partial(parts.metrics.identity_refused, "rank"),
        grants=lambda job, nodes: parts.grants.holders(job, nodes, 0, parts.own),
        pins=pins,
        commit=backups.try_commit if backups else None,
    )
