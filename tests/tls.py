"""Throwaway certificate authorities for tests: a CA, node certificates signed by it, and
the daemon flags that use them. Built with ``mtc_replicator.tools.certs`` (``mtc certs``)."""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mtc_replicator.core.identity import node_uri
from mtc_replicator.core.manifest import Manifest
from mtc_replicator.core.ownership import UNOWNED
from mtc_replicator.tools import certs
from mtc_replicator.transport.attesting import manifest_trust
from mtc_replicator.transport.identity import own_node
from mtc_replicator.transport.tls import TlsFiles, TlsMaterial

TEST_NODE = "test-node"
"""The node a test certificate names unless told otherwise."""


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

    def attest(self, manifest: Manifest, owner: str = UNOWNED) -> Manifest:
        """``manifest`` as this node attests what it produced (``core.attestation``)."""
        tls = self.material()
        return manifest_trust(tls, own_node(tls)).attest(manifest, owner, time.time())


def node_tls(
    root: Path,
    ca: certs.Pair,
    *,
    server_name: str = certs.DEFAULT_SERVER_NAME,
    node: str | None = TEST_NODE,
    expired: bool = False,
    trust: certs.Pair | None = None,
) -> NodeTls:
    """A certificate from ``ca`` naming ``node`` in ``root`` (None: a shared certificate of
    no node, for ``--tls-shared-certificate``; ``expired``: its validity ended a day ago;
    else valid since yesterday, so records dated when the tests were collected, minutes
    before, fall inside it), trusting ``trust`` (default: the same CA)."""
    now = dt.datetime.now(dt.UTC)
    start = now - dt.timedelta(days=3 if expired else 1)
    pair = certs.issue(ca, server_name, node=node, days=2 if expired else 30, not_before=start)
    certs.write_node_files(root, trust or ca, pair)
    return NodeTls(root)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def openssl_style_ca(*, key_usage: bool = True) -> certs.Pair:
    """A CA as ``openssl req -x509`` makes one: basicConstraints, no keyUsage unless asked."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hand-made CA")])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if key_usage:
        builder = builder.add_extension(certs.CA_KEY_USAGE, critical=True)
    cert = builder.sign(key, hashes.SHA256())
    return certs.Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def hand_made_node(
    ca: certs.Pair,
    *,
    dns_names: tuple[str, ...] = (certs.DEFAULT_SERVER_NAME,),
    usages: tuple[x509.ObjectIdentifier, ...] = (
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    ),
    valid_from: dt.timedelta = dt.timedelta(days=-1),
    valid_for: dt.timedelta = dt.timedelta(days=30),
    node: str | None = TEST_NODE,
) -> certs.Pair:
    """A node certificate with what a hand-written openssl config may leave out: no DNS
    names (no subjectAltName), other extended key usages, another validity window, no node
    name (``node`` None; with ``dns_names``, the node's URI goes beside them)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _key()
    start = dt.datetime.now(dt.UTC) + valid_from
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + valid_for)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if dns_names:
        names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        if node is not None:
            names.append(x509.UniformResourceIdentifier(node_uri(node)))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return certs.Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def operator_flags(root: Path, ca: certs.Pair, name: str = "alice") -> tuple[str, ...]:
    """An operator certificate from ``ca`` in ``root`` (``mtc certs operator``), as
    ``mtc backups pin``'s flags: what signs a restore pin daemons with TLS honour."""
    yesterday = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    pair = certs.issue_operator(ca, name, not_before=yesterday)
    certs.write_pair(root, pair, certs.OPERATOR_CERT, certs.OPERATOR_KEY)
    cert, key = root / certs.OPERATOR_CERT, root / certs.OPERATOR_KEY
    return ("--operator-cert", str(cert), "--operator-key", str(key))


def cert_manager_ca() -> certs.Pair:
    """The CA as deploy/components/cert-manager makes it: a ``selfSigned`` Issuer's
    Certificate ``mtc-ca`` (ECDSA P-256, isCA, cert-manager's CA usages: digital signature,
    key encipherment, cert sign; a subject key identifier)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mtc-replicator CA")])
    now = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=True,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(hours=87600))
        .add_extension(usage, critical=True)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certs.Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def csi_driver_certificate(
    ca: certs.Pair,
    uri: str,
    *,
    dns_names: tuple[str, ...] = (certs.DEFAULT_SERVER_NAME,),
    rsa_key: bool = False,
) -> certs.Pair:
    """A certificate as cert-manager's CA Issuer signs what csi-driver requests for the
    volume of deploy/components/cert-manager-per-node: no subject (no common-name
    attribute), so a critical subjectAltName with ``dns_names`` and the URI ``uri``
    (``${POD_NAME}`` expanded); keyUsage digital signature (and key encipherment for an RSA
    key, csi-driver's usages for one), extended usages server and client auth; CA:false;
    the CA's key identifier; 90 days; the key PKCS#8. ``rsa_key``: RSA 2048, not ECDSA."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048) if rsa_key else _key()
    )
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=rsa_key,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    names.append(x509.UniformResourceIdentifier(uri))
    start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(hours=2160))
        .add_extension(usage, critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certs.Pair(cert.public_bytes(serialization.Encoding.PEM), pem_key)
