"""Attesting the items this node produces, and checking other nodes' attestations, with
the node's TLS identity (``core.attestation`` decides; this module signs and verifies).

An attestation is checked with the rule signed records use (``transport.signing``: the
certificate chains to the CA with the node server name, at the attestation's own time),
and then says which node signed it (``transport.identity``'s rule), which must be the
producer it names.
"""

from __future__ import annotations

from mtc_replicator.core.attestation import ManifestTrust
from mtc_replicator.core.identity import IdentityRule, NotANode
from mtc_replicator.core.signed import RecordRefused, Signature
from mtc_replicator.transport.identity import node_of_pem
from mtc_replicator.transport.signing import CaVerifier, NodeSigner
from mtc_replicator.transport.tls import TlsMaterial


class ProducerVerifier:
    """Believes an item's attestation signed by a node certificate of the CA, and says which
    node signed it (``core.attestation``): the rule records use, plus the node's name."""

    def __init__(self, records: CaVerifier, rule: IdentityRule) -> None:
        self.records = records
        self.rule = rule

    def verify_node(self, payload: bytes, signature: Signature, at: float) -> str:
        self.records.verify(payload, signature, at)
        try:
            return node_of_pem(signature.certificates, self.rule)
        except NotANode as exc:
            raise RecordRefused(f"the signer's certificate is not a node's: {exc}") from None


def manifest_trust(
    tls: TlsMaterial | None, node: str | None, *, accept_unsigned: bool = False
) -> ManifestTrust:
    """A daemon's attestations: signed as ``node`` with its TLS key, and checked against
    its CA and node-name rule; without TLS material neither (the owner is still checked)."""
    if tls is None:
        return ManifestTrust(accept_unsigned=accept_unsigned)
    verifier = ProducerVerifier(CaVerifier(tls.ca_bundle, tls.server_name), tls.rule)
    return ManifestTrust(NodeSigner(tls), verifier, node or "", accept_unsigned)
