"""``mtc-replicator``: the per-node daemon process. Owns the process lifecycle.

One asyncio loop (uvloop when available) supervises: it watches CHECKPOINT_DIR, hands each
wake-up to the ``Supervisor`` (handshakes and incarnations), and on SIGTERM stops within
seconds without corrupting anything. Blocking disk and storage work runs in a bounded
thread pool, the one its shutdown waits for. This module wires the parts: the flags are
``node.options``, the handshake rule ``core.settle``, the owner ``node.owner_watch``, rank
0's coordinator ``node.rank0_coordinator``, the bucket probes ``node.bucket_probes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from mtc_replicator import __version__
from mtc_replicator.local.holders_file import HoldersFile

try:
    import uvloop
except ImportError:  # uvloop has no Windows build; asyncio's loop works, just slower
    uvloop = None  # type: ignore[assignment]
from mtc_replicator._pb.mtc.v1.node_pb2 import NodeStatusResponse
from mtc_replicator.cluster.coordinator_servicer import CoordinatorServicer
from mtc_replicator.cluster.coordinators import Coordinators
from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import SERVICE as COORDINATOR_SERVICE
from mtc_replicator.cluster.registry import open_registry
from mtc_replicator.core.admission import Served
from mtc_replicator.core.contract import CONFIG_FILE, parse_save_name
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.pacing import (
    PaceRules,
    format_rate,
)
from mtc_replicator.core.timeline import RestorePhase
from mtc_replicator.local.grants_file import GrantsFile
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import LocalStore, StoreError, StorePlacementError
from mtc_replicator.local.usedpins import UsedPins
from mtc_replicator.local.watcher import DirectoryWatcher, OnEvent
from mtc_replicator.node.agent import (
    AgentContext,
    restore_saved,
)
from mtc_replicator.node.bucket_probes import BucketProbes
from mtc_replicator.node.checkpoint_dir import is_own_output
from mtc_replicator.node.kept_upload import KeptUploads
from mtc_replicator.node.options import DaemonOptions, parse_args, unsafe_settings
from mtc_replicator.node.owner_watch import handed_over
from mtc_replicator.node.pin_reports import PinRefusals
from mtc_replicator.node.rank_files import RankFiles
from mtc_replicator.node.reclaim import ForeignItems, Reclaim
from mtc_replicator.node.startup import (
    CheckpointDirMissing,
    CheckpointFilesystem,
    check_checkpoint_dir,
    open_backups,
    open_pool,
    open_tls,
    tune_malloc,
)
from mtc_replicator.node.status import SERVICE as NODE_SERVICE
from mtc_replicator.node.status import NodeServicer, node_status, peer_targets, probe_peers
from mtc_replicator.node.supervisor import Neighbours, Supervisor
from mtc_replicator.node.tenancy import JobDir, Tenancy
from mtc_replicator.obs.health import Health, Heartbeat, Readiness, directory_check
from mtc_replicator.obs.logs import configure as configure_logging
from mtc_replicator.obs.metrics import (
    NO_METRICS,
    FilesystemCollector,
    Metrics,
    PrometheusMetrics,
    process_metrics,
)
from mtc_replicator.obs.metrics_endpoint import MetricsError, MetricsServer, serve
from mtc_replicator.storage.restore_pins import StorePins
from mtc_replicator.transport.attesting import manifest_trust
from mtc_replicator.transport.datachannel import DataListener
from mtc_replicator.transport.grpc_server import (
    RpcServer,
    ServerError,
    advertised_address,
    split_host_port,
)
from mtc_replicator.transport.identity import NodeIdentityInterceptor
from mtc_replicator.transport.obtaining import Obtaining
from mtc_replicator.transport.operator_signing import pin_trust
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.peer_servicer import PeerServicer, ServiceRules
from mtc_replicator.transport.peerwire import SERVICE as PEER_SERVICE
from mtc_replicator.transport.receiving import Receiving
from mtc_replicator.transport.signing import record_trust
from mtc_replicator.transport.tls import TlsError

log = logging.getLogger("mtc_replicator.node.daemon")


STARTED_LINE = "daemon started"
"""Logged once the daemon serves; whether it is ready (``/readyz``) is logged next, apart:
"ready" or "not ready: REASONS"."""
SERVER_GRACE_SECONDS = 5.0
"""How long transfers in flight may finish after SIGTERM before they are cancelled."""


class Daemon:
    """The ``mtc-replicator`` process on one CHECKPOINT_DIR: its parts wired, its servers, its
    loop (each wake-up handed to the ``Supervisor``) and its shutdown."""

    def __init__(self, opts: DaemonOptions) -> None:
        self.opts = opts
        self.tls, self.node_name = open_tls(opts)
        self._own = self.node_name or None  # no identity without TLS, or under a shared one
        self.store = LocalStore(opts.checkpoint_dir, opts.store_dir)
        self.grants = GrantsFile.opened(self.store.root, required=opts.require_rank_grant)
        self.trust = record_trust(self.tls, accept_unsigned=opts.accept_unsigned_records)
        self.pacer = Pacer(
            PaceRules(rate=opts.max_transfer_rate, yield_to_saves=opts.yield_to_saves_seconds)
        )
        """The node's outgoing bytes: replication and backups under the limit, restores first."""
        backups = open_backups(opts, self.trust, self.pacer)
        self._observe(opts)
        self.executor = ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="mtc-io")
        self.ctx = AgentContext(
            checkpoint_dir=opts.checkpoint_dir,
            store=self.store,
            backups=backups,
            executor=self.executor,
            settle_seconds=opts.settle_seconds,
            rescan_seconds=opts.rescan_seconds,
            env={k: os.environ[k] for k in opts.expand_vars if k in os.environ},
            metrics=self.metrics,
            obtaining=Obtaining(),
            pacer=self.pacer,
            manifests=manifest_trust(
                self.tls, self.node_name, accept_unsigned=opts.accept_unsigned_records
            ),
        )
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.exit_code = 0
        self.health_address: str | None = None
        """The plaintext health-only address, when ``--health-listen`` asks for one."""
        self.listen_address: str | None = None  # the gRPC server's, port 0 resolved, once bound
        self.advertise: str | None = opts.advertise
        """The address other nodes use to reach this one (defaults to the bound address)."""
        self.registry = (
            open_registry(opts.registry, self.trust, timeout=opts.storage_timeout)
            if opts.registry
            else None
        )
        ctx = self.ctx
        ctx.pool = open_pool(opts, self.registry, ctx.manifests, self.store, self.executor)
        self.coordinators = CoordinatorHost()
        self.tenancy = Tenancy(opts.checkpoint_dir, lambda c: self.grants.missing(c, self._own))
        """The job directories served: the root's and those in ``jobs/``."""
        self.metrics.jobs_from(self.tenancy.running_jobs)
        self.foreign = ForeignItems(
            self.store,
            backups,
            ttl=opts.foreign_job_ttl,
            metrics=self.metrics,
            current=self.tenancy.running_jobs,
        )
        """Items of jobs that no longer run here: given back when backed up."""
        self.ctx.foreign = self.foreign
        self.kept_uploads = KeptUploads(self.ctx, self.foreign, current=self.tenancy.running_jobs)
        """``mtc upload``: a kept job's step to the backup, on demand."""
        self.reclaim = Reclaim(self.foreign, self.executor, self.tenancy.running_jobs)
        """Drops of jobs that no longer run here: on request, for room, by TTL."""
        self.receiving = Receiving(
            self.store,
            self.executor,
            max_item_files=opts.max_item_files,
            make_room=self.reclaim.room_for_push,
            metrics=self.metrics,
        )
        """Incoming items, checked and taken in: pushes served and pulls made alike."""
        self.buckets = BucketProbes(backups, self.registry)
        self.health = Health(
            live=[self.heartbeat.check],
            ready=[
                self.readiness.check,
                directory_check(opts.checkpoint_dir, "CHECKPOINT_DIR"),
                *(check.readiness for check, _ in self.buckets.checks),
            ],
        )
        self.ctx.registry = self.registry
        self.ctx.report_after = opts.report_after_seconds
        self.ctx.keep_steps = opts.keep_steps
        self.ctx.tls = self.tls
        self.supervisor = self._supervisor(opts, self.ctx, self.tenancy.beside(None))
        """The root's handshakes and the incarnations they start."""
        self.tenancy.root = self.supervisor
        self.pin_refusals.running = self.tenancy.incarnation_of

    def _supervisor(self, opts: DaemonOptions, ctx: AgentContext, beside: Neighbours) -> Supervisor:
        return Supervisor(
            opts,
            ctx,
            foreign=self.foreign,
            buckets=self.buckets,
            coordinators=self.coordinators,
            registry=self.registry,
            advertise=lambda: self.advertise,
            stop=self._stop,
            neighbours=beside,
        )

    def _job_dir(self, name: str, path: Path, beside: Neighbours) -> Supervisor:
        """The supervisor of ``jobs/<name>/``, reached at ``path`` (``node.tenancy``)."""
        ctx = replace(self.ctx, checkpoint_dir=path, closed_files=set(), job_dir=name)
        return self._supervisor(replace(self.opts, checkpoint_dir=path), ctx, beside)

    def _observe(self, opts: DaemonOptions) -> None:
        """The metrics (Prometheus when ``--metrics`` asks for it), the heartbeat and the
        readiness the health checks read."""
        self._prometheus = (
            PrometheusMetrics(phases=[p.value for p in RestorePhase]) if opts.metrics else None
        )
        self.metrics: Metrics = self._prometheus or NO_METRICS
        self.pin_refusals = PinRefusals(self.metrics)
        """Restore pins refused while they stand, told to the job's incarnations."""
        if self._prometheus is not None:
            process_metrics(self._prometheus.registry)
            self._prometheus.registry.register(
                FilesystemCollector(
                    opts.checkpoint_dir, "mtc_checkpoint_dir", "CHECKPOINT_DIR", kind=self._fs_kind
                )
            )
        self.checkpoint_fs = CheckpointFilesystem(None)
        """CHECKPOINT_DIR's filesystem, read when the store is opened (it warns if not RAM)."""
        self.heartbeat = Heartbeat()
        """Beaten by a task in the event loop: ``/healthz`` fails when the loop stalls."""
        self.readiness = Readiness(stage="opening the store")
        self.metrics.pacing(self.pacer.counts, opts.max_transfer_rate)
        self._metrics_server: MetricsServer | None = None

    def _fs_kind(self) -> tuple[str | None, bool]:
        return self.checkpoint_fs.fs_type, self.checkpoint_fs.in_memory

    def serving(self, job: str) -> Served | None:
        """What peers may push here of ``job``: the incarnation that runs it (None: none
        does), and its newest own step."""
        running = self.tenancy.incarnation_of(job)
        if running is None:
            return None
        config = running.config
        own = [i.step for i in self.store.manifests(config.job_name) if i.rank == config.node_rank]
        member = running.member
        # The controller's grant, when in force, from the first second; else the
        # coordinator's word, from its first answer on.
        granted = self.grants.holders(config.job_name, config.nodes, config.node_rank, self._own)
        holders = granted or ({} if member is None else member.rank_nodes)
        bound = granted is not None or (member is not None and member.answered)
        return Served(config, max(own, default=None), running.owner, holders, bound)

    def _on_event(
        self,
        name: str | None,
        finished: bool,
        renamed: bool = False,
        supervisor: Supervisor | None = None,
    ) -> None:
        """A file event in the root (``supervisor`` None) or in a job directory."""
        if name is not None and is_own_output(name):
            # Our own writes (an error line, a marker) must not wake us: an error written
            # on every wake-up would otherwise become a busy loop.
            return
        supervisor = supervisor or self.supervisor
        if name == CONFIG_FILE:
            supervisor.handshake.event(finished, renamed)
        elif name and parse_save_name(name) is not None:
            # Only `.save` files need "closed after writing"; other names (our unique temp
            # files among them) would make the set grow for the daemon's whole life.
            if finished:
                supervisor.ctx.closed_files.add(name)
            else:
                supervisor.ctx.closed_files.discard(name)  # written again after its close
        self._wake.set()
        if supervisor.incarnation is not None:
            supervisor.incarnation.wake()

    def _request_stop(self) -> None:
        # Not ready from the signal on, not once the shutdown is over: Services stop sending
        # to a pod that says "stopping" while it still drains.
        self.readiness.stopping = True
        self._stop.set()
        self._wake.set()  # the loop may sit in a one-second wait for file events

    async def run(self) -> None:
        """Serve until SIGTERM; ``/metrics``, ``/healthz`` and ``/readyz`` from the start, so
        that a long store recovery reads as "not ready" rather than as no answer."""
        heart = asyncio.create_task(self._beat(), name="mtc-heartbeat")
        buckets = asyncio.create_task(self.buckets.run(), name="mtc-bucket-probe")
        try:
            self._serve_metrics()
            await self._run()
        except MetricsError as exc:
            log.error("%s", exc)
            self.exit_code = 3
        finally:
            self.readiness.stopping = True
            heart.cancel()
            buckets.cancel()
            if self._metrics_server is not None:
                self._metrics_server.close()
                self._metrics_server = None

    async def _report_readiness(self, rpc: RpcServer) -> None:
        """Mirror ``/readyz`` on the gRPC health service ``readiness`` (kubelet's probes use
        the plaintext gRPC health port), and log the first state and each change, with its
        reasons: "ready" or "not ready: ..." (never a second "ready" word on the start line)."""
        was: list[str] | None = None
        while True:
            problems = self.health.readiness()
            if problems != was:
                await rpc.set_ready(not problems)
                if problems:
                    log.warning("not ready: %s", "; ".join(problems))
                else:
                    log.info("ready")
                was = problems
            await asyncio.sleep(1.0)

    async def _beat(self) -> None:
        while True:
            self.heartbeat.beat()
            await asyncio.sleep(1.0)

    async def _run(self) -> None:
        """The daemon's life in steps: the store, the servers, the watch on CHECKPOINT_DIR,
        the loop until SIGTERM, the shutdown."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop)
        if not await self._open_store(loop):
            return
        try:
            # Before the Peer server lists a thing: a node handed over while we were down
            # serves nothing of its previous owner's (``core.handoff``).
            await self.supervisor.owner_now()
        except BadOwner as exc:
            log.warning("cannot tell whose this node's store is yet: %s", exc)
        started = await self._start_servers(loop)
        if started is None:
            return
        rpc, channel = started
        peers = self.ctx.peers
        assert peers is not None
        probe = asyncio.create_task(
            probe_peers(peers, lambda: peer_targets(self.tenancy.incarnations())),
            name="peer-probe",
        )
        tasks = (
            [probe] if self.ctx.pool is None else [probe, self.ctx.pool.start(self.ctx.advertise)]
        )
        # A yaml written while we were down has no events left to tell: trust it.
        self.supervisor.handshake.trust_existing()
        watcher = DirectoryWatcher(self.opts.checkpoint_dir, self._on_event)
        watcher.start(loop)
        resumed = restore_saved(self.ctx)
        if resumed is not None:
            await self.supervisor.resume(resumed)
        for warning in unsafe_settings(
            self.opts, tls=self.tls is not None, listen=self.listen_address
        ):
            log.warning("%s", warning)
        self.readiness.stage = None
        self._log_ready(channel)
        await rpc.set_serving()
        readiness = asyncio.create_task(self._report_readiness(rpc), name="mtc-readiness")
        try:
            await self._serve()
        finally:
            await self._shutdown(rpc, channel, watcher, [readiness, *tasks])

    async def _open_store(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Open (and recover) the store; False, with the exit code set, when it cannot be."""
        try:
            # Never created here: a mistyped path would be served on whatever disk holds it.
            self.checkpoint_fs = check_checkpoint_dir(self.opts.checkpoint_dir)
            report = await loop.run_in_executor(self.executor, self.store.open)
        except CheckpointDirMissing as exc:
            log.error("%s", exc)
            self.exit_code = 2
            return False
        except StorePlacementError as exc:
            log.error("%s", exc)
            self.exit_code = 2
            return False
        except StoreError as exc:
            log.error("%s", exc)
            self.exit_code = 3
            return False
        except OSError as exc:
            # A directory this process cannot create or write (read-only, owned by another
            # user, a name too long): a configuration error, said in one line.
            log.error(
                "cannot use CHECKPOINT_DIR %s or the store %s: %s: give the daemon a writable "
                "directory on the RAM disk (--checkpoint-dir, --store-dir)",
                self.opts.checkpoint_dir,
                self.store.root,
                exc,
            )
            self.exit_code = 2
            return False
        self.readiness.stage = "starting the servers"
        log.info(
            "store opened: %d items, %d pending ingest, %d discarded",
            report.items,
            len(report.pending_ingest),
            len(report.discarded),
        )
        log.info(
            "outgoing transfers: replication and backups at most %s, saves hold them up "
            "to %gs, restores first and never throttled",
            format_rate(self.opts.max_transfer_rate),
            self.opts.yield_to_saves_seconds,
        )
        return True

    async def _start_servers(
        self, loop: asyncio.AbstractEventLoop
    ) -> tuple[RpcServer, DataListener | None] | None:
        """Bind the gRPC server (peer, coordinator and node services) and the data channel,
        then start them; None, with the store closed and the exit code set, when a port
        cannot be had."""
        refused = self.metrics.identity_refused  # "rpc", or "assign": not the controller
        rpc = RpcServer(
            NodeIdentityInterceptor(self.tls.rule, refused) if self.tls is not None else None
        )
        channel: DataListener | None = None
        if self.opts.data_port is not None:
            try:
                host = split_host_port(self.opts.listen)[0]
                channel = DataListener(host, self.opts.data_port, tls=self.tls)
            except OSError as exc:
                log.error("%s", exc)
                self.exit_code = 3
                self.store.close()
                return None
        rpc.add_service(PEER_SERVICE, self._peer_servicer(channel).register)
        self.ctx.coordinators = self._coordinators(loop)
        rpc.add_service(COORDINATOR_SERVICE, CoordinatorServicer(self.ctx.coordinators).register)
        ranks = RankFiles(
            self.opts.checkpoint_dir, self.opts.owner_file, self.executor, self.grants, self._own
        )
        node = NodeServicer(self._status, self.reclaim.drop, self.kept_uploads.upload, ranks.assign)
        rpc.add_service(NODE_SERVICE, node.register)
        try:
            credentials = self.tls.server_credentials() if self.tls is not None else None
            self.listen_address = rpc.bind(self.opts.listen, credentials)
            if self.opts.health_listen is not None:
                self.health_address = rpc.bind_health(self.opts.health_listen)
        except ServerError as exc:
            log.error("%s", exc)
            self.exit_code = 3
            self.store.close()
            if channel is not None:
                await channel.close()
            return None
        self.advertise = self.opts.advertise or advertised_address(self.listen_address)
        self.ctx.advertise = self.advertise
        self.ctx.peers = PeerClient(
            executor=self.executor,
            metrics=self.metrics,
            tls=self.tls,
            pacer=self.pacer,
            receiving=self.receiving,
        )
        await rpc.start()
        if channel is not None:
            channel.start()
        contacts = self.ctx.peers.contacts
        self.metrics.peer_contacts(
            lambda: contacts.snapshot(time.time()),
            lambda: peer_targets(self.tenancy.incarnations()),
        )
        return rpc, channel

    def _peer_servicer(self, channel: DataListener | None) -> PeerServicer:
        """What peers call here: pushes admitted against the job served, pulls served."""
        return PeerServicer(
            self.receiving,
            self.serving,
            rules=ServiceRules(
                self.opts.max_step_lead,
                self.opts.idle_timeout_seconds,
                min_rate=self.opts.min_transfer_rate,
            ),
            metrics=self.metrics,
            channel=channel,
            obtaining=self.ctx.obtaining,
            pacer=self.pacer,
            handed_over=lambda: handed_over(self.opts.owner_file, self.store.root),
            trust=self.ctx.manifests,
            pool=None if self.ctx.pool is None else self.ctx.pool.holding,
            readers=lambda job: self.grants.readers(
                job, getattr(self.tenancy.incarnation_of(job), "config", None), self._own
            ),
        )

    def _coordinators(self, loop: asyncio.AbstractEventLoop) -> Coordinators:
        """The coordinators this node hosts, with the backup's steps, pins and commits."""
        backups = self.ctx.backups
        return Coordinators(
            self.coordinators,
            lambda job: backups.committed_steps(job) if backups else {},
            holders=HoldersFile(self.store.root),
            on_rank_refused=functools.partial(self.metrics.identity_refused, "rank"),
            grants=lambda job, nodes: self.grants.holders(job, nodes, 0, self._own),
            pins=StorePins(
                backups.objects,
                self.trust,
                pin_trust=pin_trust(self.tls, accept_unsigned=self.opts.accept_unsigned_records),
                used=UsedPins(self.store.root),
                on_failure=lambda *failed: loop.call_soon_threadsafe(
                    self.pin_refusals.not_removed, *failed
                ),
                on_refused=lambda *refused: loop.call_soon_threadsafe(
                    self.pin_refusals.refused, *refused
                ),
            )
            if backups
            else None,
            commit=backups.try_commit if backups else None,
        )

    def _log_ready(self, channel: DataListener | None) -> None:
        """The line that says the daemon serves, and with what."""
        log.info(
            "%s: checkpoint-dir=%s store-dir=%s listen=%s advertise=%s backup=%s version=%s "
            "tls=%s node=%s health=%s metrics=%s data-port=%s owner-file=%s",
            STARTED_LINE,
            self.opts.checkpoint_dir,
            self.store.root,
            self.listen_address,
            self.advertise,
            self.opts.backup,
            __version__,
            "on" if self.tls is not None else "off",
            "(shared certificate)" if self.node_name == LEGACY else self.node_name,
            self.health_address,
            self._metrics_server.address if self._metrics_server else None,
            channel.port if channel is not None else "off",
            self.opts.owner_file or "off",
        )

    async def _serve(self) -> None:
        """Until SIGTERM: the handshake, the owner and the reclaim, at each file event or
        tick."""
        while not self._stop.is_set():
            tick = self.tenancy.next_check_in()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=tick)
            self._wake.clear()
            await self._serve_job_dirs()
            for supervisor in self.tenancy.supervisors():
                await supervisor.check_config()
                self.pin_refusals.tell(supervisor.incarnation)
                await supervisor.check_owner()
            await self.reclaim.now_and_then()

    async def _serve_job_dirs(self) -> None:
        """New job directories: watched, their handshake trusted, a saved incarnation
        resumed (``node.tenancy``)."""
        loop = asyncio.get_running_loop()
        for job_dir in self.tenancy.scan(self._job_dir, self._job_dir_events):
            assert job_dir.watcher is not None
            job_dir.watcher.start(loop)
            job_dir.supervisor.handshake.trust_existing()
            resumed = restore_saved(job_dir.supervisor.ctx)
            if resumed is not None:
                await job_dir.supervisor.resume(resumed)

    def _job_dir_events(self, job_dir: JobDir) -> OnEvent:
        return functools.partial(self._on_event, supervisor=job_dir.supervisor)

    async def _shutdown(
        self,
        rpc: RpcServer,
        channel: DataListener | None,
        watcher: DirectoryWatcher,
        tasks: list[asyncio.Task[None]],
    ) -> None:
        """Stop in order: the drain on SIGTERM, the servers (transfers in flight get
        ``SERVER_GRACE_SECONDS``), the incarnation, the watch, the pool, the store."""
        self.readiness.stopping = True  # whatever ended the loop
        log.info("stopping")
        for task in tasks:
            task.cancel()
        for supervisor in self.tenancy.supervisors():
            supervisor.rank0.cancel()
        if self._stop.is_set():
            # At once, each within --drain-seconds: the pod's grace period bounds them all.
            await asyncio.gather(*(s.drain() for s in self.tenancy.supervisors()))
        self.coordinators.close()  # long polls answer at once instead of being cut off
        await rpc.stop(SERVER_GRACE_SECONDS)
        # Uploads and pushes still in worker threads end at their next paced slice, so
        # the pool's shutdown below does not wait for a whole item.
        self.pacer.halt()
        if channel is not None:
            await channel.close()
        for running in self.tenancy.incarnations():
            await running.stop()
        watcher.stop()
        self.tenancy.close()
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.store.close()
        log.info("stopped")

    def _status(self, job: str | None) -> NodeStatusResponse:
        """What ``mtc status`` shows of this node (``mtc.v1.Node``)."""
        return node_status(
            self.store,
            self.tenancy.incarnations(),
            self.ctx.peers,
            self.advertise or "",
            job,
            foreign=self.foreign.last,
            node=self.node_name or None,
        )

    def _serve_metrics(self) -> None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` from a thread when ``--metrics``
        asks for it."""
        if self._prometheus is not None and self.opts.metrics is not None:
            self._metrics_server = serve(self._prometheus.registry, self.opts.metrics, self.health)


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    configure_logging(opts.log_level, opts.log_format)
    tune_malloc()
    try:
        daemon = Daemon(opts)
    except (ValueError, TlsError) as exc:
        log.error("%s", exc)
        return 2
    if uvloop is None:
        asyncio.run(daemon.run())
    else:
        uvloop.run(daemon.run())
    return daemon.exit_code


if __name__ == "__main__":
    sys.exit(main())
