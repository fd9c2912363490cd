"""Mutual TLS for every network path between daemons: gRPC and the data channel. I/O module.

``TlsMaterial`` owns the node's certificate, key and the CA that every peer's certificate
must chain to (``--tls-cert``, ``--tls-key``, ``--tls-ca``). It re-reads the three files
when they change: cert-manager and the kubelet rotate a mounted Secret in place (a new
``..data`` directory swapped in by one rename), and a daemon must not restart for it.

- The gRPC server takes ``server_credentials()``: gRPC asks for the certificate again at
  every new connection's handshake, so a rotation applies to the next connection while
  calls in flight keep theirs. Client certificates are required and must chain to the CA.
- gRPC clients take ``channel_credentials()`` and ``channel_options()``; ``generation``
  changes with every reload, so callers open new channels for new calls and let old ones
  finish (``transport.peer_client.PeerClient``).
- The data channel wraps its sockets with ``server_context()`` / ``client_context()``:
  TLS 1.3, certificates required both ways, names checked.

Every node's certificate carries one DNS name, ``server_name`` (``--tls-server-name``,
default ``mtc-replicator``): nodes are reached at pod or host IPs that no certificate can
list, so clients check that name instead of the address. Each also names its node in a URI
subjectAltName (``core.identity``); servers refuse callers whose certificate names none
(``transport.identity``, with ``rule``). What the CA signs is the trust boundary (SECURITY.md).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio

from mtc_replicator.core.identity import IdentityRule

log = logging.getLogger(__name__)

DEFAULT_SERVER_NAME = "mtc-replicator"
"""The DNS name every node certificate carries and every client checks."""
MAX_PEM_BYTES = 1 << 20


class TlsError(Exception):
    """The TLS files cannot be used (missing, unreadable, or the key does not fit)."""


@dataclass(frozen=True)
class TlsFiles:
    """Where the PEM files are."""

    cert: Path
    """This node's certificate chain (leaf first)."""
    key: Path
    """Its private key."""
    ca: Path
    """The CA bundle every peer's certificate must chain to."""


@dataclass(frozen=True)
class _Pem:
    cert: bytes
    key: bytes
    ca: bytes


def _signature(files: TlsFiles) -> tuple[tuple[int, int, int], ...]:
    """What changes when any file is replaced or rewritten (links followed, as mounted)."""
    out = []
    for path in (files.cert, files.key, files.ca):
        st = os.stat(path)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _read(path: Path, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise TlsError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PEM_BYTES or b"-----BEGIN" not in data:
        raise TlsError(f"the TLS {what} {path} is not a PEM file")
    return data


def _check(pem: _Pem, files: TlsFiles) -> None:
    """Load the pair and the CA the way both ends will, so a bad file fails here, clearly."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, OSError) as exc:
        raise TlsError(f"the TLS key {files.key} does not fit {files.cert}: {exc}") from None
    try:
        context.load_verify_locations(cadata=pem.ca.decode("ascii", "replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise TlsError(f"the TLS CA {files.ca} holds no usable certificate: {exc}") from None


class TlsMaterial:
    """The node's TLS identity, re-read when its files change. Thread-safe."""

    def __init__(
        self,
        files: TlsFiles,
        server_name: str = DEFAULT_SERVER_NAME,
        vet: Callable[[TlsMaterial], None] | None = None,
        rule: IdentityRule | None = None,
    ) -> None:
        self.files = files
        self.server_name = server_name
        self.rule = rule or IdentityRule()
        """Which callers are nodes (``transport.identity``): this node's servers refuse others."""
        self.vet = vet
        """Raises ``TlsError`` for material peers would refuse (``signing.check_identity``);
        a rotated set it refuses is kept out like a half-rotated one."""
        self._refused: tuple[tuple[int, int, int], ...] | None = None
        self._lock = threading.Lock()
        self._pem = self._load()
        try:
            self._signature = _signature(files)
        except OSError as exc:
            raise TlsError(f"cannot read the TLS files: {exc}") from None
        self.generation = 0
        """Counts reloads: a client that opened channels at an older one opens new ones."""
        self._served_generation = 0
        self._contexts: dict[bool, tuple[int, ssl.SSLContext]] = {}

    def _load(self) -> _Pem:
        pem = _Pem(
            _read(self.files.cert, "certificate"),
            _read(self.files.key, "key"),
            _read(self.files.ca, "CA"),
        )
        _check(pem, self.files)
        return pem

    def refresh(self) -> bool:
        """Re-read the files if they changed; True when new material is in use.

        A half-rotated set (a key that does not fit its certificate yet) keeps the old
        material and is tried again at the next call: the kubelet swaps all files at once,
        but a hand-made rotation may not. A set ``vet`` refuses (one peers would refuse)
        keeps the old material until the files change again.
        """
        with self._lock:
            try:
                signature = _signature(self.files)
            except OSError as exc:
                log.warning("TLS files unreadable, keeping the loaded ones: %s", exc)
                return False
            if signature in (self._signature, self._refused):
                return False
            try:
                pem = self._load()
                if self.vet is not None:
                    self.vet(TlsMaterial(self.files, self.server_name, rule=self.rule))
            except TlsError as exc:
                log.warning("new TLS files not usable yet, keeping the loaded ones: %s", exc)
                if self.vet is not None:
                    self._refused = signature  # vetted once per change: it costs a handshake
                return False
            self._signature, self._pem = signature, pem
            self.generation += 1
            log.info("TLS certificate reloaded (generation %d)", self.generation)
            return True

    def _current(self) -> _Pem:
        self.refresh()
        with self._lock:
            return self._pem

    def identity(self) -> tuple[bytes, bytes]:
        """The current certificate chain and key (PEM): what signs records (``signing``)."""
        pem = self._current()
        return pem.cert, pem.key

    def ca_bundle(self) -> bytes:
        """The current CA bundle (PEM)."""
        return self._current().ca

    # --- gRPC ---------------------------------------------------------------------------

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that require a client certificate from the CA, re-read per handshake."""
        pem = self._current()
        return grpc.dynamic_ssl_server_credentials(
            self._server_config(pem), self._fetch_server_config, require_client_authentication=True
        )

    @staticmethod
    def _server_config(pem: _Pem) -> Any:
        return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], pem.ca)

    def _fetch_server_config(self) -> Any:
        """gRPC's hook at each new connection: a new configuration, or None to keep it."""
        pem = self._current()
        with self._lock:
            if self._served_generation == self.generation:
                return None
            self._served_generation = self.generation
        return self._server_config(pem)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        pem = self._current()
        return grpc.ssl_channel_credentials(
            root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        """Check the node name every certificate carries, not the address dialled."""
        return [("grpc.ssl_target_name_override", self.server_name)]

    # --- the data channel -----------------------------------------------------------------

    def server_context(self) -> ssl.SSLContext:
        return self._context(server=True)

    def client_context(self) -> ssl.SSLContext:
        return self._context(server=False)

    def _context(self, *, server: bool) -> ssl.SSLContext:
        pem = self._current()
        with self._lock:
            cached = self._contexts.get(server)
            if cached is not None and cached[0] == self.generation:
                return cached[1]
            generation = self.generation
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=pem.ca.decode("ascii", "replace"))
        _load_chain(context, pem)  # the vetted bytes, never the files as they are now
        if server:
            # No TLS 1.3 session tickets: a pushing client never reads, and closing a socket
            # with unread tickets sends a reset that can cut the bytes still in flight.
            context.num_tickets = 0
        else:
            context.check_hostname = True
        with self._lock:
            self._contexts[server] = (generation, context)
        return context


def _load_chain(context: ssl.SSLContext, pem: _Pem) -> None:
    """Load ``pem``'s certificate and key into ``context``: the material in use (vetted,
    whole), not the files on disk, which may hold a rotation ``vet`` kept out or half of
    one. ``ssl`` loads only from files: anonymous memory files (``memfd``), so the key
    never touches a filesystem."""
    fds: list[int] = []
    try:
        for data in (pem.cert, pem.key):
            fd = os.memfd_create("mtc-tls", os.MFD_CLOEXEC)
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        context.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
    finally:
        for fd in fds:
            os.close(fd)


def open_channel(
    address: str, options: list[tuple[str, Any]], tls: TlsMaterial | None
) -> grpc.aio.Channel:
    """A channel to ``address``: mutual TLS with this node's certificate, or plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


HANDSHAKE_FAILURES = ("CERTIFICATE_VERIFY_FAILED", "Ssl handshake failed", "handshake failed")
"""What gRPC's error details say when the other side's certificate was refused."""


def refused_certificate(details: str) -> bool:
    """Whether a failed call's details say the TLS handshake failed (an untrusted peer, or
    one that does not speak TLS), as opposed to an unreachable address."""
    return any(marker in details for marker in HANDSHAKE_FAILURES)


def open_material(
    cert: str | None,
    key: str | None,
    ca: str | None,
    server_name: str = DEFAULT_SERVER_NAME,
    rule: IdentityRule | None = None,
) -> TlsMaterial | None:
    """The material the flags name: all three files, or none (plaintext, with a warning)."""
    if not (cert or key or ca):
        return None
    if not (cert and key and ca):
        raise TlsError("--tls-cert, --tls-key and --tls-ca go together: give all three or none")
    return TlsMaterial(TlsFiles(Path(cert), Path(key), Path(ca)), server_name, rule=rule)


class TlsStream:
    """TLS over a blocking socket through memory BIOs, for bulk bytes (the data channel).

    ``SSLSocket`` reads every 16 KiB record with its own system calls (header, then body)
    and writes every record with one: measured here, 1.4 GB/s between two processes. Here
    the socket is read and written a megabyte at a time and OpenSSL works on memory:
    2.3 GB/s. Certificates are checked by ``context`` during ``handshake``, as with
    ``wrap_socket``. Timeouts are the socket's (``SO_RCVTIMEO``/``SO_SNDTIMEO`` or
    ``settimeout``); a stalled peer raises ``OSError`` from the socket call.
    """

    RAW_BYTES = 1 << 20

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=server_hostname
        )
        self._raw = bytearray(self.RAW_BYTES)
        self._eof = False

    def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            self.sock.sendall(data)

    def _fill(self) -> None:
        if self._eof:
            raise ssl.SSLEOFError("the connection closed mid-record")
        n = self.sock.recv_into(self._raw)
        if n == 0:
            self._eof = True
            self._incoming.write_eof()
        else:
            self._incoming.write(memoryview(self._raw)[:n])

    def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
            else:
                self._flush()
                return

    def sendall(self, data: bytes | memoryview) -> None:
        self._tls.write(data)
        self._flush()

    def recv_into(self, view: memoryview) -> int:
        """Up to ``len(view)`` bytes (at least one unless the stream ended: then 0)."""
        while True:
            try:
                # With a buffer, read() returns the count (typeshed says bytes).
                return cast(int, self._tls.read(len(view), view))
            except ssl.SSLWantReadError:
                self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0  # the manifest's byte counts tell an end from a cut

    def peer_certificate(self) -> bytes | None:
        """The other side's leaf certificate (DER), once the handshake is done."""
        return self._tls.getpeercert(binary_form=True)

    def version(self) -> str | None:
        """The protocol agreed on (``TLSv1.3``), once the handshake is done."""
        return self._tls.version()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> TlsStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
