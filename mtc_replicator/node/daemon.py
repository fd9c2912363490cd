"""``mtc-replicator``: the per-node daemon process. Owns the process lifecycle.

One asyncio loop (uvloop when available) supervises: it watches CHECKPOINT_DIR, hands each
wake-up to the ``Supervisor`` (handshakes and incarnations), and on SIGTERM stops within
seconds without corrupting anything. Blocking disk and storage work runs in a bounded
thread pool, the one its shutdown waits for. The parts are wired in ``node.wiring`` (what
needs no port at start, the rest once the port is bound); the flags are ``node.options``,
the handshake rule ``core.settle``, the owner ``node.owner_watch``, rank 0's coordinator
``node.rank0_coordinator``, the bucket probes ``node.bucket_probes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Sequence

from mtc_replicator import __version__

try:
    import uvloop
except ImportError:  # uvloop has no Windows build; asyncio's loop works, just slower
    uvloop = None  # type: ignore[assignment]
from mtc_replicator.core.contract import JOB_DIRS
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.ownership import BadOwner
from mtc_replicator.core.pacing import format_rate
from mtc_replicator.core.timeline import RestorePhase
from mtc_replicator.local.store import StoreError, StorePlacementError
from mtc_replicator.local.watcher import DirectoryWatcher
from mtc_replicator.node.agent import restore_saved
from mtc_replicator.node.options import DaemonOptions, parse_args, unsafe_settings
from mtc_replicator.node.startup import (
    CheckpointDirMissing,
    CheckpointFilesystem,
    check_checkpoint_dir,
    tune_malloc,
)
from mtc_replicator.node.status import peer_targets, probe_peers
from mtc_replicator.node.wiring import Wired, assemble, unbound
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
from mtc_replicator.transport.datachannel import DataListener
from mtc_replicator.transport.grpc_server import (
    RpcServer,
    ServerError,
    advertised_address,
    split_host_port,
)
from mtc_replicator.transport.identity import NodeIdentityInterceptor
from mtc_replicator.transport.tls import TlsError

log = logging.getLogger("mtc_replicator.node.daemon")


STARTED_LINE = "daemon started"
"""Logged once the daemon serves; whether it is ready (``/readyz``) is logged next, apart:
"ready" or "not ready: REASONS"."""
SERVER_GRACE_SECONDS = 5.0
"""How long transfers in flight may finish after SIGTERM before they are cancelled."""


class Daemon:
    """The ``mtc-replicator`` process on one CHECKPOINT_DIR: its lifecycle (the store opened,
    the ports bound, the parts wired once: ``node.wiring``), its loop (each wake-up handed to
    the supervisors) and its shutdown."""

    def __init__(self, opts: DaemonOptions) -> None:
        self.opts = opts
        self._observe(opts)
        self.parts = unbound(opts, self.metrics)
        """What needs no port."""
        self.metrics.pacing(self.parts.pacer.counts, opts.max_transfer_rate)
        self.health = Health(
            live=[self.heartbeat.check],
            ready=[
                self.readiness.check,
                directory_check(opts.checkpoint_dir, "CHECKPOINT_DIR"),
                *(check.readiness for check, _ in self.parts.buckets.checks),
            ],
        )
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.exit_code = 0
        self.health_address: str | None = None
        """The plaintext health-only address, when ``--health-listen`` asks for one."""
        self.listen_address: str | None = None  # the gRPC server's, port 0 resolved, once bound

    def wire(self, rpc: RpcServer, channel: DataListener | None, advertise: str) -> Wired:
        """The rest of the parts, once ``rpc`` is bound (``node.wiring.assemble``)."""
        return assemble(
            self.parts,
            rpc,
            channel,
            advertise,
            stop=self._stop,
            wake=self._wake,
            loop=asyncio.get_running_loop(),
        )

    def _observe(self, opts: DaemonOptions) -> None:
        """The metrics (Prometheus when ``--metrics`` asks for it), the heartbeat and the
        readiness the health checks read."""
        self._prometheus = (
            PrometheusMetrics(phases=[p.value for p in RestorePhase]) if opts.metrics else None
        )
        self.metrics: Metrics = self._prometheus or NO_METRICS
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
        self._metrics_server: MetricsServer | None = None

    def _fs_kind(self) -> tuple[str | None, bool]:
        return self.checkpoint_fs.fs_type, self.checkpoint_fs.in_memory

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
        buckets = asyncio.create_task(self.parts.buckets.run(), name="mtc-bucket-probe")
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
        """The daemon's life in steps: the store, the ports, the parts wired, the servers,
        the watch on CHECKPOINT_DIR, the loop until SIGTERM, the shutdown."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop)
        if not await self._open_store(loop):
            return
        bound = await self._bind()
        if bound is None:
            return
        rpc, channel = bound
        assert self.listen_address is not None
        advertise = self.opts.advertise or advertised_address(self.listen_address)
        wired = self.wire(rpc, channel, advertise)
        try:
            # Before the Peer server lists a thing: a node handed over while we were down
            # serves nothing of its previous owner's (``core.handoff``).
            await wired.supervisor.owner_now()
        except BadOwner as exc:
            log.warning("cannot tell whose this node's store is yet: %s", exc)
        await self._start_servers(rpc, channel, wired)
        probe = asyncio.create_task(
            probe_peers(wired.peers, lambda: peer_targets(self.parts.tenancy.incarnations())),
            name="peer-probe",
        )
        pool = self.parts.pool
        tasks = [probe] if pool is None else [probe, pool.start(wired.advertise)]
        # A yaml written while we were down has no events left to tell: trust it.
        wired.supervisor.handshake.trust_existing()
        watcher = DirectoryWatcher(self.opts.checkpoint_dir, wired.events.of(wired.supervisor))
        watcher.start(loop)
        resumed = restore_saved(wired.ctx)
        if resumed is not None:
            await wired.supervisor.resume(resumed)
        for warning in unsafe_settings(
            self.opts, tls=self.parts.tls is not None, listen=self.listen_address
        ):
            log.warning("%s", warning)
        self.readiness.stage = None
        self._log_ready(channel, wired.advertise)
        await rpc.set_serving()
        readiness = asyncio.create_task(self._report_readiness(rpc), name="mtc-readiness")
        try:
            await self._serve(wired)
        finally:
            await self._shutdown(rpc, channel, watcher, [readiness, *tasks])

    async def _open_store(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Open (and recover) the store; False, with the exit code set, when it cannot be."""
        store = self.parts.store
        try:
            # Never created here: a mistyped path would be served on whatever disk holds it.
            self.checkpoint_fs = check_checkpoint_dir(self.opts.checkpoint_dir)
            report = await loop.run_in_executor(self.parts.executor, store.open)
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
                store.root,
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

    async def _bind(self) -> tuple[RpcServer, DataListener | None] | None:
        """Bind the gRPC port (and the health-only one) and the data channel, serving
        nothing yet; None, with the store closed and the exit code set, when a port cannot
        be had."""
        tls = self.parts.tls
        refused = self.metrics.identity_refused  # "rpc", or "assign": not the controller
        rpc = RpcServer(NodeIdentityInterceptor(tls.rule, refused) if tls is not None else None)
        channel: DataListener | None = None
        try:
            if self.opts.data_port is not None:
                host = split_host_port(self.opts.listen)[0]
                channel = DataListener(host, self.opts.data_port, tls=tls)
            credentials = tls.server_credentials() if tls is not None else None
            self.listen_address = rpc.bind(self.opts.listen, credentials)
            if self.opts.health_listen is not None:
                self.health_address = rpc.bind_health(self.opts.health_listen)
        except (OSError, ServerError) as exc:
            log.error("%s", exc)
            self.exit_code = 3
            self.parts.store.close()
            if channel is not None:
                await channel.close()
            return None
        return rpc, channel

    async def _start_servers(
        self, rpc: RpcServer, channel: DataListener | None, wired: Wired
    ) -> None:
        """Serve: the gRPC services ``wired`` registered, then the data channel."""
        await rpc.start()
        if channel is not None:
            channel.start()
        contacts = wired.peers.contacts
        self.metrics.peer_contacts(
            lambda: contacts.snapshot(time.time()),
            lambda: peer_targets(self.parts.tenancy.incarnations()),
        )

    def _log_ready(self, channel: DataListener | None, advertise: str) -> None:
        """The line that says the daemon serves, and with what."""
        log.info(
            "%s: checkpoint-dir=%s store-dir=%s listen=%s advertise=%s backup=%s version=%s "
            "tls=%s node=%s health=%s metrics=%s data-port=%s data-streams=%d owner-file=%s",
            STARTED_LINE,
            self.opts.checkpoint_dir,
            self.parts.store.root,
            self.listen_address,
            advertise,
            self.opts.backup,
            __version__,
            "on" if self.parts.tls is not None else "off",
            "(shared certificate)" if self.parts.node_name == LEGACY else self.parts.node_name,
            self.health_address,
            self._metrics_server.address if self._metrics_server else None,
            channel.port if channel is not None else "off",
            self.opts.data_streams,
            self.opts.owner_file or "off",
        )

    async def _serve(self, wired: Wired) -> None:
        """Until SIGTERM: the handshake, the owner and the reclaim, at each file event or
        tick."""
        tenancy = self.parts.tenancy
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tenancy.next_check_in()):
                    await self._wake.wait()
            self._wake.clear()
            await self._serve_job_dirs(wired)
            for supervisor in tenancy.supervisors():
                await supervisor.check_config()
                self.parts.pin_refusals.tell(supervisor.incarnation)
                await supervisor.check_owner()
            await self.parts.reclaim.now_and_then()

    async def _serve_job_dirs(self, wired: Wired) -> None:
        """A job whose directory was removed ends as at a job's end (its newest step
        drained first); new job directories: watched, their handshake trusted, a saved
        incarnation resumed (``node.tenancy``)."""
        for name, supervisor in self.parts.tenancy.orphans():
            await supervisor.end_incarnation(drain=f"its directory {JOB_DIRS}/{name} was removed")
        loop = asyncio.get_running_loop()
        for job_dir in self.parts.tenancy.scan(
            wired.job_dir, lambda d: wired.events.of(d.supervisor)
        ):
            job_dir.watch(loop)
            job_dir.supervisor.handshake.trust_existing()
            resumed = restore_saved(job_dir.supervisor.ctx)
            if resumed is not None:
                await job_dir.supervisor.resume(resumed)

    async def _shutdown(
        self,
        rpc: RpcServer,
        channel: DataListener | None,
        watcher: DirectoryWatcher,
        tasks: list[asyncio.Task[None]],
    ) -> None:
        """Stop in order: the drain on SIGTERM, the servers (transfers in flight get
        ``SERVER_GRACE_SECONDS``), the incarnation, the watch, the pool, the store."""
        parts = self.parts
        self.readiness.stopping = True  # whatever ended the loop
        log.info("stopping")
        for task in tasks:
            task.cancel()
        for supervisor in parts.tenancy.supervisors():
            supervisor.rank0.cancel()
        if self._stop.is_set():
            # At once, each within --drain-seconds: the pod's grace period bounds them all.
            await asyncio.gather(*(s.drain() for s in parts.tenancy.supervisors()))
        parts.host.close()  # long polls answer at once instead of being cut off
        await rpc.stop(SERVER_GRACE_SECONDS)
        # Uploads and pushes still in worker threads end at their next paced slice, so
        # the pool's shutdown below does not wait for a whole item.
        parts.pacer.halt()
        if channel is not None:
            await channel.close()
        for running in parts.tenancy.incarnations():
            await running.stop()
        watcher.stop()
        parts.tenancy.close()
        parts.executor.shutdown(wait=True, cancel_futures=True)
        parts.store.close()
        log.info("stopped")

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
