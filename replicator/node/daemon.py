"""``mtc-replicator``: the per-node daemon process. Owns the process lifecycle.

One asyncio loop (uvloop when available) supervises: it watches CHECKPOINT_DIR, accepts
each new ``replicator.yaml`` (re-reading a partial one until it settles), runs one
incarnation at a time, and on SIGTERM stops within seconds without corrupting anything.
Blocking disk and storage work runs in a bounded thread pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

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
from replicator.cluster.messages import cluster_view_json
from replicator.cluster.registry import OwnedByAnother, Registry, RegistryEntry, open_registry
from replicator.cluster.servicer import CoordinatorServicer
from replicator.core import argtypes
from replicator.core.admission import MAX_STEP_LEAD, Served
from replicator.core.bucketcheck import BucketCheck, Verdict
from replicator.core.contract import (
    CONFIG_FILE,
    ERRORS_FILE,
    FAILED_FILE,
    MAX_CONFIG_BYTES,
    PRERESTORE_FILE,
    ConfigError,
    IncompleteConfigError,
    JobConfig,
    ascii_digits,
    parse_config,
    parse_save_name,
)
from replicator.core.drain import DEFAULT_DRAIN_SECONDS
from replicator.core.foreign import DEFAULT_TTL
from replicator.core.manifest import DEFAULT_MAX_ITEM_FILES
from replicator.core.ownership import MAX_OWNER_FILE_BYTES, UNOWNED, BadOwner, parse_owner
from replicator.core.pacing import (
    DEFAULT_MIN_TRANSFER_RATE,
    DEFAULT_YIELD_TO_SAVES,
    MAX_YIELD_TO_SAVES,
    PaceRules,
    default_floor,
    format_rate,
)
from replicator.core.retry import DEFAULT_STORAGE_TIMEOUT, Backoff
from replicator.core.timeline import RestorePhase
from replicator.local.pacer import Pacer
from replicator.local.store import LocalStore, StoreError, StorePlacementError
from replicator.local.usedpins import UsedPins
from replicator.local.watcher import DirectoryWatcher
from replicator.node.agent import (
    AgentContext,
    Incarnation,
    IncarnationPhase,
    new_incarnation_id,
    restore_saved,
    save_state,
)
from replicator.node.checkpoint_dir import cleanup_workload_files
from replicator.node.reclaim import Dropped, ForeignItems
from replicator.node.status import SERVICE as NODE_SERVICE
from replicator.node.status import NodeServicer, node_status, peer_addresses, probe_peers
from replicator.obs.health import Health, Heartbeat, Readiness, directory_check
from replicator.obs.logs import add_log_arguments
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
from replicator.storage.objectstore import ObjectStore, ObjectStoreError, is_transient
from replicator.storage.probe import probe as probe_store
from replicator.storage.restore_pins import StorePins
from replicator.storage.stores import open_object_store
from replicator.transport.datachannel import DataListener
from replicator.transport.obtaining import Obtaining
from replicator.transport.peer import PeerClient
from replicator.transport.peerwire import SERVICE as PEER_SERVICE
from replicator.transport.server import RpcServer, ServerError, advertised_address, split_host_port
from replicator.transport.service import IDLE_SECONDS, PeerServicer
from replicator.transport.signing import check_identity, record_trust
from replicator.transport.tls import DEFAULT_SERVER_NAME, TlsError, TlsMaterial, open_material

log = logging.getLogger("replicator.node.daemon")


class Stopping(Exception):
    """The daemon was asked to stop while it waited for something that may still heal."""


READY_LINE = "daemon ready"
FIRST_PROBE_WAIT = 10.0
"""How long a handshake waits for the first probe of the backup and registry."""
SERVER_GRACE_SECONDS = 5.0
"""How long transfers in flight may finish after SIGTERM before they are cancelled."""
RECLAIM_EVERY = 30.0
"""Seconds between two looks at the items of jobs that no longer run here (the TTL)."""


_OWN_FILES = frozenset({ERRORS_FILE, PRERESTORE_FILE, FAILED_FILE})


def _is_own_output(name: str) -> bool:
    """Files only the daemon writes: its reports, its markers and their temp files."""
    return name in _OWN_FILES or name.endswith(".restore") or name.startswith(fsutil.TMP_PREFIX)


DEFAULT_EXPAND_VARS = ("NODE_NAME",)
"""What the DaemonSet sets for handshakes to name: the node (Kubernetes downward API)."""
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _var_names(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names:
        if not _VAR_NAME.fullmatch(name):
            raise argparse.ArgumentTypeError(f"not an environment variable name: {name!r}")
    return names


@dataclass(frozen=True)
class DaemonOptions:
    checkpoint_dir: Path
    listen: str
    store_dir: Path | None = None
    """The store (committed items, ingest, staging): outside CHECKPOINT_DIR, on its
    filesystem; None: ``<CHECKPOINT_DIR>.mtc-store`` (``core.storedir``)."""
    advertise: str | None = None
    backup: str | None = None
    registry: str | None = None
    log_level: str = "INFO"
    log_format: str = "text"
    """``text`` or ``json`` (``obs.logs``)."""
    threads: int = 4
    settle_seconds: float = 10.0
    """How long a ``.save`` file must stay unchanged to count as finished without a close event."""
    config_wait_seconds: float = 30.0
    """How long a partial or empty ``replicator.yaml`` is re-read before it is judged."""
    rescan_seconds: float = 2.0
    report_after_seconds: float = 60.0
    """How long a restore round waits before ``replicator.errors`` says what for."""
    metrics: str | None = None
    """Where to serve Prometheus metrics (``HOST:PORT``); None: no metrics."""
    data_port: int | None = 0
    """TCP port of the data channel on the ``listen`` host (0: any free one, told to peers
    over gRPC); None: no data channel, item bytes travel in gRPC chunks."""
    tls_cert: str | None = None
    """This node's certificate (PEM); with ``tls_key`` and ``tls_ca``, mutual TLS on every
    port and every call; None: plaintext, unauthenticated (a warning at start)."""
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str = DEFAULT_SERVER_NAME
    """The DNS name every node certificate carries; clients check it."""
    accept_unsigned_records: bool = False
    """Believe unsigned COMMITs and registry entries (written before records were signed);
    records whose signature fails are refused all the same. Only matters with TLS on."""
    health_listen: str | None = None
    """Where to serve the gRPC health service alone, in plaintext (kubelet probes under
    TLS); None: only on the main port."""
    expand_vars: tuple[str, ...] = DEFAULT_EXPAND_VARS
    """The environment variables ``$VAR`` in ``replicator.yaml`` may name; no others (the
    daemon's credentials live in its environment, and the pod reads what it writes)."""
    max_step_lead: int = MAX_STEP_LEAD
    """How far ahead of this rank's newest own step a peer's push may be (``core.admission``)."""
    idle_timeout_seconds: float = IDLE_SECONDS
    """How long a transfer from or to a peer may make no progress before it is dropped,
    its space reservation and staging with it."""
    owner_file: Path | None = None
    """The CSI plugin's ``owner.json``: whose pod published CHECKPOINT_DIR, read at every
    handshake; None: jobs are unowned (local runs, the demo)."""
    max_transfer_rate: float | None = None
    """Bytes per second this daemon sends for replication and backups together; None:
    unlimited. Restores are never throttled (``core.pacing``)."""
    max_item_files: int = DEFAULT_MAX_ITEM_FILES
    """The most files and directories of one item a peer may push here."""
    min_transfer_rate: float | None = DEFAULT_MIN_TRANSFER_RATE
    """The average rate a peer's push or pull served here must keep after one idle timeout
    (``core.pacing.transfer_deadline``); None: no floor."""
    yield_to_saves_seconds: float = DEFAULT_YIELD_TO_SAVES
    """How long a save in progress may hold this daemon's replication and backups."""
    storage_timeout: float = DEFAULT_STORAGE_TIMEOUT
    """Seconds one backup-store request may take with the SDK's retries."""
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    """On SIGTERM, how long the newest step may take to reach the peers and the backup
    (``core.drain``) before the daemon stops anyway; 0: no drain."""
    foreign_job_ttl: float = DEFAULT_TTL
    """Seconds a job that no longer runs here keeps its backed-up items (``core.foreign``)."""


def _data_port(value: str) -> int | None:
    if value == "off":
        return None
    if value == "auto":
        return 0
    if not ascii_digits(value) or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 'auto' or 'off', got {value!r}")
    return int(value)


def _flag(value: str) -> bool:
    """An environment variable that turns something on: 1, true, yes, on (any case)."""
    return value.strip().lower() in ("1", "true", "yes", "on")


def make_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Every flag, its default from ``env`` (the process environment by default)."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="mtc-replicator",
        description="The per-node checkpoint replicator: keeps each step of a training job "
        "in this node's RAM disk, on peer nodes and in object storage, and restores it. "
        "Every flag also reads the environment variable in brackets.",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=argtypes.path,
        default=env.get("MTC_CHECKPOINT_DIR"),
        help="the RAM disk shared with the training job [MTC_CHECKPOINT_DIR]",
    )
    p.add_argument(
        "--store-dir",
        type=argtypes.path,
        default=env.get("MTC_STORE_DIR") or None,
        help="the daemon's store: outside the checkpoint dir, on the same filesystem "
        "(default: <checkpoint-dir>.mtc-store) [MTC_STORE_DIR]",
    )
    p.add_argument(
        "--listen",
        type=argtypes.listen_address,
        default=env.get("MTC_LISTEN", "0.0.0.0:7070"),
        help="gRPC address for peers and the coordinator [MTC_LISTEN]",
    )
    p.add_argument(
        "--advertise",
        type=argtypes.host_port,
        default=env.get("MTC_ADVERTISE"),
        help="address other nodes use to reach this one [MTC_ADVERTISE]",
    )
    p.add_argument(
        "--backup",
        type=argtypes.storage_url,
        default=env.get("MTC_BACKUP") or None,
        help="backup location: file:///path, gs://bucket/prefix, s3://bucket/prefix [MTC_BACKUP]",
    )
    p.add_argument(
        "--registry",
        type=argtypes.storage_url,
        default=env.get("MTC_REGISTRY") or None,
        help="where job coordinators register; defaults to --backup [MTC_REGISTRY]",
    )
    # String defaults go through each option's type like a flag would: a bad environment
    # variable is a usage error too, not a traceback.
    add_log_arguments(p, env)
    p.add_argument(
        "--threads",
        type=argtypes.positive,
        default=env.get("MTC_THREADS", "4"),
        help="threads for disk and object-store work (default: %(default)s) [MTC_THREADS]",
    )
    p.add_argument(
        "--settle-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_SETTLE_SECONDS", "10"),
        help="a checkpoint file unchanged this long counts as written even when its close "
        "was not seen (default: %(default)s) [MTC_SETTLE_SECONDS]",
    )
    p.add_argument(
        "--config-wait-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_CONFIG_WAIT_SECONDS", "30"),
        help="how long a partial or empty replicator.yaml is re-read before it is judged "
        "(default: %(default)s) [MTC_CONFIG_WAIT_SECONDS]",
    )
    p.add_argument(
        "--rescan-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_RESCAN_SECONDS", "2"),
        help="how often CHECKPOINT_DIR is scanned again besides its file events "
        "(default: %(default)s) [MTC_RESCAN_SECONDS]",
    )
    p.add_argument(
        "--report-after-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_REPORT_AFTER_SECONDS", "60"),
        help="a waiting restore round says what it waits for in replicator.errors after this "
        "(default: %(default)s) [MTC_REPORT_AFTER_SECONDS]",
    )
    p.add_argument(
        "--metrics",
        type=argtypes.listen_address,
        default=env.get("MTC_METRICS") or None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics; off by default [MTC_METRICS]",
    )
    p.add_argument(
        "--data-port",
        type=_data_port,
        default=env.get("MTC_DATA_PORT", "auto"),
        help="TCP port for item bytes beside gRPC, on the --listen host: a number, 'auto' "
        "(any free port, told to peers over gRPC) or 'off' (bytes in gRPC chunks) "
        "[MTC_DATA_PORT]",
    )
    p.add_argument(
        "--tls-cert",
        type=argtypes.path,
        default=env.get("MTC_TLS_CERT") or None,
        help="this node's certificate (PEM); with --tls-key and --tls-ca: mutual TLS on the "
        "gRPC and data ports and every call to peers and coordinators [MTC_TLS_CERT]",
    )
    p.add_argument(
        "--tls-key",
        type=argtypes.path,
        default=env.get("MTC_TLS_KEY") or None,
        help="its key (PEM) [MTC_TLS_KEY]",
    )
    p.add_argument(
        "--tls-ca",
        type=argtypes.path,
        default=env.get("MTC_TLS_CA") or None,
        help="the CA every peer's certificate must chain to (PEM) [MTC_TLS_CA]",
    )
    p.add_argument(
        "--tls-server-name",
        type=argtypes.dns_name,
        default=env.get("MTC_TLS_SERVER_NAME", DEFAULT_SERVER_NAME),
        help="the DNS name in every node certificate, checked by clients "
        "(default: %(default)s) [MTC_TLS_SERVER_NAME]",
    )
    p.add_argument(
        "--accept-unsigned-records",
        action="store_true",
        default=_flag(env.get("MTC_ACCEPT_UNSIGNED_RECORDS", "")),
        help="migration: also believe COMMITs and registry entries that carry no signature "
        "(written by versions before signed records); a bad signature is refused all the "
        "same [MTC_ACCEPT_UNSIGNED_RECORDS]",
    )
    p.add_argument(
        "--health-listen",
        type=argtypes.listen_address,
        default=env.get("MTC_HEALTH_LISTEN") or None,
        help="also serve the gRPC health service alone, in plaintext, at HOST:PORT, for "
        "kubelet probes when TLS is on; off by default [MTC_HEALTH_LISTEN]",
    )
    p.add_argument(
        "--expand-vars",
        type=_var_names,
        default=env.get("MTC_EXPAND_VARS", ",".join(DEFAULT_EXPAND_VARS)),
        help="comma-separated environment variables that $VAR in replicator.yaml may name; "
        "no others are expanded (default: %(default)s) [MTC_EXPAND_VARS]",
    )
    p.add_argument(
        "--max-step-lead",
        type=argtypes.positive,
        default=env.get("MTC_MAX_STEP_LEAD", str(MAX_STEP_LEAD)),
        help="refuse a peer's push of a step more than this far ahead of this rank's newest "
        "own step (from 0 before its first) (default: %(default)s) [MTC_MAX_STEP_LEAD]",
    )
    p.add_argument(
        "--idle-timeout-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_IDLE_TIMEOUT_SECONDS", f"{IDLE_SECONDS:g}"),
        help="a peer transfer with no progress this long is dropped, with its space "
        "reservation and staging (default: %(default)s) [MTC_IDLE_TIMEOUT_SECONDS]",
    )
    p.add_argument(
        "--owner-file",
        type=argtypes.path,
        default=env.get("MTC_OWNER_FILE") or None,
        help="the owner.json the CSI plugin writes (the namespace of the pod that published "
        "CHECKPOINT_DIR); every job this node runs belongs to that namespace, and a job name "
        "registered by another is refused; without it jobs are unowned [MTC_OWNER_FILE]",
    )
    p.add_argument(
        "--max-transfer-rate",
        type=argtypes.rate,
        default=env.get("MTC_MAX_TRANSFER_RATE", "unlimited"),
        metavar="RATE",
        help="most bytes per second this daemon sends for replication and backup uploads "
        "together, shared fairly between transfers, bursts of at most one second's worth: "
        "e.g. 400MiB, 1.5GB, 2Gbit or 'unlimited'; restores are never throttled "
        "(default: unlimited) [MTC_MAX_TRANSFER_RATE]",
    )
    p.add_argument(
        "--max-item-files",
        type=argtypes.positive,
        default=env.get("MTC_MAX_ITEM_FILES", str(DEFAULT_MAX_ITEM_FILES)),
        metavar="COUNT",
        help="refuse a peer's push of an item of more files and directories than this, "
        "before staging any; this node's own steps are never refused, their pushes are "
        "(default: %(default)s) [MTC_MAX_ITEM_FILES]",
    )
    p.add_argument(
        "--min-transfer-rate",
        type=argtypes.floor_rate,
        default=env.get("MTC_MIN_TRANSFER_RATE") or None,
        metavar="RATE",
        help="a peer's push or pull served here that moves slower on average, after one idle "
        "timeout, is dropped with its space reservation: e.g. 256KiB, or 'off'; keep it under "
        "what a paced peer gets (default: 256KiB, or a sixteenth of --max-transfer-rate when "
        "that is lower) [MTC_MIN_TRANSFER_RATE]",
    )
    p.add_argument(
        "--yield-to-saves-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_YIELD_TO_SAVES_SECONDS", f"{DEFAULT_YIELD_TO_SAVES:g}"),
        help="while the job writes a checkpoint, hold replication and backups this long at "
        f"most (0 to {MAX_YIELD_TO_SAVES:g}; 0: never) (default: %(default)s) "
        "[MTC_YIELD_TO_SAVES_SECONDS]",
    )
    p.add_argument(
        "--storage-timeout",
        type=argtypes.storage_timeout,
        default=env.get("MTC_STORAGE_TIMEOUT", str(DEFAULT_STORAGE_TIMEOUT)),
        metavar="SECONDS",
        help="the most seconds one request to the backup bucket may take, its retries "
        "included; the SDK's own retry settings (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE) apply "
        "within it (default: %(default)s) [MTC_STORAGE_TIMEOUT]",
    )
    p.add_argument(
        "--drain-seconds",
        type=argtypes.non_negative,
        default=env.get("MTC_DRAIN_SECONDS", f"{DEFAULT_DRAIN_SECONDS:g}"),
        metavar="SECONDS",
        help="on SIGTERM, push the job's newest step to peers that lack it and back it up "
        "when the bucket is older, for at most this long before stopping; keep it under the "
        "pod's terminationGracePeriodSeconds less 10; 0: stop at once (default: %(default)s) "
        "[MTC_DRAIN_SECONDS]",
    )
    p.add_argument(
        "--foreign-job-ttl",
        type=argtypes.non_negative,
        default=env.get("MTC_FOREIGN_JOB_TTL", f"{DEFAULT_TTL:g}"),
        metavar="SECONDS",
        help="items of a job that no longer runs here, whose newest step held is committed "
        "in the backup, are dropped after this long (sooner when the running job needs the "
        "room); items not in the backup are kept (default: %(default)s) "
        "[MTC_FOREIGN_JOB_TTL]",
    )
    p.add_argument(
        "--version", action="version", version=__version__, help="print the version and exit"
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> DaemonOptions:
    """Flags win over ``MTC_*`` environment variables (the Kubernetes way to configure)."""
    p = make_parser(env)
    a = p.parse_args(argv)
    if not a.idle_timeout_seconds > 0:
        p.error("--idle-timeout-seconds must be > 0")
    if bool(a.tls_cert) + bool(a.tls_key) + bool(a.tls_ca) not in (0, 3):
        p.error("--tls-cert, --tls-key and --tls-ca go together: give all three or none")
    if a.checkpoint_dir is None:
        p.error("--checkpoint-dir (or MTC_CHECKPOINT_DIR) is required")
    if not 0 <= a.yield_to_saves_seconds <= MAX_YIELD_TO_SAVES:
        p.error(
            f"--yield-to-saves-seconds must be in [0, {MAX_YIELD_TO_SAVES:g}]: peers and "
            "object stores drop connections idle for longer"
        )
    floor = default_floor(a.max_transfer_rate)
    if a.min_transfer_rate is not None:
        floor = a.min_transfer_rate
        limit = a.max_transfer_rate
        if limit is not None and floor >= limit:
            p.error(
                "--min-transfer-rate must be below --max-transfer-rate: peers pacing their "
                "pushes as this node does would be dropped"
            )
    return DaemonOptions(
        checkpoint_dir=a.checkpoint_dir.absolute(),
        store_dir=a.store_dir.absolute() if a.store_dir is not None else None,
        listen=a.listen,
        advertise=a.advertise,
        backup=a.backup,
        registry=a.registry or a.backup,
        log_level=a.log_level,
        log_format=a.log_format,
        threads=a.threads,
        settle_seconds=a.settle_seconds,
        config_wait_seconds=a.config_wait_seconds,
        rescan_seconds=a.rescan_seconds,
        report_after_seconds=a.report_after_seconds,
        metrics=a.metrics,
        data_port=a.data_port,
        tls_cert=_text(a.tls_cert),
        tls_key=_text(a.tls_key),
        tls_ca=_text(a.tls_ca),
        tls_server_name=a.tls_server_name,
        accept_unsigned_records=a.accept_unsigned_records,
        health_listen=a.health_listen,
        expand_vars=a.expand_vars,
        max_step_lead=a.max_step_lead,
        idle_timeout_seconds=a.idle_timeout_seconds,
        owner_file=a.owner_file.absolute() if a.owner_file is not None else None,
        max_transfer_rate=a.max_transfer_rate,
        min_transfer_rate=floor or None,
        max_item_files=a.max_item_files,
        yield_to_saves_seconds=a.yield_to_saves_seconds,
        storage_timeout=a.storage_timeout,
        drain_seconds=a.drain_seconds,
        foreign_job_ttl=a.foreign_job_ttl,
    )


def _bucket_checks(
    backups: BackupStore | None, registry: Registry | None
) -> list[tuple[BucketCheck, ObjectStore]]:
    """What to probe: the backup, and the registry when it is another location."""
    found = []
    if backups is not None:
        found.append((BucketCheck(backups.objects.url, "backup"), backups.objects))
    if registry is not None and (backups is None or registry.url != backups.objects.url):
        found.append((BucketCheck(registry.url, "registry"), registry.objects))
    return found


async def _in_daemon_thread(fn: Callable[[ObjectStore], None], store: ObjectStore) -> None:
    """``fn(store)`` in a thread of its own that never holds up the process's exit: a probe
    of an unreachable bucket may take the whole storage timeout, and the default executor
    (``asyncio.to_thread``) is joined at shutdown, so SIGTERM would wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn(store)
        except BaseException as exc:  # handed to the awaiting task, not lost in the thread
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=run, name="mtc-bucket-probe", daemon=True).start()
    await done


def _log_bucket(check: BucketCheck, was: Verdict, wait: float | None) -> None:
    if check.verdict is Verdict.USABLE:
        if was is not Verdict.USABLE:
            log.info("%s %s: usable (listed and read under its prefix)", check.what, check.url)
    elif check.verdict is Verdict.REFUSED:
        if was is not Verdict.REFUSED:
            log.error(
                "%s %s refused: %s; jobs on this node get %s until it is fixed "
                "(docs/permissions.md); checking again in %.0fs",
                check.what,
                check.url,
                check.reason,
                FAILED_FILE,
                wait or 0.0,
            )
    else:
        log.warning(
            "%s %s unreachable: %s; retrying in %.1fs",
            check.what,
            check.url,
            check.reason,
            wait or 0.0,
        )


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


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


@dataclass
class _PendingConfig:
    text: str
    first_seen: float
    changed_at: float


class Daemon:
    """Supervises incarnations on one CHECKPOINT_DIR."""

    VALID_SETTLE = 0.1
    """A valid handshake must read the same twice this far apart (non-atomic writers)."""
    INVALID_SETTLE = 1.0

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
        self._pending: _PendingConfig | None = None
        self._owner_checked = 0.0
        self._config_finished = False
        """Whether the yaml's writer is done: closed after writing or renamed into place."""
        self._config_renamed = False
        """Whether it was renamed into place, with no write since: complete as it appeared."""
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._registering: asyncio.Task[None] | None = None
        """A registration a resume could not make at once (``_claim_later``)."""
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
        self.bucket_checks = _bucket_checks(backups, self.registry)
        """The backup and registry locations, probed at start and until usable."""
        self._buckets_probed = asyncio.Event()
        self.health = Health(
            live=self.health.live,
            ready=[*self.health.ready, *(check.readiness for check, _ in self.bucket_checks)],
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
            self._config_finished = finished
            self._config_renamed = renamed
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
        buckets = asyncio.create_task(self._probe_buckets(), name="mtc-bucket-probe")
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

    async def _probe_buckets(self) -> None:
        """Probe each location until it is usable: an unreachable one with backoff, a
        refused one every few minutes (an operator may fix the policy); log each change."""
        due = {id(check): 0.0 for check, _ in self.bucket_checks}
        while True:
            for check, store in self.bucket_checks:
                if due[id(check)] > time.monotonic():
                    continue
                was = check.verdict
                try:
                    await _in_daemon_thread(probe_store, store)
                except ObjectStoreError as exc:
                    wait = check.record(str(exc), transient=is_transient(exc))
                except Exception as exc:  # an SDK error no translation knows: may heal
                    wait = check.record(f"{type(exc).__name__}: {exc}", transient=True)
                else:
                    wait = check.record(None, transient=False)
                due[id(check)] = math.inf if wait is None else time.monotonic() + wait
                _log_bucket(check, was, wait)
            self._buckets_probed.set()
            soonest = min(due.values(), default=math.inf)
            if soonest == math.inf:
                return
            await asyncio.sleep(max(soonest - time.monotonic(), 0.0))

    def _bucket_refusal(self, config: JobConfig) -> str | None:
        """Why ``config``'s job cannot run here until the configuration is fixed, if a
        location it needs was refused (``core.bucketcheck``): the backup for every job, a
        separate registry for cluster jobs only."""
        needed = [c for c, _ in self.bucket_checks if c.what == "backup" or config.nodes > 1]
        return next((r for c in needed if (r := c.refusal())), None)

    async def _bucket_verdict(self, config: JobConfig) -> str | None:
        """A refused location's reason, after the first probe of each (a handshake that
        arrives during start-up waits for it, at most ``FIRST_PROBE_WAIT`` seconds)."""
        if self.bucket_checks and not self._buckets_probed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._buckets_probed.wait(), FIRST_PROBE_WAIT)
        return self._bucket_refusal(config)

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
        self._config_finished = (self.opts.checkpoint_dir / CONFIG_FILE).exists()
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
                tick = 0.05 if self._pending is not None else 1.0
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
            if self._registering is not None:
                self._registering.cancel()
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

    def _read_config(self) -> str | None:
        """The handshake's text; None when there is none. ``NotRegularFile`` for a symlink
        (it could name any file the daemon reads) or a FIFO (a read would block forever)."""
        path = self.opts.checkpoint_dir / CONFIG_FILE
        try:
            raw = fsutil.read_regular(path, MAX_CONFIG_BYTES + 1)
        except FileNotFoundError:
            return None
        except fsutil.NotRegularFile as exc:
            if exc.kind == "a directory":
                return None  # the workload's own business, as before
            raise
        return raw.decode("utf-8", errors="replace")

    async def _check_config(self) -> None:
        # Taken before the read: a close seen now covers the text we read, while one that
        # arrives during the read may follow a write our read missed.
        closed, renamed = self._config_finished, self._config_renamed
        try:
            text = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._read_config
            )
        except fsutil.NotRegularFile as exc:
            await self._reject_not_regular(exc.kind)
            return
        now = time.monotonic()
        if text is None:
            self._pending = None
            return
        if self._pending is None:
            self._pending = _PendingConfig(text, now, now)
        elif self._pending.text != text:
            self._pending.text, self._pending.changed_at = text, now
        pending = self._pending
        stable = now - pending.changed_at
        waited = now - pending.first_seen
        if not text.strip():
            if waited >= self.opts.config_wait_seconds:
                log.info("empty %s stayed empty: stopping the current job", CONFIG_FILE)
                await self._end_incarnation()
                self._delete_config(text)
            return
        # A non-atomic writer's half can parse as a whole config (a truncated job name, or
        # `nodes: 1` of `nodes: 16`): judge it once the writer closed it, or after the .save
        # settle time when the close event was lost.
        finished = closed or stable >= self.opts.settle_seconds
        try:
            config = parse_config(text, self.ctx.env)
        except IncompleteConfigError as exc:
            if closed and stable >= self.VALID_SETTLE:
                # Closed or renamed into place and unchanged since: nothing more is coming,
                # so the missing key is final. Without the event (an in-place writer that
                # has not closed it, or a lost event) the bounded wait below still applies.
                await self._reject(text, exc, "")
            elif waited >= self.opts.config_wait_seconds:
                await self._reject(text, exc, f"after {waited:.0f}s of waiting for a complete file")
            return
        except ConfigError as exc:
            if stable >= self.INVALID_SETTLE and finished:
                await self._reject(text, exc, "")
            return
        # Renamed into place (Orbax, MaxText, our client): complete by the protocol, so the
        # double read that guards in-place writers would only delay every restore.
        if renamed or (stable >= self.VALID_SETTLE and finished):
            await self._accept(config, text, pending.first_seen)

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
            self._delete_config(text)

    async def _check_owner(self) -> None:
        """End the running job once its node changed hands, at most a second late.

        The CSI plugin publishes CHECKPOINT_DIR to another namespace's pod only when no pod
        of the last one holds it, and rewrites ``owner.json`` then; from that moment nothing
        of the old job (a marker, a view of its items) may appear there, so the incarnation
        stops and its markers and views go, before the new pod's handshake arrives.
        """
        running = self.incarnation
        now = time.monotonic()
        if running is None or self.opts.owner_file is None or now - self._owner_checked < 1.0:
            return
        self._owner_checked = now
        loop = asyncio.get_running_loop()
        try:
            owner: str | None = await loop.run_in_executor(self.executor, self._read_owner)
        except BadOwner:
            owner = None  # written by rename, so never half there: treat it as changed
        if owner == running.owner or running is not self.incarnation:
            return
        log.warning(
            "CHECKPOINT_DIR was published to another namespace's pod: stopping job %s "
            "(incarnation %s) and removing its markers and views",
            running.config.job_name,
            running.id,
        )
        await self._end_incarnation()
        await loop.run_in_executor(
            self.executor, cleanup_workload_files, self.opts.checkpoint_dir, self.store
        )

    def _read_owner(self) -> str:
        """The namespace this node's pod belongs to now (UNOWNED without ``--owner-file``);
        raises ``BadOwner`` when the file is missing or malformed."""
        path = self.opts.owner_file
        if path is None:
            return UNOWNED
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_OWNER_FILE_BYTES + 1)
        except OSError as exc:
            raise BadOwner(f"cannot read the owner file {path}: {exc.strerror or exc}") from None
        try:
            return parse_owner(raw).namespace
        except BadOwner as exc:
            raise BadOwner(f"the owner file {path} is malformed: {exc}") from None

    async def _reject_not_regular(self, kind: str) -> None:
        """A ``replicator.yaml`` that is a symlink or FIFO: never read, refused, removed."""
        await self._refuse(
            None,
            f"{CONFIG_FILE} is {kind}, not a regular file: the replicator reads only a regular "
            "file",
            f"Write it as one (atomically: {CONFIG_FILE}.tmp, then rename)",
        )
        path = self.opts.checkpoint_dir / CONFIG_FILE
        if fsutil.lkind(path) not in (None, "a regular file"):
            path.unlink(missing_ok=True)  # unlink never follows the link it removes
        self._config_finished = self._config_renamed = False
        self._pending = None

    def _delete_config(self, accepted: str) -> None:
        # Only the text we judged: a newer handshake written meanwhile must survive.
        try:
            current = self._read_config()
        except fsutil.NotRegularFile:
            current = None  # replaced meanwhile: the next check refuses it
        if current == accepted:
            (self.opts.checkpoint_dir / CONFIG_FILE).unlink(missing_ok=True)
            self._config_finished = self._config_renamed = False
        self._pending = None

    async def _host_coordinator(
        self,
        config: JobConfig | None,
        owner: str = UNOWNED,
        *,
        incarnation: str | None = None,
        resume_steady: bool = False,
        register_later: bool = False,
    ) -> None:
        """Host the job's coordinator for ``owner`` when this node is its rank 0; drop any
        other. ``register_later``: a registration that fails for now goes on in the
        background (a restarted daemon resumes its job meanwhile); otherwise it is waited
        for.

        A cluster job's coordinator is registered for the other ranks to find; a one-node
        job's is called in process by its agent only, so it needs no registry. Raises
        ``OwnedByAnother`` (hosting nothing) when the job is registered to another owner.
        Entries of dropped coordinators stay: they keep their job names their owners'.

        A new incarnation of rank 0 keeps the job's coordinator (and its memory of the
        released round, which keeps stale agents out of the new one); ``incarnation``, the one
        that runs rank 0 here, is the only one that may open a new round. A daemon restarted
        while its job runs (``resume_steady``) hosts one that takes the running ranks back.
        """
        if self._registering is not None:
            self._registering.cancel()  # superseded by what is decided now
            self._registering = None
        keep = config.job_name if config is not None and config.node_rank == 0 else None
        for job in self.coordinators.jobs():
            hosted = self.coordinators.get(job)
            if job != keep and hosted is not None:
                self.coordinators.drop(job)
        if config is None or keep is None:
            return
        view = cluster_view_json(config)
        if config.nodes == 1:
            # A one-node job's agent calls it in process: nothing to register.
            self.coordinators.host(
                config,
                view,
                resume_steady=resume_steady,
                owner=owner,
                rank0_incarnation=incarnation,
            )
            return
        if self.registry is None:
            return
        self.coordinators.host(
            config, view, resume_steady=resume_steady, owner=owner, rank0_incarnation=incarnation
        )
        coordinator_id = self.coordinators.coordinator_id(keep)
        assert coordinator_id is not None
        assert self.advertise is not None
        entry = RegistryEntry(keep, self.advertise, coordinator_id, time.time(), owner)
        try:
            await self._claim(entry, once=register_later)
        except (OwnedByAnother, Stopping):
            self.coordinators.drop(keep)
            raise
        except (ObjectStoreError, OSError):
            self._registering = asyncio.create_task(
                self._claim_later(entry), name=f"register-{keep}"
            )
            return
        log.info(
            "hosting the coordinator of job %s at %s (id %s)", keep, self.advertise, coordinator_id
        )

    async def _claim(self, entry: RegistryEntry, *, once: bool = False) -> None:
        """Register ``entry``, waiting out what may heal (a full or unreachable store: the
        uploads wait for it too) with jittered backoff and saying why, instead of letting
        the error end the daemon. ``OwnedByAnother`` at once; ``Stopping`` when the daemon
        is asked to stop first; with ``once``, the first error that may heal."""
        assert self.registry is not None
        backoff = Backoff(1.0, 30.0)
        while True:
            try:
                await asyncio.to_thread(self.registry.claim, entry)
            except (ObjectStoreError, OSError) as exc:
                if once:
                    log.warning(
                        "cannot register the coordinator of job %s in %s yet (resuming "
                        "meanwhile): %s",
                        entry.job,
                        self.registry.url,
                        exc,
                    )
                    raise
                wait = backoff.next()
                log.warning(
                    "cannot register the coordinator of job %s in %s, again in %.1fs: %s",
                    entry.job,
                    self.registry.url,
                    wait,
                    exc,
                )
            else:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)
            if self._stop.is_set():
                raise Stopping(f"stopped before the coordinator of job {entry.job} registered")

    async def _claim_later(self, entry: RegistryEntry) -> None:
        """The registration a resume could not make at once: retried until it is made. The
        entry's owner refused meanwhile, the job stops here as a refused handshake would."""
        with contextlib.suppress(Stopping):
            try:
                await self._claim(entry)
            except OwnedByAnother as exc:
                self.coordinators.drop(entry.job)
                running = self.incarnation
                if running is not None and running.config.job_name == entry.job:
                    log.error("stopping job %s: %s", entry.job, exc)
                    await self._end_incarnation()
                    text = f"mtc-replicator: job {entry.job} stopped: {exc}.\nRestart the job.\n"
                    fsutil.atomic_write_bytes(self.opts.checkpoint_dir / FAILED_FILE, text.encode())
                return
        if not self._stop.is_set():
            log.info("registered the coordinator of job %s at last", entry.job)

    async def _resume(self, resumed: Incarnation) -> None:
        """Resume the incarnation a restart interrupted, under the owner the node has now
        (the same pod's, unless the handshake was refused before)."""
        job = resumed.config.job_name
        try:
            resumed.owner = await asyncio.to_thread(self._read_owner)
            await self._host_coordinator(
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
        refused = await self._bucket_verdict(config)
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
            owner = await loop.run_in_executor(self.executor, self._read_owner)
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
            await self._host_coordinator(config, owner, incarnation=incarnation_id)
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
        self._delete_config(text)
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
