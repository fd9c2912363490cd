"""Throwaway certificate authorities for tests: a CA, node certificates signed by it, and
the daemon flags that use them. Built with ``replicator.tools.certs`` (``mtc certs``)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from replicator.tools import certs
from replicator.transport.tls import TlsFiles, TlsMaterial


@dataclass(frozen=True)
class NodeTls:
    """A directory with ``tls.crt``, ``tls.key`` and ``ca.crt``, as a daemon mounts it."""

    root: Path

    @property
    def files(self) -> TlsFiles:
        return certs.node_files(self.root)

    def args(self) -> tuple[str, ...]:
        return certs.daemon_flags(self.files)

    def material(self) -> TlsMaterial:
        return TlsMaterial(self.files)


def node_tls(
    root: Path,
    ca: certs.Pair,
    *,
    server_name: str = certs.DEFAULT_SERVER_NAME,
    expired: bool = False,
    trust: certs.Pair | None = None,
) -> NodeTls:
    """A node certificate from ``ca`` in ``root`` (``expired``: its validity ended a day
    ago; else valid since yesterday, so records dated when the tests were collected, minutes
    before, fall inside it), trusting ``trust`` (default: the same CA)."""
    now = dt.datetime.now(dt.UTC)
    start = now - dt.timedelta(days=3 if expired else 1)
    node = certs.issue(ca, server_name, days=2 if expired else 30, not_before=start)
    certs.write_node_files(root, trust or ca, node)
    return NodeTls(root)
