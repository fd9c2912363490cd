"""What the daemon opens before it serves: CHECKPOINT_DIR, its TLS material and the node its
certificate names, the backup tier, and glibc's malloc thresholds. Each refuses early, with
one line, what would fail later (``TlsError`` for a certificate peers would refuse,
``CheckpointDirMissing`` for a CHECKPOINT_DIR that is not there)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from mtc_replicator.cluster.registry import Registry
from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.identity import IdentityRule
from mtc_replicator.core.signed import RecordTrust
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.node.owner_watch import read_owner
from mtc_replicator.node.pool_node import PoolNode
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.stores import open_object_store
from mtc_replicator.transport.identity import keeps_node, own_node
from mtc_replicator.transport.signing import check_identity
from mtc_replicator.transport.tls import TlsMaterial, open_material


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


def open_backups(opts: DaemonOptions, trust: RecordTrust, pacer: Pacer) -> BackupStore | None:
    """The backup tier at ``--backup``, its uploads paced with replication; None without."""
    if not opts.backup:
        return None
    objects = open_object_store(opts.backup, timeout=opts.storage_timeout)
    return BackupStore(objects, trust, pacer=pacer)


def open_tls(opts: DaemonOptions) -> tuple[TlsMaterial | None, str | None]:
    """The TLS material, checked as peers will check it, and the node its certificate
    names (``core.identity``); neither without TLS. ``TlsError`` when peers would refuse it."""
    shared = opts.tls_server_name if opts.tls_shared_certificate else None
    rule = IdentityRule(opts.tls_node_name_pattern, shared, opts.tls_server_name)
    tls = open_material(opts.tls_cert, opts.tls_key, opts.tls_ca, opts.tls_server_name, rule)
    if tls is None:
        return None, None
    check_identity(tls)  # what peers will check, before anything is served
    node = own_node(tls)
    tls.vet = keeps_node(node)  # every rotated certificate too, and it must name this node
    return tls, node


log = logging.getLogger(__name__)

IN_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
"""Filesystems whose files live in RAM: what CHECKPOINT_DIR is meant to be on."""
MOUNTINFO = Path("/proc/self/mountinfo")


class CheckpointDirMissing(Exception):
    """CHECKPOINT_DIR is not an existing directory: never created, as a mistyped path would
    be served silently, on whatever disk holds it."""


@dataclass(frozen=True)
class CheckpointFilesystem:
    """The filesystem CHECKPOINT_DIR is on, as the kernel's mount table names it."""

    fs_type: str | None
    """``tmpfs``, ``ext4``...; None when no mount of its device is listed (btrfs subvolumes
    report another device than their mount)."""

    @property
    def in_memory(self) -> bool:
        return self.fs_type in IN_MEMORY_FILESYSTEMS

    def warning(self, path: Path) -> str | None:
        """What the daemon warns of at start: a CHECKPOINT_DIR that is not in RAM."""
        if self.in_memory:
            return None
        what = (
            f"on a {self.fs_type} filesystem" if self.fs_type else "on a filesystem of unknown type"
        )
        return (
            f"CHECKPOINT_DIR {path} is {what}, not a RAM disk (tmpfs): saves and restores "
            "run at that disk's speed and the checkpoints outlive the node's memory; the "
            "CSI plugin mounts a tmpfs for it (docs/deploy.md), a local run can use /dev/shm"
        )


def check_checkpoint_dir(path: Path, mountinfo: Path = MOUNTINFO) -> CheckpointFilesystem:
    """CHECKPOINT_DIR's filesystem, with a warning logged when it is not in RAM;
    ``CheckpointDirMissing`` unless it is an existing directory (the CSI plugin makes it on
    the RAM disk before the daemon starts)."""
    if not path.is_dir():
        there = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointDirMissing(
            f"CHECKPOINT_DIR {path} {there}: the daemon does not create it, as a mistyped "
            "--checkpoint-dir (MTC_CHECKPOINT_DIR) would be served on whatever disk holds "
            "it. In Kubernetes the CSI plugin makes it on the RAM disk (MTC_RAM_DIR/"
            "MTC_CHECKPOINT_SUBDIR, /var/lib/mtc/ramdisk/checkpoint in deploy/); for a local "
            "run create it on a tmpfs first (mkdir -p /dev/shm/mtc/checkpoint)"
        )
    found = CheckpointFilesystem(_fs_type(os.stat(path).st_dev, mountinfo))
    if (warning := found.warning(path)) is not None:
        log.warning("%s", warning)
    return found


def _fs_type(device: int, mountinfo: Path) -> str | None:
    """The type of the mounted filesystem of ``device`` in ``mountinfo`` (proc(5): the
    third field is ``major:minor``, the one after the ``-`` separator the type)."""
    want = f"{os.major(device)}:{os.minor(device)}"
    try:
        text = mountinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(" ")
        if len(fields) > 7 and fields[2] == want and "-" in fields[6:]:
            after = fields.index("-", 6) + 1
            if after < len(fields):
                return fields[after]
    return None


def open_pool(
    opts: DaemonOptions,
    registry: Registry | None,
    trust: ManifestTrust,
    store: LocalStore,
    executor: Executor,
) -> PoolNode | None:
    """This node in the pool of its registry (``core.pool``); None without a registry, or
    with ``--no-pool-copies``."""
    if registry is None or not opts.pool_copies:
        return None
    owner_file = opts.owner_file
    return PoolNode(
        registry,
        trust,
        store,
        executor,
        lambda: read_owner(owner_file),
        max_lead=opts.max_step_lead,
    )
