"""Signing and verifying records with the node's TLS identity. Reads key files (I/O).

The cert-manager Secret holds only ``tls.crt``, ``tls.key`` and ``ca.crt``, so records are
signed with the node's own TLS key and carry its certificate chain (``core.signed``). A
reader checks the signature with that certificate, and that the certificate chains to the
CA (``--tls-ca``) and names the node server name (``--tls-server-name``), *at the record's
own signed time*: node certificates rotate every few weeks while backups live for months.

``NodeSigner`` and ``CaVerifier`` take the material from ``TlsMaterial``, so a rotated
Secret is used from the next record on without a restart.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from replicator.core.signed import RecordRefused, RecordTrust, Signature
from replicator.transport.tls import DEFAULT_SERVER_NAME, TlsError, TlsMaterial


class NodeSigner:
    """Signs with this node's current TLS key; the signature carries its certificate chain."""

    def __init__(self, tls: TlsMaterial) -> None:
        self.tls = tls

    def sign(self, payload: bytes) -> Signature:
        chain, key_pem = self.tls.identity()
        key = serialization.load_pem_private_key(key_pem, password=None)
        if isinstance(key, ec.EllipticCurvePrivateKey):
            value = key.sign(payload, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPrivateKey):
            value = key.sign(payload, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(key, ed25519.Ed25519PrivateKey):
            value = key.sign(payload)
        else:
            raise TlsError(f"cannot sign records with a {type(key).__name__} TLS key")
        return Signature(chain, value)


def _check_signature(cert: x509.Certificate, value: bytes, payload: bytes) -> None:
    key = cert.public_key()
    # The algorithm follows the certificate's key: the record does not get to choose it.
    if isinstance(key, ec.EllipticCurvePublicKey):
        key.verify(value, payload, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPublicKey):
        key.verify(value, payload, padding.PKCS1v15(), hashes.SHA256())
    elif isinstance(key, ed25519.Ed25519PublicKey):
        key.verify(value, payload)
    else:
        raise RecordRefused(f"the signer's {type(key).__name__} key is not one nodes sign with")


def _when(at: float) -> dt.datetime:
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC)
    except (OverflowError, OSError, ValueError):
        raise RecordRefused(f"the record's time {at!r:.40} is not a date") from None


class CaVerifier:
    """Believes a signature made by a node certificate of the CA, valid at the record's time."""

    def __init__(self, ca_pem: Callable[[], bytes], server_name: str = DEFAULT_SERVER_NAME):
        self.ca_pem = ca_pem
        """The CA bundle, read at each check (it rotates with the Secret)."""
        self.server_name = server_name

    @classmethod
    def from_file(cls, path: Path, server_name: str = DEFAULT_SERVER_NAME) -> CaVerifier:
        """For ``mtc backups --tls-ca``: the CA file, read once."""
        try:
            pem = path.read_bytes()
            x509.load_pem_x509_certificates(pem)
        except (OSError, ValueError) as exc:
            raise TlsError(f"the TLS CA {path} is not usable: {exc}") from None
        return cls(lambda: pem, server_name)

    def verify(self, payload: bytes, signature: Signature, at: float) -> None:
        try:
            chain = x509.load_pem_x509_certificates(signature.certificates)
        except ValueError:
            raise RecordRefused("the signer's certificate is not a PEM certificate") from None
        leaf, intermediates = chain[0], chain[1:]
        when = _when(at)
        try:
            roots = x509.load_pem_x509_certificates(self.ca_pem())
            verifier = (
                PolicyBuilder()
                .store(Store(roots))
                .time(when)
                .build_server_verifier(x509.DNSName(self.server_name))
            )
            verifier.verify(leaf, intermediates)
        except (VerificationError, ValueError, UnsupportedAlgorithm) as exc:
            raise RecordRefused(
                f"the signer's certificate {leaf.subject.rfc4514_string()!r:.120} is not a "
                f"node certificate ({self.server_name}) of the CA at the record's time "
                f"{when:%Y-%m-%dT%H:%M:%SZ}: {str(exc).split(' (encountered')[0]}"
            ) from None
        try:
            _check_signature(leaf, signature.value, payload)
        except InvalidSignature:
            raise RecordRefused(
                "the signature does not match the record: it was altered after signing"
            ) from None


def record_trust(tls: TlsMaterial | None, *, accept_unsigned: bool = False) -> RecordTrust:
    """A daemon's trust: sign and verify with its TLS material; without any, neither."""
    if tls is None:
        return RecordTrust(accept_unsigned=accept_unsigned)
    return RecordTrust(NodeSigner(tls), CaVerifier(tls.ca_bundle, tls.server_name), accept_unsigned)
