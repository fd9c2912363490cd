"""``mtc-replicator``: the per-node daemon process. Owns the process lifecycle.

One asyncio loop (uvloop when available) supervises: it watches CHECKPOINT_DIR, accepts
each new ``replicator.yaml`` (re-reading a partial one until it settles), runs one
incarnation at a time, and on SIGTERM stops within seconds without corrupting anything.
Blocking disk and storage work runs in a bounded thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from replicator import __version__
from replicator.local import fsutil

try:
    import uvloop
except ImportError:  # uvloop has no Windows build; asyncio's loop works, just slower
    uvloop = None  # type: ignore[assignment]
from replicator._pb.mtc.v1.node_pb2 import NodeStatusResponse
from replicator.cluster.coordinators import Coordinators
from replicator.cluster.hosting import CoordinatorHost
from replicator.cluster.messages import SERVICE as COORDINATOR_SERVICE
from replicator.cluster.registry import OwnedByAnother, Registry, open_registry
from replicator.cluster.servicer import CoordinatorServicer
from replicator.core.admission import Served
from replicator.core.contract import (
    CONFIG_FILE,
    ERRORS_FILE,
    FAILED_FILE,
    PRERESTORE_FILE,
    ConfigError,
    IncompleteConfigError,
    JobConfig,
    parse_config,
    parse_save_name,
)
from replicator.core.ownership import BadOwner
from replicator.core.pacing import (
    PaceRules,
    format_rate,
)
from replicator.core.settle import Act, Reading, SettleRules, judge
from replicator.core.timeline import RestorePhase
from replicator.local.pacer import Pacer
from replicator.local.store import LocalStore, StoreError, StorePlacementError
from replicator.local.usedpins import UsedPins
from replicator.local.watcher import DirectoryWatcher
from replicator.node.agent import (
    AgentContext,
    Incarnation,
    IncarnationPhase,
    cleanup_workload_files,
    new_incarnation_id,
    restore_saved,
    save_state,
)
from replicator.node.bucket_probes import BucketProbes
from replicator.node.handshake_file import HandshakeFile
from replicator.node.options import DaemonOptions, parse_args
from replicator.node.owner_watch import OwnerWatch
from replicator.node.rank0_coordinator import Rank0Coordinator, Stopping
from replicator.node.reclaim import Dropped, ForeignItems
from replicator.node.status import SERVICE as NODE_SERVICE
from replicator.node.status import NodeServicer, node_status, peer_addresses, probe_peers
from replicator.obs.health import Health, Heartbeat, Readiness, directory_check
from replicator.obs.logs import configure as configure_logging
from replicator.obs.metrics import (
    NO_METRICS,
    ErrorKind,
    FilesystemCollector,
    Metrics,
    MetricsError,
    MetricsServer,
    PrometheusMetrics,
    process_metrics,
    serve,
)
from replicator.storage.backup import BackupStore
from replicator.storage.restore_pins import StorePins
from replicator.storage.stores import open_object_store
from replicator.transport.datachannel import DataListener
from replicator.transport.obtaining import Obtaining
from replicator.transport.peer import PeerClient
from replicator.transport.peerwire import SERVICE as PEER_SERVICE
from replicator.transport.server import RpcServer, ServerError, advertised_address, split_host_port
from replicator.transport.service import PeerServicer
from replicator.transport.signing import check_identity, record_trust
from replicator.transport.tls import TlsError, TlsMaterial, open_material

log = logging.getLogger("replicator.node.daemon")


READY_LINE = "daemon ready"
SERVER_GRACE_SECONDS = 5.0
"""How long transfers in flight may finish after SIGTERM before they are cancelled."""
RECLAIM_EVERY = 30.0
"""Seconds between two looks at the items of jobs that no longer run here (the TTL)."""


_OWN_FILES = frozenset({ERRORS_FILE, PRERESTORE_FILE, FAILED_FILE})


def _is_own_output(name: str) -> bool:
    """Files only the daemon writes: its reports, its markers and their temp files."""
    return name in _OWN_FILES or name.endswith(".restore") or name.startswith(fsutil.TMP_PREFIX)


def tune_malloc() -> None:
    """Raise glibc's mmap and trim thresholds: large buffers otherwise churn page faults."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024)
        libc.mallopt(m_trim_threshold, 1024 * 1024 * 1024)


class Daemon:
    """Supervises incarnations on one CHECKPOINT_DIR."""

    def __init__(self, opts: DaemonOptions) -> None:
        self.opts = opts
        self.tls: TlsMaterial | None = open_material(
            opts.tls_cert, opts.tls_key, opts.tls_ca, opts.tls_server_name
        )
        if self.tls is not None:
            check_identity(self.tls)  # what peers will check, before anything is served
            self.tls.vet = check_identity  # and every rotated certificate, before it is used
        self.store = LocalStore(opts.checkpoint_dir, opts.store_dir)
        self.trust = record_trust(self.tls, accept_unsigned=opts.accept_unsigned_records)
        self.pacer = Pacer(
            PaceRules(rate=opts.max_transfer_rate, yield_to_saves=opts.yield_to_saves_seconds)
        )
        """The node's outgoing bytes: replication and backups under the limit, restores first."""
        backups = (
            BackupStore(
                open_object_store(opts.backup, timeout=opts.storage_timeout),
                self.trust,
                pacer=self.pacer,
            )
            if opts.backup
            else None
        )
        self._prometheus = (
            PrometheusMetrics(phases=[p.value for p in RestorePhase]) if opts.metrics else None
        )
        self.metrics: Metrics = self._prometheus or NO_METRICS
        if self._prometheus is not None:
            process_metrics(self._prometheus.registry)
            self._prometheus.registry.register(
                FilesystemCollector(opts.checkpoint_dir, "mtc_checkpoint_dir", "CHECKPOINT_DIR")
            )
        self.heartbeat = Heartbeat()
        """Beaten by a task in the event loop: ``/healthz`` fails when the loop stalls."""
        self.readiness = Readiness(stage="opening the store")
        self.health = Health(
            live=[self.heartbeat.check],
            ready=[self.readiness.check, directory_check(opts.checkpoint_dir, "CHECKPOINT_DIR")],
        )
        self.metrics.pacing(self.pacer.counts, opts.max_transfer_rate)
        self._metrics_server: MetricsServer | None = None
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
        )
        self.incarnation: Incarnation | None = None
        self.handshake = HandshakeFile(opts.checkpoint_dir)
        self.settle_rules = SettleRules(opts.settle_seconds, opts.config_wait_seconds)
        self._recheck_in = self.settle_rules.poll
        """When a pending handshake is read again (``core.settle``)."""
        self.owner = OwnerWatch(opts.owner_file, self.executor)
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self.exit_code = 0
        self.health_address: str | None = None
        """The plaintext health-only address, when ``--health-listen`` asks for one."""
        self.listen_address: str | None = None
        """The address the gRPC server is bound to (port 0 resolved), once it is."""
        self.advertise: str | None = opts.advertise
        """The address other nodes use to reach this one (defaults to the bound address)."""
        self.registry: Registry | None = (
            open_registry(opts.registry, self.trust, timeout=opts.storage_timeout)
            if opts.registry
            else None
        )
        self.coordinators = CoordinatorHost()
        self.rank0 = Rank0Coordinator(
            self.coordinators,
            self.registry,
            advertise=lambda: self.advertise,
            stop=self._stop,
            on_refused=self._registration_refused,
        )
        self.foreign = ForeignItems(
            self.store,
            backups,
            ttl=opts.foreign_job_ttl,
            metrics=self.metrics,
            current=self._running_job,
        )
        """Items of jobs that no longer run here: given back when backed up."""
        self.ctx.foreign = self.foreign
        self._reclaimed_at = 0.0
        self.buckets = BucketProbes(backups, self.registry)
        self.health = Health(
            live=self.health.live,
            ready=[*self.health.ready, *(check.readiness for check, _ in self.buckets.checks)],
        )
        self.ctx.registry = self.registry
        self.ctx.report_after = opts.report_after_seconds
        self.ctx.tls = self.tls

    def serving(self) -> Served | None:
        """What peers may push here: the job this node serves now, and its newest own step."""
        if self.incarnation is None:
            return None
        config = self.incarnation.config
        own = [i.step for i in self.store.manifests(config.job_name) if i.rank == config.node_rank]
        return Served(config, max(own, default=None))

    def _on_event(self, name: str | None, finished: bool, renamed: bool = False) -> None:
        if name is not None and _is_own_output(name):
            # Our own writes (an error line, a marker) must not wake us: an error written
            # on every wake-up would otherwise become a busy loop.
            return
        if name == CONFIG_FILE:
            self.handshake.event(finished, renamed)
        elif name and parse_save_name(name) is not None:
            # Only `.save` files need "closed after writing"; other names (our unique temp
            # files among them) would make the set grow for the daemon's whole life.
            if finished:
                self.ctx.closed_files.add(name)
            else:
                self.ctx.closed_files.discard(name)  # written again after its close
        self._wake.set()
        if self.incarnation is not None:
            self.incarnation.wake()

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
        the plaintext gRPC health port), and log each change with its reasons."""
        was: list[str] | None = None
        while True:
            problems = self.health.readiness()
            if problems != was:
                await rpc.set_ready(not problems)
                if problems:
                    log.warning("not ready: %s", "; ".join(problems))
                elif was is not None:
                    log.info("ready again")
                was = problems
            await asyncio.sleep(1.0)

    async def _beat(self) -> None:
        while True:
            self.heartbeat.beat()
            await asyncio.sleep(1.0)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop)
        try:
            self.opts.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            report = await loop.run_in_executor(self.executor, self.store.open)
        except StorePlacementError as exc:
            log.error("%s", exc)
            self.exit_code = 2
            return
        except StoreError as exc:
            log.error("%s", exc)
            self.exit_code = 3
            return
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
            return
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
        rpc = RpcServer()
        channel: DataListener | None = None
        if self.opts.data_port is not None:
            try:
                host = split_host_port(self.opts.listen)[0]
                channel = DataListener(host, self.opts.data_port, tls=self.tls)
            except OSError as exc:
                log.error("%s", exc)
                self.exit_code = 3
                self.store.close()
                return
        peer = PeerServicer(
            self.store,
            self.executor,
            self.serving,
            max_step_lead=self.opts.max_step_lead,
            metrics=self.metrics,
            channel=channel,
            idle_timeout=self.opts.idle_timeout_seconds,
            obtaining=self.ctx.obtaining,
            pacer=self.pacer,
            make_room=self._room_for_push,
            min_rate=self.opts.min_transfer_rate,
            max_item_files=self.opts.max_item_files,
        )
        rpc.add_service(PEER_SERVICE, peer.register)
        backups = self.ctx.backups
        self.ctx.coordinators = Coordinators(
            self.coordinators,
            lambda job: backups.committed_steps(job) if backups else {},
            pins=StorePins(
                backups.objects,
                self.trust,
                used=UsedPins(self.store.root),
                on_failure=lambda *failed: loop.call_soon_threadsafe(
                    self._pin_not_removed, *failed
                ),
            )
            if backups
            else None,
            commit=backups.try_commit if backups else None,
        )
        rpc.add_service(COORDINATOR_SERVICE, CoordinatorServicer(self.ctx.coordinators).register)
        rpc.add_service(NODE_SERVICE, NodeServicer(self._status, self._drop).register)
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
            return
        self.advertise = self.opts.advertise or advertised_address(self.listen_address)
        self.ctx.advertise = self.advertise
        self.ctx.peers = PeerClient(
            executor=self.executor, metrics=self.metrics, tls=self.tls, pacer=self.pacer
        )
        await rpc.start()
        if channel is not None:
            channel.start()
        contacts = self.ctx.peers.contacts
        self.metrics.peer_contacts(
            lambda: contacts.snapshot(time.time()),
            lambda: peer_addresses(self.incarnation).values(),
        )
        probe = asyncio.create_task(
            probe_peers(self.ctx.peers, lambda: peer_addresses(self.incarnation)),
            name="peer-probe",
        )
        # A yaml written while we were down has no events left to tell: trust it.
        self.handshake.trust_existing()
        watcher = DirectoryWatcher(self.opts.checkpoint_dir, self._on_event)
        watcher.start(loop)
        resumed = restore_saved(self.ctx)
        if resumed is not None:
            await self._resume(resumed)
        if self.opts.owner_file is None:
            log.warning(
                "no --owner-file: every job on this node is unowned, and any pod that can "
                "write a replicator.yaml can take over any unowned job's coordinator "
                "(SECURITY.md)"
            )
        if self.tls is None:
            log.warning(
                "TLS is off: the gRPC port %s and the data port are unauthenticated and "
                "unencrypted; anyone who reaches them can read, push and restore checkpoints "
                "and join jobs. Pass --tls-cert, --tls-key and --tls-ca (SECURITY.md)",
                self.listen_address,
            )
            log.warning(
                "without TLS material, COMMITs and registry entries are neither signed nor "
                "checked: whoever can write the bucket chooses what a job restores"
            )
        elif self.opts.accept_unsigned_records:
            log.warning(
                "--accept-unsigned-records is on: unsigned COMMITs and registry entries are "
                "believed, so whoever can write the bucket can choose what a job restores "
                "and where its ranks join; turn it off once every record is signed"
            )
        self.readiness.stage = None
        log.info(
            "%s: checkpoint-dir=%s store-dir=%s listen=%s advertise=%s backup=%s version=%s "
            "tls=%s health=%s metrics=%s data-port=%s owner-file=%s",
            READY_LINE,
            self.opts.checkpoint_dir,
            self.store.root,
            self.listen_address,
            self.advertise,
            self.opts.backup,
            __version__,
            "on" if self.tls is not None else "off",
            self.health_address,
            self._metrics_server.address if self._metrics_server else None,
            channel.port if channel is not None else "off",
            self.opts.owner_file or "off",
        )
        await rpc.set_serving()
        readiness = asyncio.create_task(self._report_readiness(rpc), name="mtc-readiness")
        try:
            while not self._stop.is_set():
                tick = self._recheck_in if self.handshake.reads is not None else 1.0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=tick)
                self._wake.clear()
                await self._check_config()
                await self._check_owner()
                await self._reclaim()
        finally:
            self.readiness.stopping = True  # whatever ended the loop
            log.info("stopping")
            readiness.cancel()
            probe.cancel()
            self.rank0.cancel()
            if self._stop.is_set():
                await self._drain()
            self.coordinators.close()  # long polls answer at once instead of being cut off
            await rpc.stop(SERVER_GRACE_SECONDS)
            # Uploads and pushes still in worker threads end at their next paced slice, so
            # the pool's shutdown below does not wait for a whole item.
            self.pacer.halt()
            if channel is not None:
                await channel.close()
            if self.incarnation is not None:
                await self.incarnation.stop()
            watcher.stop()
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.store.close()
            log.info("stopped")

    def _status(self, job: str | None) -> NodeStatusResponse:
        """What ``mtc status`` shows of this node (``mtc.v1.Node``)."""
        return node_status(
            self.store,
            self.incarnation,
            self.ctx.peers,
            self.advertise or "",
            job,
            foreign=self.foreign.last,
        )

    def _running_job(self) -> str | None:
        return self.incarnation.config.job_name if self.incarnation is not None else None

    async def _drop(self, job: str, only_copy: bool) -> Dropped:
        """``mtc drop``: a job's items, never the running job's (``DropRefused``)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(self.foreign.drop, job, self._running_job(), only_copy=only_copy),
        )

    async def _room_for_push(self, short: int) -> None:
        """A push lacks ``short`` bytes of room: drop backed-up items of other jobs."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.foreign.make_room, self._running_job(), short
            )
        except Exception as exc:
            # The push is then refused for room, as it would have been.
            log.warning("cannot give back the room of jobs that no longer run here: %s", exc)

    async def _reclaim(self) -> None:
        """Now and then: drop the items of jobs past ``--foreign-job-ttl`` (and for room)."""
        now = time.monotonic()
        if now - self._reclaimed_at < RECLAIM_EVERY:
            return
        self._reclaimed_at = now
        try:
            await asyncio.get_running_loop().run_in_executor(
                self.executor, self.foreign.reclaim, self._running_job()
            )
        except Exception as exc:
            # Housekeeping: the daemon's loop goes on whatever it meets.
            log.exception("cannot give back the room of jobs that no longer run here: %s", exc)  # noqa: TRY401

    async def _drain(self) -> None:
        """SIGTERM: the running job's newest step to its peers and the backup, within
        ``--drain-seconds``; past it, paced transfers still going are halted at once."""
        running = self.incarnation
        if running is None or self.opts.drain_seconds <= 0:
            return
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.opts.drain_seconds):
                plan = await running.drain()
        except TimeoutError:
            log.warning(
                "drain of job %s stopped at its deadline (--drain-seconds %g): the newest step "
                "may not have reached the peers or the backup",
                running.config.job_name,
                self.opts.drain_seconds,
            )
            self.pacer.halt()
            return
        except Exception as exc:
            log.exception("drain of job %s failed: %s", running.config.job_name, exc)  # noqa: TRY401
            return
        if plan is not None:
            log.info(
                "drain of job %s done in %.2fs (step %s)",
                running.config.job_name,
                time.monotonic() - t0,
                plan.step,
            )

    def _serve_metrics(self) -> None:
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` from a thread when ``--metrics``
        asks for it."""
        if self._prometheus is not None and self.opts.metrics is not None:
            self._metrics_server = serve(self._prometheus.registry, self.opts.metrics, self.health)

    # --- the handshake file ----------------------------------------------------------------

    async def _check_config(self) -> None:
        """Read the handshake and act on it once it is settled (``core.settle``)."""
        # Taken before the read: a close seen now covers the text we read, while one that
        # arrives during the read may follow a write our read missed.
        closed, renamed = self.handshake.finished, self.handshake.renamed
        try:
            text = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.handshake.read
            )
        except fsutil.NotRegularFile as exc:
            await self._reject_not_regular(exc.kind)
            return
        now = time.monotonic()
        reads = self.handshake.observe(text, now)
        if text is None or reads is None:
            return
        config: JobConfig | None = None
        error: ConfigError | None = None
        if not text.strip():
            reading = Reading.EMPTY
        else:
            try:
                config, reading = parse_config(text, self.ctx.env), Reading.VALID
            except IncompleteConfigError as exc:
                error, reading = exc, Reading.INCOMPLETE
            except ConfigError as exc:
                error, reading = exc, Reading.INVALID
        verdict = judge(self.settle_rules, reads, reading, now, closed=closed, renamed=renamed)
        self._recheck_in = verdict.recheck_in or self.settle_rules.poll
        if verdict.act is Act.CLEAR:
            log.info("empty %s stayed empty: stopping the current job", CONFIG_FILE)
            await self._end_incarnation()
            self.handshake.delete(text)
        elif verdict.act is Act.REJECT:
            assert error is not None
            waited = f"after {verdict.waited:.0f}s of waiting for a complete file"
            await self._reject(text, error, waited if verdict.timed_out else "")
        elif verdict.act is Act.ACCEPT:
            assert config is not None
            await self._accept(config, text, reads.first_seen)

    async def _reject(self, text: str, exc: ConfigError, when: str) -> None:
        await self._refuse(
            text,
            f"{exc}{' (' + when + ')' if when else ''}",
            f"Fix {CONFIG_FILE} and write it again (atomically: {CONFIG_FILE}.tmp, then rename)",
        )

    async def _refuse(self, text: str | None, reason: str, remedy: str) -> None:
        """Refuse the handshake ``text`` (None: one that could not be read): ``replicator.failed``
        says why, nothing committed is touched."""
        log.error("rejecting %s: %s", CONFIG_FILE, reason)
        self.metrics.error(ErrorKind.CONFIG)
        await self._end_incarnation()
        message = f"{reason}.\n{remedy}; committed checkpoints on this node were not touched.\n"
        fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, message.encode())
        if text is not None:
            self.handshake.delete(text)

    async def _check_owner(self) -> None:
        """End the running job once its node changed hands, at most a second late.

        The CSI plugin publishes CHECKPOINT_DIR to another namespace's pod only when no pod
        of the last one holds it, and rewrites ``owner.json`` then; from that moment nothing
        of the old job (a marker, a view of its items) may appear there, so the incarnation
        stops and its markers and views go, before the new pod's handshake arrives.
        """
        running = self.incarnation
        if running is None or not await self.owner.moved_from(running.owner):
            return
        if running is not self.incarnation:
            return
        log.warning(
            "CHECKPOINT_DIR was published to another namespace's pod: stopping job %s "
            "(incarnation %s) and removing its markers and views",
            running.config.job_name,
            running.id,
        )
        await self._end_incarnation()
        await asyncio.get_running_loop().run_in_executor(
            self.executor, cleanup_workload_files, self.opts.checkpoint_dir, self.store
        )

    async def _reject_not_regular(self, kind: str) -> None:
        """A ``replicator.yaml`` that is a symlink or FIFO: never read, refused, removed."""
        await self._refuse(
            None,
            f"{CONFIG_FILE} is {kind}, not a regular file: the replicator reads only a regular "
            "file",
            f"Write it as one (atomically: {CONFIG_FILE}.tmp, then rename)",
        )
        self.handshake.remove_not_regular()

    async def _registration_refused(self, job: str, exc: OwnedByAnother) -> None:
        """The job name ``job`` turned out registered to another owner after a resume: the
        job stops here as a refused handshake would."""
        running = self.incarnation
        if running is not None and running.config.job_name == job:
            log.error("stopping job %s: %s", job, exc)
            await self._end_incarnation()
            text = f"mtc-replicator: job {job} stopped: {exc}.\nRestart the job.\n"
            fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, text.encode())

    async def _resume(self, resumed: Incarnation) -> None:
        """Resume the incarnation a restart interrupted, under the owner the node has now
        (the same pod's, unless the handshake was refused before)."""
        job = resumed.config.job_name
        try:
            resumed.owner = await self.owner.read()
            await self.rank0.host(
                resumed.config,
                resumed.owner,
                incarnation=resumed.id,
                resume_steady=resumed.phase is IncarnationPhase.STEADY,
                register_later=True,
            )
        except Stopping as exc:
            log.info("not resuming incarnation %s of job %s: %s", resumed.id, job, exc)
            return  # its saved state stays: the next start resumes it
        except (BadOwner, OwnedByAnother) as exc:
            log.error("not resuming incarnation %s of job %s: %s", resumed.id, job, exc)
            save_state(self.store, None)
            text = f"mtc-replicator: not resuming job {job}: {exc}.\nRestart the job.\n"
            fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, text.encode())
            return
        log.info("resuming incarnation %s of job %s (phase %s)", resumed.id, job, resumed.phase)
        self.incarnation = resumed
        resumed.start()

    def _pin_not_removed(self, job: str, step: int, message: str) -> None:
        """A used restore pin stayed in the bucket: the metric, and the job's errors file
        when this node runs one of its ranks (the coordinator's node runs rank 0)."""
        self.metrics.pin_delete_failed(job)
        running = self.incarnation
        if running is not None and running.config.job_name == job:
            running.error(message, step, kind=ErrorKind.RESTORE)

    async def _end_incarnation(self) -> None:
        if self.incarnation is not None:
            log.info(
                "stopping incarnation %s of job %s",
                self.incarnation.id,
                self.incarnation.config.job_name,
            )
            await self.incarnation.stop()
            self.foreign.ended(self.incarnation.config.job_name)
            self.incarnation = None
            save_state(self.store, None)

    async def _accept(self, config: JobConfig, text: str, seen_at: float | None = None) -> None:
        """Handshake steps 1-4, then hand over to a new incarnation (steps 5-8); ``seen_at``:
        when the yaml was first read (``time.monotonic``), where the restore's timeline
        starts."""
        if config.unknown_keys:
            log.warning(
                "ignoring unknown keys in %s: %s", CONFIG_FILE, ", ".join(config.unknown_keys)
            )
        refused = await self.buckets.verdict(config)
        if refused is not None:
            await self._refuse(
                text,
                refused,
                "Fix the daemon's credentials or the bucket's policy (docs/permissions.md), "
                "then restart the job",
            )
            return
        loop = asyncio.get_running_loop()
        try:
            owner = await self.owner.read()
        except BadOwner as exc:
            await self._refuse(
                text,
                f"cannot tell which namespace this node's pod belongs to: {exc}",
                "The CSI plugin writes that file when it publishes the volume; restart the pod",
            )
            return
        await self._end_incarnation()
        removed = await loop.run_in_executor(
            self.executor, cleanup_workload_files, self.opts.checkpoint_dir, self.store
        )
        incarnation_id = new_incarnation_id()
        try:
            # Before the incarnation exists: a refused rank 0 must leave nothing to resume.
            await self.rank0.host(config, owner, incarnation=incarnation_id)
        except OwnedByAnother as exc:
            await self._refuse(text, str(exc), "Choose another job name")
            return
        except Stopping as exc:
            log.info("not accepting %s: %s", CONFIG_FILE, exc)
            return  # the yaml stays: the next start takes it
        self.incarnation = Incarnation(
            config,
            self.ctx,
            config_text=text,
            owner=owner,
            incarnation_id=incarnation_id,
            handshake_at=seen_at,
        )
        log.info(
            "accepted %s: job=%s rank=%d/%d framework=%s workers=%d incarnation=%s "
            "(removed %d stale files)",
            CONFIG_FILE,
            config.job_name,
            config.node_rank,
            config.nodes,
            config.framework.value,
            config.workers_per_node,
            self.incarnation.id,
            len(removed),
        )
        # Persist before the yaml goes: a crash in between must still end in markers.
        await loop.run_in_executor(self.executor, self.incarnation.persist)
        self.handshake.delete(text)
        self.incarnation.start()


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
