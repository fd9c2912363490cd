"""What the daemon opens before it serves: its TLS material and the node its certificate
names, the backup tier, and glibc's malloc thresholds. Each refuses early, with one line,
what would fail later (``TlsError`` for a certificate peers would refuse)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

from mtc_replicator.core.identity import IdentityRule
from mtc_replicator.core.signed import RecordTrust
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.node.options import DaemonOptions
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
    rule = IdentityRule(opts.tls_node_name_pattern, shared)
    tls = open_material(opts.tls_cert, opts.tls_key, opts.tls_ca, opts.tls_server_name, rule)
    if tls is None:
        return None, None
    check_identity(tls)  # what peers will check, before anything is served
    node = own_node(tls)
    tls.vet = keeps_node(node)  # every rotated certificate too, and it must name this node
    return tls, node
