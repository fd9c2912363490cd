"""The operator's signing identity: who may sign a restore pin. Reads key files (I/O).

A restore pin rolls a whole job back, so the daemons believe one only when an operator
signed it (``core.signed``, kind ``restore-pin``). An operator certificate is issued by the
nodes' own CA (``mtc certs operator``: whoever holds the CA key is the operator already) and
carries one extended key usage, ``OPERATOR_PURPOSE``, and no other:

- a node certificate (serverAuth, clientAuth) cannot sign a pin: a stolen node key, or the
  node that runs the attacker's pod, cannot roll other jobs back;
- an operator certificate cannot speak TLS to a daemon (gRPC and the data channel require
  serverAuth or clientAuth), and cannot sign COMMITs or registry entries (``CaVerifier``
  requires a node certificate): it is good for pins and nothing else.

The check is made at the pin's own signed time, as for records: the certificate (and the
intermediates the signature carries) must chain to the CA bundle (``--tls-ca``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ObjectIdentifier
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from mtc_replicator.core.signed import RecordRefused, RecordTrust, Signature
from mtc_replicator.transport.signing import check_signature, record_time, sign_with
from mtc_replicator.transport.tls import MAX_PEM_BYTES, TlsError, TlsMaterial

OPERATOR_PURPOSE = ObjectIdentifier("2.25.34504478103338770273403458314827940550")
"""The extended key usage of an operator certificate (a UUID OID, ours alone)."""
OPERATOR_REMEDY = (
    "sign pins with `mtc backups pin --operator-cert FILE --operator-key FILE`, an "
    "operator certificate from `mtc certs operator DIR` (docs/cli.md)"
)


def _operator_purpose(
    policy: object, cert: x509.Certificate, eku: x509.ExtendedKeyUsage | None
) -> None:
    if eku is None or OPERATOR_PURPOSE not in list(eku):
        raise ValueError("it is not an operator certificate (no mtc operator key usage)")


def _reason(exc: Exception) -> str:
    text = str(exc).split(" (encountered")[0]
    return text.replace("Python extension validator failed: ValueError: ", "")


def _verify_operator_chain(
    roots_pem: bytes,
    leaf: x509.Certificate,
    intermediates: list[x509.Certificate],
    when: dt.datetime,
) -> None:
    """``VerificationError`` (or ``ValueError``) unless ``leaf`` is an operator certificate
    of the CA, valid at ``when``."""
    roots = x509.load_pem_x509_certificates(roots_pem)
    ee = ExtensionPolicy.webpki_defaults_ee().require_present(
        x509.ExtendedKeyUsage, Criticality.AGNOSTIC, _operator_purpose
    )
    verifier = (
        PolicyBuilder()
        .store(Store(roots))
        .time(when)
        .extension_policies(ca_policy=ExtensionPolicy.webpki_defaults_ca(), ee_policy=ee)
        .build_client_verifier()
    )
    verifier.verify(leaf, intermediates)


class OperatorVerifier:
    """Believes a signature made by an operator certificate of the CA, valid at the pin's
    time; a node certificate is refused."""

    def __init__(self, ca_pem: Callable[[], bytes]) -> None:
        self.ca_pem = ca_pem
        """The CA bundle, read at each check (it rotates with the Secret)."""

    @classmethod
    def from_file(cls, path: Path) -> OperatorVerifier:
        try:
            pem = path.read_bytes()
            x509.load_pem_x509_certificates(pem)
        except (OSError, ValueError) as exc:
            raise TlsError(f"the TLS CA {path} is not usable: {exc}") from None
        return cls(lambda: pem)

    def verify(self, payload: bytes, signature: Signature, at: float) -> None:
        try:
            chain = x509.load_pem_x509_certificates(signature.certificates)
        except ValueError:
            raise RecordRefused("the signer's certificate is not a PEM certificate") from None
        leaf, intermediates = chain[0], chain[1:]
        when = record_time(at)
        try:
            _verify_operator_chain(self.ca_pem(), leaf, intermediates, when)
        except (VerificationError, ValueError, UnsupportedAlgorithm) as exc:
            raise RecordRefused(
                f"the signer's certificate {leaf.subject.rfc4514_string()!r:.120} is not an "
                f"operator certificate of the CA at the pin's time {when:%Y-%m-%dT%H:%M:%SZ}: "
                f"{_reason(exc)}"
            ) from None
        try:
            check_signature(leaf, signature.value, payload)
        except InvalidSignature:
            raise RecordRefused(
                "the signature does not match the pin: it was altered after signing"
            ) from None


class OperatorSigner:
    """Signs with an operator's certificate and key, read from files once."""

    def __init__(self, cert: Path, key: Path) -> None:
        try:
            self.chain = cert.read_bytes()[:MAX_PEM_BYTES]
            self.key = key.read_bytes()[:MAX_PEM_BYTES]
            certificates = x509.load_pem_x509_certificates(self.chain)
            private = serialization.load_pem_private_key(self.key, password=None)
        except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise TlsError(f"the operator certificate {cert} or key {key}: {exc}") from None
        self.certificate, self.intermediates = certificates[0], certificates[1:]
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        der = serialization.Encoding.DER
        if private.public_key().public_bytes(
            der, public
        ) != self.certificate.public_key().public_bytes(der, public):
            raise TlsError(f"the operator key {key} is not the key of {cert}")

    def name(self) -> str:
        names = self.certificate.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        return str(names[0].value) if names else "?"

    def check(self, ca: Path, when: dt.datetime) -> None:
        """``TlsError`` unless daemons trusting ``ca`` take this as an operator certificate."""
        try:
            _verify_operator_chain(ca.read_bytes(), self.certificate, self.intermediates, when)
        except (OSError, VerificationError, ValueError, UnsupportedAlgorithm) as exc:
            raise TlsError(
                f"daemons trusting {ca} would refuse pins signed with this certificate: "
                f"{_reason(exc)}; issue one with `mtc certs operator DIR`"
            ) from None

    def sign(self, payload: bytes) -> Signature:
        return Signature(self.chain, sign_with(self.key, payload))


def pin_trust(tls: TlsMaterial | None, *, accept_unsigned: bool = False) -> RecordTrust:
    """A daemon's trust in restore pins: signed by an operator of its CA; without TLS
    material nothing is checked (as for records)."""
    if tls is None:
        return RecordTrust(accept_unsigned=accept_unsigned)
    return RecordTrust(None, OperatorVerifier(tls.ca_bundle), accept_unsigned)
