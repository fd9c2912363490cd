"""The daemon's command line: its flags, each read from an ``MTC_*`` environment variable
too, and the validated, frozen ``DaemonOptions`` they make. No I/O beyond argparse's own
messages: ``parse_args`` exits 2 with a usage error on a bad value.

The flags are added group by group, in the order ``mtc-replicator --help`` lists them.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator import __version__
from mtc_replicator.core import argtypes
from mtc_replicator.core.admission import MAX_STEP_LEAD
from mtc_replicator.core.contract import ascii_digits
from mtc_replicator.core.drain import DEFAULT_DRAIN_SECONDS
from mtc_replicator.core.foreign import DEFAULT_TTL
from mtc_replicator.core.identity import DEFAULT_NODE_NAME_PATTERN
from mtc_replicator.core.manifest import DEFAULT_MAX_ITEM_FILES
from mtc_replicator.core.pacing import (
    DEFAULT_MIN_TRANSFER_RATE,
    DEFAULT_YIELD_TO_SAVES,
    MAX_YIELD_TO_SAVES,
    default_floor,
)
from mtc_replicator.core.policy import DEFAULT_KEEP_STEPS
from mtc_replicator.core.retry import DEFAULT_STORAGE_TIMEOUT
from mtc_replicator.core.stripes import MAX_STREAMS
from mtc_replicator.obs.logs import add_log_arguments
from mtc_replicator.transport.peer_servicer import IDLE_SECONDS
from mtc_replicator.transport.tls import DEFAULT_SERVER_NAME

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
    data_streams: int = 1
    """The most data connections one transfer of an item uses at once, each on a thread
    with its part of the item's files (``core.stripes``); the other side may allow fewer."""
    tls_cert: str | None = None
    """This node's certificate (PEM); with ``tls_key`` and ``tls_ca``, mutual TLS on every
    port and every call; None: plaintext, unauthenticated (a warning at start)."""
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str = DEFAULT_SERVER_NAME
    """The DNS name every node certificate carries; clients check it."""
    tls_node_name_pattern: str = DEFAULT_NODE_NAME_PATTERN
    """What the node name in a caller's certificate must match (``core.identity``)."""
    tls_shared_certificate: bool = False
    """Migration: every node presents one shared certificate that names no node; callers
    with the shared DNS name count as nodes (of no known name)."""
    require_rank_grant: bool = False
    """Serve only jobs mtc-controller assigned ranks for (``core.grant``): a handshake, a
    join, a push or a read of a job without its grant on this node is refused."""
    pool_copies: bool = True
    """One-node jobs in job directories copy their steps to another node of the pool, and
    this node keeps others' (``core.pool``); needs a registry."""
    accept_unsigned_records: bool = False
    """Believe unsigned COMMITs, registry entries and restore pins (written before records
    and pins were signed); those whose signature fails are refused all the same. Only
    matters with TLS on."""
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
    """On SIGTERM and at a job's end here (a switch, an empty handshake), how long the
    newest step may take to reach the peers and the backup (``core.drain``) before the job
    stops anyway; 0: no drain."""
    foreign_job_ttl: float = DEFAULT_TTL
    """Seconds a job that no longer runs here keeps its backed-up items (``core.foreign``)."""
    keep_steps: int = DEFAULT_KEEP_STEPS
    """The running job's newest complete steps of this rank kept on the RAM disk, with the
    other ranks' copies of them, besides what the safety rules keep (``core.policy``)."""


def _data_port(value: str) -> int | None:
    if value == "off":
        return None
    if value == "auto":
        return 0
    if not ascii_digits(value) or not 0 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port, 'auto' or 'off', got {value!r}")
    return int(value)


def auto_streams() -> int:
    """Half the cores this process may run on, 1 to ``MAX_STREAMS``: a node sends its own
    item and receives its peer's at once, each on as many cores."""
    return max(1, min(MAX_STREAMS, len(os.sched_getaffinity(0)) // 2))


def _data_streams(value: str) -> int:
    if value == "auto":
        return auto_streams()
    if not ascii_digits(value) or not 1 <= int(value) <= MAX_STREAMS:
        raise argparse.ArgumentTypeError(f"must be 1 to {MAX_STREAMS} or 'auto', got {value!r}")
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
    _add_locations(p, env)
    # String defaults go through each option's type like a flag would: a bad environment
    # variable is a usage error too, not a traceback.
    add_log_arguments(p, env)
    _add_timing(p, env)
    _add_ports_and_tls(p, env)
    _add_data_streams(p, env)
    _add_workload_rules(p, env)
    _add_transfer_limits(p, env)
    p.add_argument(
        "--version", action="version", version=__version__, help="print the version and exit"
    )
    return p


def _add_locations(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Where the daemon keeps and finds things: its directories, addresses, buckets."""
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
        help="gRPC address for peers and the coordinator (default: 0.0.0.0:7070) [MTC_LISTEN]",
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


def _add_timing(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Its threads and the clocks of the handshake, the scans and the reports."""
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


def _add_data_streams(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """How many connections, and so cores, one transfer's bytes may use."""
    p.add_argument(
        "--data-streams",
        type=_data_streams,
        default=env.get("MTC_DATA_STREAMS", "auto"),
        metavar="COUNT",
        help="most data connections one transfer of an item uses at once, each sending or "
        f"receiving its part of the item's files on a core of its own: 1 to {MAX_STREAMS}, "
        "or 'auto' (half the cores this daemon may run on) (default: auto) "
        "[MTC_DATA_STREAMS]",
    )


def _add_ports_and_tls(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """What it serves besides the gRPC port, and mutual TLS on all of it."""
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
        "(default: auto) [MTC_DATA_PORT]",
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
        "--tls-node-name-pattern",
        default=env.get("MTC_TLS_NODE_NAME_PATTERN", DEFAULT_NODE_NAME_PATTERN),
        help="a regular expression the node name in every caller's certificate "
        "(spiffe://mtc-replicator/node/NAME) must match; others are refused "
        "(default: a Kubernetes node name) [MTC_TLS_NODE_NAME_PATTERN]",
    )
    p.add_argument(
        "--tls-shared-certificate",
        action="store_true",
        default=_flag(env.get("MTC_TLS_SHARED_CERTIFICATE", "")),
        help="migration: every node presents one shared certificate naming no node (made by "
        "'mtc certs init'); without this flag the daemon's certificate must name its node "
        "('mtc certs node'), see docs/deploy.md [MTC_TLS_SHARED_CERTIFICATE]",
    )
    p.add_argument(
        "--accept-unsigned-records",
        action="store_true",
        default=_flag(env.get("MTC_ACCEPT_UNSIGNED_RECORDS", "")),
        help="migration: also believe COMMITs, registry entries, restore pins and item "
        "manifests that carry no signature (written by versions before signed records and "
        "attested manifests); a bad signature is refused all the same "
        "[MTC_ACCEPT_UNSIGNED_RECORDS]",
    )
    p.add_argument(
        "--health-listen",
        type=argtypes.listen_address,
        default=env.get("MTC_HEALTH_LISTEN") or None,
        help="also serve the gRPC health service alone, in plaintext, at HOST:PORT, for "
        "kubelet probes when TLS is on; off by default [MTC_HEALTH_LISTEN]",
    )


def _add_workload_rules(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """What a handshake may name and what a peer's push may be."""
    p.add_argument(
        "--require-rank-grant",
        action="store_true",
        default=_flag(env.get("MTC_REQUIRE_RANK_GRANT", "")),
        help="serve only jobs whose ranks mtc-controller assigned (sticky ranks): refuse the "
        "handshake, joins, pushes and reads of any job without its grant on this node, so "
        "no node takes a rank by coming first (needs per-node certificates) "
        "[MTC_REQUIRE_RANK_GRANT]",
    )
    p.add_argument(
        "--no-pool-copies",
        dest="pool_copies",
        action="store_false",
        default=not _flag(env.get("MTC_NO_POOL_COPIES", "")),
        help="neither push the steps of one-node jobs in job directories (Ray Tune trials) to "
        "another node of the pool nor keep other nodes' (default: both, where the daemon has "
        "a registry; docs/architecture.md, Pool copies) [MTC_NO_POOL_COPIES]",
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


def _add_transfer_limits(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """How fast and how long transfers, backups and the drain may go, and what stays."""
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
        help="on SIGTERM, and when a job ends here (another job's handshake, an empty one), "
        "push the job's newest step to peers that lack it and back it up when the bucket is "
        "older, for at most this long before stopping it; keep it under the pod's "
        "terminationGracePeriodSeconds less 10; 0: stop at once (default: %(default)s) "
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
        "--keep-steps",
        type=argtypes.positive,
        default=env.get("MTC_KEEP_STEPS", str(DEFAULT_KEEP_STEPS)),
        metavar="N",
        help="keep the running job's newest N complete steps of this node's rank on the RAM "
        "disk, with the peers' copies of them held here; the steps the safety rules keep "
        "(the restorable step, the one being uploaded, the newest two of a multi-node job "
        "until the coordinator confirms them) stay whatever N is. Size the RAM disk for it: "
        "docs/deploy.md#ram-disk-sizing (default: %(default)s) [MTC_KEEP_STEPS]",
    )


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
    if a.require_rank_grant and (not a.tls_cert or a.tls_shared_certificate):
        p.error(
            "--require-rank-grant needs each node's own certificate (--tls-cert, "
            "'mtc certs node'): a grant names nodes, and only a certificate tells them apart"
        )
    try:
        re.compile(a.tls_node_name_pattern)
    except re.error as exc:
        p.error(f"--tls-node-name-pattern {a.tls_node_name_pattern!r} is not a regex: {exc}")
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
        data_streams=a.data_streams,
        tls_cert=_text(a.tls_cert),
        tls_key=_text(a.tls_key),
        tls_ca=_text(a.tls_ca),
        tls_server_name=a.tls_server_name,
        tls_node_name_pattern=a.tls_node_name_pattern,
        tls_shared_certificate=a.tls_shared_certificate,
        require_rank_grant=a.require_rank_grant,
        pool_copies=a.pool_copies,
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
        keep_steps=a.keep_steps,
    )


def _text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def unsafe_settings(opts: DaemonOptions, *, tls: bool, listen: str | None) -> list[str]:
    """What the daemon warns of at start: settings that leave jobs or checkpoints open to
    whoever reaches the node or the bucket (SECURITY.md); ``listen``: the bound address."""
    found = []
    if opts.owner_file is None:
        found.append(
            "no --owner-file: every job on this node is unowned, and any pod that can "
            "write a replicator.yaml can take over any unowned job's coordinator "
            "(SECURITY.md)"
        )
    if not tls:
        found.append(
            f"TLS is off: the gRPC port {listen} and the data port are unauthenticated and "
            "unencrypted; anyone who reaches them can read, push and restore checkpoints "
            "and join jobs. Pass --tls-cert, --tls-key and --tls-ca (SECURITY.md)"
        )
        found.append(
            "without TLS material, COMMITs and registry entries are neither signed nor "
            "checked: whoever can write the bucket chooses what a job restores"
        )
    elif opts.accept_unsigned_records:
        found.append(
            "--accept-unsigned-records is on: unsigned COMMITs, registry entries, restore "
            "pins and item manifests are believed, so whoever can write the bucket, or holds "
            "a node certificate, can choose what a job restores and where its ranks join; "
            "turn it off once every record and item is signed"
        )
    return found
