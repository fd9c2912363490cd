"""``mtc-csi``: the CSI node plugin process. Owns the process lifecycle.

Start: parse flags (each also from the environment, the DaemonSet's way), make sure the RAM
disk is mounted, serve Identity and Node on the unix socket kubelet dials. SIGTERM or SIGINT:
stop taking calls, give calls in flight a grace period, exit 0. The RAM disk stays mounted:
it holds the node's checkpoints, and the next plugin reuses it; unless the pod's
annotations (``--release-file``) say its configuration was deleted (``csi.release``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator import __version__
from mtc_replicator.csi.call_metrics import NO_CALL_METRICS, PrometheusCallMetrics
from mtc_replicator.csi.checkpoint import DEFAULT_SUBDIR, CheckpointDir, check_subdir_name
from mtc_replicator.csi.csi_servicer import DEFAULT_DRIVER_NAME, IdentityServicer, NodeServicer
from mtc_replicator.csi.errors import CheckpointDirError, RamDiskError
from mtc_replicator.csi.mounter import Mounter, SystemMounter
from mtc_replicator.csi.plugin_server import CsiServer, EndpointError, parse_endpoint
from mtc_replicator.csi.quantity import SizeError, format_size, parse_size
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.release import release_ram_disk, release_requested
from mtc_replicator.csi.tenancy import (
    OPEN_POLICY,
    MountPolicy,
    parse_namespaces,
    parse_service_accounts,
)
from mtc_replicator.csi.volumes import NodeVolumes
from mtc_replicator.obs.health import Health, directory_check
from mtc_replicator.obs.logs import add_log_arguments
from mtc_replicator.obs.logs import configure as configure_logging
from mtc_replicator.obs.metrics import FilesystemCollector, process_metrics
from mtc_replicator.obs.metrics_endpoint import MetricsError, MetricsServer, serve, split_address

log = logging.getLogger("mtc_replicator.csi.plugin")

READY_LINE = "csi plugin ready"
GRACE_SECONDS = 5.0
"""How long a mount in flight may finish after SIGTERM; kubelet retries whatever is cut."""
EXIT_STARTUP_FAILED = 3
DEFAULT_FS_GROUP = 65532
"""The RAM disk's group: the replicator's gid in deploy/ (its ``runAsGroup``)."""
MAX_GID = 2**31 - 1


@dataclass(frozen=True)
class PluginOptions:
    socket_path: Path
    node_id: str
    ram_dir: Path
    ram_size: int
    """Bytes."""
    driver_name: str = DEFAULT_DRIVER_NAME
    checkpoint_subdir: str = DEFAULT_SUBDIR
    """CHECKPOINT_DIR's name in the RAM disk: what pods get, never the RAM disk itself."""
    log_level: str = "INFO"
    log_format: str = "text"
    """``text`` or ``json`` (``mtc_replicator.obs.logs``)."""
    metrics: str | None = None
    """Where to serve Prometheus metrics (``HOST:PORT``); None: no metrics."""
    policy: MountPolicy = OPEN_POLICY
    """Whose pods may mount; open (with a warning) when no list is given."""
    fs_group: int | None = None
    """The group of the RAM disk and CHECKPOINT_DIR: the replicator's and the pods'
    (``--fs-group``, default ``DEFAULT_FS_GROUP``); None: the plugin's own group."""
    release_file: Path | None = None
    """The pod's annotations (a downward-API file), read at SIGTERM: the RAM disk is freed
    when they carry ``csi.release.RELEASE_ANNOTATION``; None: it is always kept."""


VARIABLES = {"endpoint": "MTC_CSI_ENDPOINT", "node_id": "MTC_CSI_NODE_ID"}
"""The plugin's own settings are ``MTC_CSI_*`` (the node's RAM disk, which the ConfigMap
shares, ``MTC_RAM_*``)."""
DEPRECATED_VARIABLES = {"MTC_CSI_ENDPOINT": "CSI_ENDPOINT", "MTC_CSI_NODE_ID": "NODE_NAME"}
"""Names of 0.1.0, still read when the new one is unset; the plugin warns at start."""


def _env(env: Mapping[str, str], option: str) -> str | None:
    name = VARIABLES[option]
    return env.get(name) or env.get(DEPRECATED_VARIABLES[name])


def deprecated_variables(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(old, new) for each old name ``env`` sets without its new one: what the plugin warns
    about."""
    return [
        (old, new) for new, old in DEPRECATED_VARIABLES.items() if env.get(old) and not env.get(new)
    ]


# Long: one add_argument per flag, each naming its environment variable, in one place.
def make_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """Every flag, its default from ``env`` (the process environment by default)."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="mtc-csi",
        description="The CSI node plugin: mounts this node's RAM disk and publishes its "
        "checkpoint directory into training pods. Every flag also reads the environment "
        "variable in brackets.",
    )
    p.add_argument(
        "--endpoint",
        default=_env(env, "endpoint"),
        help="unix socket to serve, unix:///csi/csi.sock [MTC_CSI_ENDPOINT]",
    )
    p.add_argument(
        "--node-id",
        default=_env(env, "node_id"),
        help="this node's name, as NodeGetInfo reports it [MTC_CSI_NODE_ID]",
    )
    p.add_argument(
        "--ram-dir",
        type=Path,
        default=env.get("MTC_RAM_DIR"),
        help="host path of the RAM disk (a tmpfs, mounted if it is not) [MTC_RAM_DIR]",
    )
    p.add_argument(
        "--ram-size",
        default=env.get("MTC_RAM_SIZE"),
        help="RAM disk size: 64Gi, 512Mi, 1G or bytes [MTC_RAM_SIZE]",
    )
    p.add_argument(
        "--driver-name",
        default=env.get("MTC_CSI_DRIVER_NAME", DEFAULT_DRIVER_NAME),
        help=f"CSI driver name, as the CSIDriver object names it (default: {DEFAULT_DRIVER_NAME})"
        " [MTC_CSI_DRIVER_NAME]",
    )
    p.add_argument(
        "--checkpoint-subdir",
        default=env.get("MTC_CHECKPOINT_SUBDIR", DEFAULT_SUBDIR),
        help="the RAM disk's subdirectory that pods get as their volume, the daemon's "
        f"CHECKPOINT_DIR (default: {DEFAULT_SUBDIR}) [MTC_CHECKPOINT_SUBDIR]",
    )
    p.add_argument(
        "--allowed-namespaces",
        default=env.get("MTC_CSI_ALLOWED_NAMESPACES", ""),
        metavar="NS[,NS...]",
        help="namespaces whose pods may mount the volume; with neither this nor "
        "--allowed-service-accounts, every namespace may (and the plugin warns) "
        "[MTC_CSI_ALLOWED_NAMESPACES]",
    )
    p.add_argument(
        "--allowed-service-accounts",
        default=env.get("MTC_CSI_ALLOWED_SERVICE_ACCOUNTS", ""),
        metavar="NS/NAME[,...]",
        help="service accounts whose pods may mount the volume, whether their namespace "
        "is listed or not [MTC_CSI_ALLOWED_SERVICE_ACCOUNTS]",
    )
    p.add_argument(
        "--fs-group",
        default=env.get("MTC_CSI_FS_GROUP", str(DEFAULT_FS_GROUP)),
        metavar="GID",
        help="group of the RAM disk and the checkpoint directory (mode 2770): the "
        "replicator's gid; training pods join it with fsGroup or runAsGroup "
        f"(default: {DEFAULT_FS_GROUP}) [MTC_CSI_FS_GROUP]",
    )
    add_log_arguments(p, env)
    p.add_argument(
        "--metrics",
        default=env.get("MTC_CSI_METRICS") or None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics; off by default "
        "[MTC_CSI_METRICS]",
    )
    p.add_argument(
        "--release-file",
        type=Path,
        default=env.get("MTC_CSI_RELEASE_FILE") or None,
        help="the pod's annotations (a downward-API file), read when the plugin stops: it "
        "frees the RAM disk when they say its configuration was deleted; off by default "
        "[MTC_CSI_RELEASE_FILE]",
    )
    p.add_argument(
        "--version", action="version", version=__version__, help="print the version and exit"
    )
    return p


def parse_args(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> PluginOptions:
    """Flags win over the environment (``MTC_*``; ``DEPRECATED_VARIABLES`` still read)."""
    p = make_parser(env)
    a = p.parse_args(argv)
    for flag, variable in (
        ("endpoint", VARIABLES["endpoint"]),
        ("node_id", VARIABLES["node_id"]),
        ("ram_dir", "MTC_RAM_DIR"),
        ("ram_size", "MTC_RAM_SIZE"),
    ):
        if not getattr(a, flag):
            p.error(f"--{flag.replace('_', '-')} (or {variable}) is required")
    try:
        socket_path = parse_endpoint(a.endpoint)
        ram_size = parse_size(a.ram_size)
        check_subdir_name(a.checkpoint_subdir)
        if a.metrics is not None:
            split_address(a.metrics)
        policy = MountPolicy(
            parse_namespaces(a.allowed_namespaces),
            parse_service_accounts(a.allowed_service_accounts),
        )
        fs_group = _gid(a.fs_group)
    except (EndpointError, SizeError, ValueError) as exc:
        p.error(str(exc))
    if not a.ram_dir.is_absolute():
        p.error(f"--ram-dir must be an absolute path, got {a.ram_dir}")
    return PluginOptions(
        socket_path=socket_path,
        node_id=a.node_id,
        ram_dir=Path(os.path.normpath(a.ram_dir)),
        ram_size=ram_size,
        driver_name=a.driver_name,
        checkpoint_subdir=a.checkpoint_subdir,
        log_level=a.log_level,
        log_format=a.log_format,
        metrics=a.metrics,
        policy=policy,
        fs_group=fs_group,
        release_file=a.release_file,
    )


def _gid(text: str) -> int:
    try:
        gid = int(text)
    except ValueError:
        gid = -1
    if not 0 <= gid <= MAX_GID:
        raise ValueError(f"--fs-group must be a numeric group id, got {text!r}")
    return gid


def run(opts: PluginOptions, mounter: Mounter, stop: threading.Event) -> int:
    """Serve until ``stop`` is set; the process exit code."""
    try:
        ram = ensure_ram_disk(mounter, opts.ram_dir, opts.ram_size, opts.fs_group)
        # Made now, not at the first publish: the daemon watches it from its start.
        CheckpointDir(opts.ram_dir, opts.checkpoint_subdir, opts.fs_group).prepare()
    except (RamDiskError, CheckpointDirError) as exc:
        log.error("%s", exc)
        return EXIT_STARTUP_FAILED
    volumes = NodeVolumes(
        mounter,
        opts.ram_dir,
        subdir=opts.checkpoint_subdir,
        policy=opts.policy,
        group=opts.fs_group,
    )
    if opts.policy.open:
        log.warning(
            "every namespace may mount the node's checkpoints: no --allowed-namespaces or "
            "--allowed-service-accounts (MTC_CSI_ALLOWED_NAMESPACES, "
            "MTC_CSI_ALLOWED_SERVICE_ACCOUNTS; spec.allowedNamespaces in the "
            "CheckpointConfiguration); set them to your training namespaces (SECURITY.md)"
        )
    metrics = PrometheusCallMetrics() if opts.metrics else None
    server = CsiServer(opts.socket_path, metrics=metrics or NO_CALL_METRICS)
    server.add(IdentityServicer(opts.driver_name, __version__, volumes).register)
    server.add(NodeServicer(volumes, opts.node_id).register)
    metrics_server: MetricsServer | None = None
    try:
        if metrics is not None and opts.metrics is not None:
            process_metrics(metrics.registry)
            metrics.registry.register(
                FilesystemCollector(opts.ram_dir, "mtc_csi_ram_disk", "the RAM disk")
            )
            # Ready while pods can be given the checkpoint directory.
            ready = directory_check(volumes.checkpoint.path, "the checkpoint directory")
            metrics_server = serve(metrics.registry, opts.metrics, Health(ready=[ready]))
        server.start()
    except (EndpointError, MetricsError) as exc:
        log.error("%s", exc)
        if metrics_server is not None:
            metrics_server.close()
        return EXIT_STARTUP_FAILED
    log.info(
        "%s: endpoint=unix://%s driver=%s node=%s ram-dir=%s checkpoint-dir=%s ram-device=%s "
        "version=%s metrics=%s allowed=%s fs-group=%s",
        READY_LINE,
        opts.socket_path,
        opts.driver_name,
        opts.node_id,
        opts.ram_dir,
        volumes.checkpoint.path,
        ram.device,
        __version__,
        metrics_server.address if metrics_server else None,
        opts.policy.describe(),
        volumes.checkpoint.group,
    )
    try:
        stop.wait()
    finally:
        log.info("stopping (grace %.0fs)", GRACE_SECONDS)
        server.stop(GRACE_SECONDS)
        if metrics_server is not None:
            metrics_server.close()
        if release_requested(opts.release_file):
            release_ram_disk(mounter, opts.ram_dir)
        log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    configure_logging(opts.log_level, opts.log_format)
    for old_name, new_name in deprecated_variables(os.environ):
        log.warning("%s is deprecated: set %s (read for now)", old_name, new_name)
    log.info(
        "starting mtc-csi %s: ram-dir=%s ram-size=%s",
        __version__,
        opts.ram_dir,
        format_size(opts.ram_size),
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run(opts, SystemMounter(), stop)


if __name__ == "__main__":
    sys.exit(main())
