"""``mtc certs``: a CA and node certificates for mutual TLS, for clusters without cert-manager.

``mtc certs init DIR`` makes a CA in DIR (once: an existing one is kept) and issues one
certificate shared by every node (``tls.crt``, ``tls.key``, ``ca.crt``: the names of a
``kubernetes.io/tls`` Secret and of cert-manager's), for daemons run with
``--tls-shared-certificate``. ``mtc certs node NAME DIR`` issues a certificate that also
names its node (``core.identity``) into ``DIR/nodes/NAME``: what daemons need by default.
``mtc certs secret DIR`` prints the Secret of DIR's certificate for ``kubectl apply -f -``.
``mtc certs controller DIR`` issues mtc-controller's client certificate into
``DIR/controller`` (``CONTROLLER_URI``, no node name): the one that may call
``Node/AssignRank``. ``mtc certs operator DIR --name NAME`` issues an operator certificate
from DIR's CA (``operator.crt``, ``operator.key``): what signs restore pins
(``transport.operator_signing``), never a node's and never mounted in the cluster. Keys are
ECDSA P-256 (cheap handshakes); node certificates carry the shared DNS name
(``mtc-replicator`` unless told otherwise), which clients check instead of the address they
dial (``transport.tls``), and serve as server and client certificates both. Private keys
are written mode 0600.

The CA key stays with whoever runs this; only the node certificate, its key and the CA
certificate go into the cluster. Pure functions (``new_ca``, ``issue``) make certificates
in memory; tests and the demo use them for throwaway CAs.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mtc_replicator.core import argtypes
from mtc_replicator.core.identity import CONTROLLER_URI, DEFAULT_NODE_NAME_PATTERN, node_uri
from mtc_replicator.local import fsutil
from mtc_replicator.transport.operator_signing import OPERATOR_PURPOSE
from mtc_replicator.transport.tls import DEFAULT_SERVER_NAME, TlsFiles

CA_CERT, CA_KEY = "ca.crt", "ca.key"
NODE_CERT, NODE_KEY = "tls.crt", "tls.key"
OPERATOR_CERT, OPERATOR_KEY = "operator.crt", "operator.key"


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes


CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)
"""A CA's key usage: signing certificates and CRLs (and records: digital_signature)."""


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def new_ca(
    name: str = "mtc-replicator CA", *, days: int = 3650, not_before: dt.datetime | None = None
) -> Pair:
    """A self-signed CA that may sign node certificates and nothing below them.

    ``not_before`` moves the validity window (tests date records before today with it).
    """
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = not_before or (_now() - dt.timedelta(minutes=5))  # clocks differ a little
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(
    ca: Pair,
    server_name: str = DEFAULT_SERVER_NAME,
    *,
    node: str | None = None,
    days: int = 365,
    not_before: dt.datetime | None = None,
) -> Pair:
    """A node certificate signed by ``ca``, for server and client use under ``server_name``,
    naming ``node`` in a URI subjectAltName (``core.identity``; None: a shared certificate
    of no node, for ``--tls-shared-certificate``).

    ``not_before`` moves the validity window (tests make expired certificates with it).
    """
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf(
        ca, server_name, _names(server_name, node), usages, days=days, not_before=not_before
    )


def issue_operator(
    ca: Pair, name: str, *, days: int = 90, not_before: dt.datetime | None = None
) -> Pair:
    """An operator certificate signed by ``ca``, named ``name``: good for signing restore
    pins only (its one extended key usage), not for TLS nor for records."""
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(f"urn:mtc-replicator:operator:{name}")
    ]
    return _leaf(ca, name, names, [OPERATOR_PURPOSE], days=days, not_before=not_before)


def issue_controller(ca: Pair, *, days: int = 365) -> Pair:
    """mtc-controller's certificate: a TLS client named ``CONTROLLER_URI`` and no node, so
    it may hand ranks out (``Node/AssignRank``) and is refused on every node's RPC."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(CONTROLLER_URI)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf(ca, "mtc-controller", names, usages, days=days, not_before=None)


def _leaf(
    ca: Pair,
    common_name: str,
    names: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    *,
    days: int,
    not_before: dt.datetime | None,
) -> Pair:
    """A certificate ``ca`` signs: not a CA, named ``names``, good for ``usages`` only."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA key must be an ECDSA key made by mtc certs")
    key = _key()
    start = not_before or (_now() - dt.timedelta(minutes=5))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return Pair(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def _names(server_name: str, node: str | None) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.DNSName(server_name)]
    if node is not None:
        names.append(x509.UniformResourceIdentifier(node_uri(node)))
    return names


def write_pair(directory: Path, pair: Pair, cert_name: str, key_name: str) -> None:
    """Write a certificate and its key atomically; the key readable by its owner only."""
    directory.mkdir(parents=True, exist_ok=True)
    fsutil.atomic_write_bytes(directory / cert_name, pair.cert)
    fsutil.atomic_write_bytes(directory / key_name, pair.key, mode=0o600)


def write_node_files(directory: Path, ca: Pair, node: Pair) -> None:
    """What a daemon mounts: ``tls.crt``, ``tls.key`` and ``ca.crt`` (no CA key)."""
    write_pair(directory, node, NODE_CERT, NODE_KEY)
    fsutil.atomic_write_bytes(directory / CA_CERT, ca.cert)


def node_files(directory: Path) -> TlsFiles:
    """The files ``write_node_files`` wrote in ``directory``."""
    return TlsFiles(directory / NODE_CERT, directory / NODE_KEY, directory / CA_CERT)


def daemon_flags(files: TlsFiles) -> tuple[str, ...]:
    """``mtc-replicator``'s flags for ``files``."""
    return ("--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca))


def _ca(directory: Path) -> tuple[Pair, bool]:
    """The CA in ``directory``, made if absent; whether it was made."""
    cert, key = directory / CA_CERT, directory / CA_KEY
    if not cert.exists():
        ca = new_ca()
        write_pair(directory, ca, CA_CERT, CA_KEY)
        return ca, True
    return Pair(cert.read_bytes(), key.read_bytes()), False


def init(
    directory: Path, server_name: str, days: int, node: str | None = None
) -> tuple[Pair, bool]:
    """The CA in ``directory`` (made if absent) and a fresh node certificate beside it
    (shared by every node when ``node`` is None)."""
    ca, made = _ca(directory)
    write_pair(directory, issue(ca, server_name, node=node, days=days), NODE_CERT, NODE_KEY)
    return ca, made


def issue_node(directory: Path, node: str, server_name: str, days: int) -> tuple[Path, bool]:
    """A certificate naming ``node`` in ``directory/nodes/<node>/`` (``tls.crt``, ``tls.key``,
    ``ca.crt``: what that node's daemon mounts), from the CA in ``directory`` (made if
    absent); that folder, and whether the CA was made."""
    ca, made = _ca(directory)
    out = directory / "nodes" / node
    write_node_files(out, ca, issue(ca, server_name, node=node, days=days))
    return out, made


def issue_controller_files(directory: Path, days: int) -> tuple[Path, bool]:
    """The controller's certificate in ``directory/controller/`` (``tls.crt``, ``tls.key``,
    ``ca.crt``), from the CA in ``directory`` (made if absent); that folder, whether made."""
    ca, made = _ca(directory)
    out = directory / "controller"
    write_node_files(out, ca, issue_controller(ca, days=days))
    return out, made


def _node_name(value: str) -> str:
    if re.fullmatch(DEFAULT_NODE_NAME_PATTERN, value) is None:
        raise argparse.ArgumentTypeError(
            f"not a node name (lower-case letters, digits, '-' and '.'): {value!r}"
        )
    return value


def secret_manifest(directory: Path, name: str, namespace: str) -> str:
    """A ``kubernetes.io/tls`` Secret with ``ca.crt``: what the DaemonSet mounts."""

    def encoded(file: str) -> str:
        return base64.b64encode((directory / file).read_bytes()).decode()

    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "type": "kubernetes.io/tls",
        "data": {f: encoded(f) for f in (NODE_CERT, NODE_KEY, CA_CERT)},
    }
    return yaml.safe_dump(secret, sort_keys=False)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    about = "make a CA and the node certificate for mutual TLS, or their Secret"
    p = sub.add_parser("certs", help=about, description=about)
    verbs = p.add_subparsers(dest="certs_command", required=True)
    about = "make a CA in DIR (kept if present) and issue a fresh node certificate"
    init_p = verbs.add_parser("init", help=about, description=about)
    init_p.add_argument("dir", type=argtypes.path, help="where ca.crt, ca.key, tls.crt, tls.key go")
    init_p.add_argument(
        "--server-name",
        default=DEFAULT_SERVER_NAME,
        help="the DNS name in the node certificate; daemons check it (default: %(default)s)",
    )
    init_p.add_argument(
        "--days",
        type=argtypes.positive,
        default=365,
        help="node certificate lifetime (default: %(default)s)",
    )
    about = "issue an operator certificate from DIR's CA: it signs restore pins"
    op = verbs.add_parser("operator", help=about, description=about)
    op.add_argument("dir", type=argtypes.path, help="a directory made by 'mtc certs init'")
    op.add_argument(
        "--name", type=argtypes.operator_name, required=True, help="who the operator is"
    )
    op.add_argument(
        "--out",
        type=argtypes.path,
        help=f"where {OPERATOR_CERT} and {OPERATOR_KEY} go (default: DIR)",
    )
    op.add_argument(
        "--days",
        type=argtypes.positive,
        default=90,
        help="operator certificate lifetime (default: %(default)s)",
    )
    about = "issue a certificate naming node NAME, from the CA in DIR (made if absent)"
    node_p = verbs.add_parser("node", help=about, description=about)
    node_p.add_argument("name", type=_node_name, help="the node's name (Kubernetes: spec.nodeName)")
    node_p.add_argument(
        "dir", type=argtypes.path, help="the CA's directory; the node's files go to DIR/nodes/NAME"
    )
    node_p.add_argument(
        "--server-name",
        default=DEFAULT_SERVER_NAME,
        help="the shared DNS name in every node certificate (default: %(default)s)",
    )
    node_p.add_argument(
        "--days",
        type=argtypes.positive,
        default=365,
        help="node certificate lifetime (default: %(default)s)",
    )
    about = "issue mtc-controller's certificate (it assigns ranks), from the CA in DIR"
    ctl = verbs.add_parser("controller", help=about, description=about)
    ctl.add_argument(
        "dir", type=argtypes.path, help="the CA's directory; the files go to DIR/controller"
    )
    ctl.add_argument(
        "--days",
        type=argtypes.positive,
        default=365,
        help="controller certificate lifetime (default: %(default)s)",
    )
    about = "print the kubernetes.io/tls Secret of DIR's node certificate"
    secret_p = verbs.add_parser("secret", help=about, description=about)
    secret_p.add_argument("dir", type=argtypes.path, help="a directory made by 'mtc certs init'")
    secret_p.add_argument(
        "--name", default="mtc-replicator-tls", help="Secret name (default: %(default)s)"
    )
    secret_p.add_argument(
        "--namespace", default="mtc-system", help="Secret namespace (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    if args.certs_command == "node":
        out, made = issue_node(args.dir, args.name, args.server_name, args.days)
        print(
            f"{'made a CA and' if made else 'kept the CA and made'} a certificate for node "
            f"{args.name} in {out} ({NODE_CERT}, {NODE_KEY}, {CA_CERT}; keep "
            f"{args.dir / CA_KEY} off the cluster)"
        )
        return 0
    if args.certs_command == "init":
        _, made = init(args.dir, args.server_name, args.days)
        print(
            f"{'made a CA and' if made else 'kept the CA and made'} a node certificate in "
            f"{args.dir} ({NODE_CERT}, {NODE_KEY}, {CA_CERT}; keep {CA_KEY} off the cluster)"
        )
        return 0
    if args.certs_command == "operator":
        return _operator(args)
    if args.certs_command == "controller":
        out, made = issue_controller_files(args.dir, args.days)
        print(
            f"{'made a CA and' if made else 'kept the CA and made'} the controller's "
            f"certificate in {out} ({NODE_CERT}, {NODE_KEY}, {CA_CERT}: mtc-controller's TLS "
            f"Secret; keep {args.dir / CA_KEY} off the cluster)"
        )
        return 0
    missing = [f for f in (NODE_CERT, NODE_KEY, CA_CERT) if not (args.dir / f).is_file()]
    if missing:
        print(
            f"mtc certs: {args.dir} has no {', '.join(missing)}: run 'mtc certs init' first",
            file=sys.stderr,
        )
        return 1
    sys.stdout.write(secret_manifest(args.dir, args.name, args.namespace))
    return 0


def _operator(args: argparse.Namespace) -> int:
    cert, key = args.dir / CA_CERT, args.dir / CA_KEY
    if not (cert.is_file() and key.is_file()):
        print(f"mtc certs: {args.dir} has no {CA_CERT} and {CA_KEY}: the CA", file=sys.stderr)
        return 1
    out = args.out or args.dir
    pair = issue_operator(Pair(cert.read_bytes(), key.read_bytes()), args.name, days=args.days)
    write_pair(out, pair, OPERATOR_CERT, OPERATOR_KEY)
    print(
        f"made operator certificate {args.name!r} in {out} ({OPERATOR_CERT}, {OPERATOR_KEY}): "
        "it signs restore pins (mtc backups pin --operator-cert --operator-key); keep it "
        "off the cluster"
    )
    return 0
