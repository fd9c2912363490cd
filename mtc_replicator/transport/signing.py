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
import ssl
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from mtc_replicator.core.signed import RecordRefused, RecordTrust, Signature
from mtc_replicator.transport.tls import DEFAULT_SERVER_NAME, TlsError, TlsMaterial


class NodeSigner:
    """Signs with this node's current TLS key; the signature carries its certificate chain."""

    def __init__(self, tls: TlsMaterial) -> None:
        self.tls = tls

    def sign(self, payload: bytes) -> Signature:
        chain, key_pem = self.tls.identity()
        return Signature(chain, sign_with(key_pem, payload))


def sign_with(key_pem: bytes, payload: bytes) -> bytes:
    """The signature of ``payload`` by the PEM private key ``key_pem``."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(payload, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(payload, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(payload)
    raise TlsError(f"cannot sign records with a {type(key).__name__} key")


def check_signature(cert: x509.Certificate, value: bytes, payload: bytes) -> None:
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


def record_time(at: float) -> dt.datetime:
    try:
        return dt.datetime.fromtimestamp(at, dt.UTC)
    except (OverflowError, OSError, ValueError):
        raise RecordRefused(f"the record's time {at!r:.40} is not a date") from None


def _verify_node_chain(
    roots_pem: bytes,
    server_name: str,
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    when: dt.datetime,
) -> None:
    """Raises ``VerificationError`` (or ``ValueError``) unless ``leaf`` is a node certificate
    of the CA at ``when``: the one rule both records and start-up apply."""
    roots = x509.load_pem_x509_certificates(roots_pem)
    verifier = (
        PolicyBuilder()
        .store(Store(roots))
        .time(when)
        .build_server_verifier(x509.DNSName(server_name))
    )
    verifier.verify(leaf, intermediates)


def _reason(exc: Exception) -> str:
    return str(exc).split(" (encountered")[0]


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
        when = record_time(at)
        try:
            _verify_node_chain(self.ca_pem(), self.server_name, leaf, intermediates, when)
        except (VerificationError, ValueError, UnsupportedAlgorithm) as exc:
            raise RecordRefused(
                f"the signer's certificate {leaf.subject.rfc4514_string()!r:.120} is not a "
                f"node certificate ({self.server_name}) of the CA at the record's time "
                f"{when:%Y-%m-%dT%H:%M:%SZ}: {_reason(exc)}"
            ) from None
        try:
            check_signature(leaf, signature.value, payload)
        except InvalidSignature:
            raise RecordRefused(
                "the signature does not match the record: it was altered after signing"
            ) from None


CERT_REMEDY = (
    "issue node certificates with `mtc certs init DIR` (docs/deploy.md) or cert-manager: "
    "signed by the --tls-ca CA (whose certificate has keyUsage keyCertSign), valid now, with "
    "the DNS name {name} (--tls-server-name) as a subjectAltName and extendedKeyUsage "
    "serverAuth and clientAuth"
)


def check_identity(tls: TlsMaterial, now: dt.datetime | None = None) -> None:
    """Raise ``TlsError`` (the reason, then the remedy) unless peers will accept this node's
    own certificate: as the signer of its records (the rule ``CaVerifier`` applies), as a
    client certificate, and in a real TLS handshake with itself (what gRPC and the data
    channel check). Without this a daemon with a bad certificate starts, says ready, and
    every job it joins waits for records and connections its peers refuse."""
    chain_pem, _ = tls.identity()
    remedy = CERT_REMEDY.format(name=tls.server_name)
    where = f"the TLS certificate {tls.files.cert} would be refused by peers"
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as exc:
        raise TlsError(f"{where}: not a PEM certificate ({exc}); {remedy}") from None
    leaf, intermediates = chain[0], chain[1:]
    when = now or dt.datetime.now(dt.UTC)
    try:
        ca_pem = tls.ca_bundle()
        _verify_node_chain(ca_pem, tls.server_name, leaf, intermediates, when)
        roots = x509.load_pem_x509_certificates(ca_pem)
        client = PolicyBuilder().store(Store(roots)).time(when).build_client_verifier()
        client.verify(leaf, intermediates)
    except (VerificationError, ValueError, UnsupportedAlgorithm) as exc:
        start, end = leaf.not_valid_before_utc, leaf.not_valid_after_utc
        window = (
            ""
            if start <= when <= end
            else f" (it is valid from {start:%Y-%m-%dT%H:%M:%SZ} to {end:%Y-%m-%dT%H:%M:%SZ})"
        )
        raise TlsError(f"{where}: {_reason(exc)}{window}; {remedy}") from None
    try:
        _handshake_with_self(tls)
    except ssl.SSLError as exc:
        raise TlsError(f"{where}: a TLS handshake with itself fails: {exc}; {remedy}") from None


def _handshake_with_self(tls: TlsMaterial) -> ssl.SSLObject:
    """One TLS handshake between this node's server and client contexts, in memory; the
    client's end (its peer certificate is the one the server context presents)."""
    server_in, server_out, client_in, client_out = (ssl.MemoryBIO() for _ in range(4))
    server = tls.server_context().wrap_bio(server_in, server_out, server_side=True)
    client = tls.client_context().wrap_bio(
        client_in, client_out, server_side=False, server_hostname=tls.server_name
    )
    done = {id(server): False, id(client): False}
    for _ in range(10):  # TLS 1.3 needs three flights
        for end in (client, server):
            if done[id(end)]:
                continue
            try:
                end.do_handshake()
                done[id(end)] = True
            except ssl.SSLWantReadError:
                pass
        server_in.write(client_out.read())
        client_in.write(server_out.read())
        if all(done.values()):
            return client  # the server checked the client's certificate in its last step
    raise ssl.SSLError("the handshake did not finish")


def record_trust(tls: TlsMaterial | None, *, accept_unsigned: bool = False) -> RecordTrust:
    """A daemon's trust: sign and verify with its TLS material; without any, neither."""
    if tls is None:
        return RecordTrust(accept_unsigned=accept_unsigned)
    return RecordTrust(NodeSigner(tls), CaVerifier(tls.ca_bundle, tls.server_name), accept_unsigned)
