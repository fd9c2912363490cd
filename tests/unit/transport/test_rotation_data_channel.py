"""A rotated certificate the daemon keeps out (``TlsMaterial.vet``: it names another node,
or peers would refuse it) must stay out of the data channel too.

SECURITY.md: "A rotated certificate must name the same node as the one the daemon started
with, or it is kept out with a warning". gRPC takes the vetted bytes, but the data
channel's ``ssl.SSLContext`` loaded the certificate and key from the files on disk, so the
first data connection after such a rotation presented the refused certificate.
"""

from __future__ import annotations

import time
from pathlib import Path

from cryptography import x509

from mtc_replicator.core.identity import NotANode
from mtc_replicator.tools import certs
from mtc_replicator.transport.identity import keeps_node, node_of, own_node
from mtc_replicator.transport.signing import _handshake_with_self
from mtc_replicator.transport.tls import TlsMaterial


def _presented(tls: TlsMaterial) -> str:
    """The node the data channel's server context presents, seen from its own client."""
    der = _handshake_with_self(tls).getpeercert(binary_form=True)
    assert der is not None
    try:
        return node_of(x509.load_der_x509_certificate(der), tls.rule)
    except NotANode:
        return "(no node)"


def _rotate(root: Path, ca: certs.Pair, node: str) -> None:
    time.sleep(0.01)  # a new mtime, as a real rotation has
    certs.write_node_files(root, ca, certs.issue(ca, node=node))


def test_a_rotation_to_another_nodes_certificate_is_kept_off_the_data_channel(
    tmp_path: Path,
) -> None:
    ca = certs.new_ca()
    certs.write_node_files(tmp_path, ca, certs.issue(ca, node="node-a"))
    tls = TlsMaterial(certs.node_files(tmp_path))
    tls.vet = keeps_node(own_node(tls))  # as node.startup does

    _rotate(tmp_path, ca, "node-b")  # refused: another node's name
    assert not tls.refresh()
    assert own_node(tls) == "node-a"  # gRPC and signing keep the old certificate

    assert _presented(tls) == "node-a"


def test_a_rotation_refused_after_a_good_one_is_kept_off_the_data_channel(
    tmp_path: Path,
) -> None:
    ca = certs.new_ca()
    certs.write_node_files(tmp_path, ca, certs.issue(ca, node="node-a"))
    tls = TlsMaterial(certs.node_files(tmp_path))
    tls.vet = keeps_node(own_node(tls))
    assert _presented(tls) == "node-a"

    _rotate(tmp_path, ca, "node-a")  # a good rotation: contexts are rebuilt
    assert tls.refresh()
    _rotate(tmp_path, ca, "node-b")  # then a refused one before the next data connection
    assert not tls.refresh()

    assert _presented(tls) == "node-a"
