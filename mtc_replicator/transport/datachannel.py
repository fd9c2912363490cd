"""The bulk data channel: an item's bytes on a plain TCP stream beside the gRPC port. I/O module.

gRPC frames, copies and flow-controls every 1 MiB message in Python: a daemon receiving a
push spent ~0.8 CPU seconds per GiB where a socket copy spends ~0.5, and the push reached
only two thirds of a raw socket's speed. So a transfer is still offered, checked and
answered over gRPC (``peer``), but its bytes may move here:

1. the serving daemon (the receiver of a push, the holder of a pulled item) checks the
   request as always, then issues a one-time ``Ticket`` on this listener and tells the
   other side its port and token (push: initial metadata ``mtc-data-channel``; pull: fields
   of the header);
2. the other side connects to that port on the host it reached gRPC at and writes the
   16-byte token; the listener hands the connection to whoever holds the ticket;
3. the sender writes every non-empty file's bytes in manifest order, nothing else (the
   manifest gives every size, so there is no framing to trust), with ``sendfile``, and
   shuts its side down; the receiver checks every byte against the manifest's per-file size
   and crc32c as it arrives (``transfer.ItemWriter``), and the gRPC call carries the verdict.

A connection whose token is unknown, already used or late is closed without a byte read
past it; tokens come from ``secrets`` and compare in constant time. The sender books every
send with the node's pacer (``local.pacer``) first: a push is replication, a pull served a
restore.

With TLS (``transport.tls``) every data connection is mutual TLS 1.3 before the token is
read: the listener requires a client certificate from the CA, the connecting side checks
the node name. The bytes then go through OpenSSL (``sendfile`` cannot carry TLS on this
Python) and are authenticated per record (AES-GCM), so an on-path attacker can neither
read nor alter them undetected; crc32c stays the check against bit rot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from mtc_replicator.core import stripes
from mtc_replicator.core.identity import NotANode
from mtc_replicator.core.manifest import Cancelled, Manifest
from mtc_replicator.core.retry import Backoff
from mtc_replicator.local.pacer import Meter, SharedMeter
from mtc_replicator.local.store import LocalStore, StoreError
from mtc_replicator.transport.datapool import (
    Abort,
    Conn,
    TransferPool,
    raw_socket,
)
from mtc_replicator.transport.identity import peer_node
from mtc_replicator.transport.streams import ChannelBroken, ChannelProtocolError, ChannelUnreachable
from mtc_replicator.transport.tls import TlsMaterial, TlsStream
from mtc_replicator.transport.transfer import (
    MAX_CHUNK,
    ItemWriter,
    Progress,
    discard_staging,
    item_files,
    short_file,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
HANDSHAKE_SECONDS = 10.0
"""A connection must finish its TLS handshake and present its token within this long in
all, or it is closed: a per-read timeout alone lets a peer dripping a byte every few
seconds hold a handshake slot for ever."""
MAX_HANDSHAKES = 64
"""Connections allowed to be presenting a token at once; more are closed at once."""
MAX_HANDSHAKES_PER_PEER = 8
"""Of those, from one peer address: idle connections from one host cannot take every slot."""
RECV_BYTES = 2 << 20
"""Bytes per receive (and per write into the store): tmpfs takes 2 MiB writes for less CPU
a byte than 1 MiB ones (0.72-0.79 against 0.80-0.94 CPU s/GiB received, hashed and
written), and larger slices made the loopback sender pay more than the receiver saved
(docs/performance.md, "Receive slices"). The raw copy it is measured against uses it too."""
SEND_SLICE = 64 << 20
"""Bytes per ``sendfile`` call: between two, a cancelled transfer stops."""
TLS_SEND_BYTES = 1 << 20
"""Bytes read and handed to OpenSSL per send on a TLS connection."""


def _never() -> bool:
    return False


def _unbracket(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# --- the listener (the serving daemon) ---------------------------------------------------------


class Ticket:
    """One expected connection: its token, and the socket once it presented it."""

    def __init__(self, token: bytes, loop: asyncio.AbstractEventLoop) -> None:
        self.token = token
        self.connected: asyncio.Future[Conn] = loop.create_future()


class DataListener:
    """A TCP listener whose connections are matched to tickets by their first 16 bytes."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        tls: TlsMaterial | None = None,
        pool: TransferPool | None = None,
    ) -> None:
        self.tls = tls
        self.pool = pool or TransferPool()
        """The threads of the transfers served on this listener's connections."""
        host = _unbracket(host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen for data on {host}:{port}: {exc}") from None
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._tickets: dict[bytes, Ticket] = {}
        self._handshakes: Counter[str] = Counter()
        """Connections presenting their token now, by peer address."""
        self._tls_threads: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Accept connections in the running loop until ``close``."""
        self._task = asyncio.create_task(self._accept_loop(), name="data-channel")

    async def close(self) -> None:
        for task in (self._task, *self._tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._task, *self._tasks) if t), return_exceptions=True)
        self._sock.close()
        for ticket in self._tickets.values():
            ticket.connected.cancel()
        self._tickets.clear()
        self.pool.shutdown()
        if self._tls_threads is not None:
            self._tls_threads.shutdown(wait=False, cancel_futures=True)

    def issue(self) -> Ticket:
        """A new ticket; ``withdraw`` it when the transfer ends, connected or not."""
        ticket = Ticket(secrets.token_bytes(TOKEN_BYTES), asyncio.get_running_loop())
        self._tickets[ticket.token] = ticket
        return ticket

    def withdraw(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket.token, None)
        if ticket.connected.done() and not ticket.connected.cancelled():
            ticket.connected.result().close()
        ticket.connected.cancel()

    async def connection(self, ticket: Ticket, timeout: float) -> Conn:
        """The ticket's connection, blocking, once its token arrived; ``ChannelBroken`` if
        none came within ``timeout`` seconds."""
        try:
            sock = await asyncio.wait_for(asyncio.shield(ticket.connected), timeout)
        except TimeoutError:
            raise ChannelBroken(f"no data connection came within {timeout:g}s") from None
        self._tickets.pop(ticket.token, None)
        return sock

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                conn, peer = await loop.sock_accept(self._sock)
            except OSError as exc:  # EMFILE and friends: do not spin
                wait = backoff.next()
                log.warning("data channel: accept failed, again in %.1fs: %s", wait, exc)
                await asyncio.sleep(wait)
                continue
            backoff.reset()
            host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            if self._handshakes.total() >= MAX_HANDSHAKES:
                log.warning(
                    "data channel: %s refused, %d handshakes in flight", peer, MAX_HANDSHAKES
                )
                conn.close()
                continue
            if self._handshakes[host] >= MAX_HANDSHAKES_PER_PEER:
                log.warning(
                    "data channel: %s refused, %d handshakes in flight from %s",
                    peer,
                    MAX_HANDSHAKES_PER_PEER,
                    host,
                )
                conn.close()
                continue
            self._handshakes[host] += 1  # counted here: the next accept must see it
            task = asyncio.create_task(self._handshake(conn, peer, host))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handshake(self, conn: socket.socket, peer: object, host: str) -> None:
        accepted: Conn = conn
        try:
            if self.tls is None:
                reading = _read_exactly(conn, TOKEN_BYTES)
                token = await asyncio.wait_for(reading, HANDSHAKE_SECONDS)
            else:
                if self._tls_threads is None:
                    # Its own threads, one per handshake slot: stalled handshakes must not
                    # hold the loop's default executor, which the connecting side uses too.
                    self._tls_threads = ThreadPoolExecutor(
                        max_workers=MAX_HANDSHAKES, thread_name_prefix="mtc-tls-accept"
                    )
                accepted, token = await _within_handshake(
                    asyncio.get_running_loop().run_in_executor(
                        self._tls_threads, _tls_accept, conn, self.tls
                    ),
                    conn,
                )
        except (TimeoutError, OSError, ChannelBroken) as exc:
            log.warning("data channel: %s sent no token: %s", peer, exc or type(exc).__name__)
            conn.close()
            return
        except BaseException:  # the listener is closing
            conn.close()
            raise
        finally:
            self._handshakes[host] -= 1
            if self._handshakes[host] <= 0:
                del self._handshakes[host]
        ticket = self._match(token)
        if ticket is None:
            log.warning("data channel: %s presented an unknown or used token", peer)
            conn.close()
            return
        conn.setblocking(True)
        ticket.connected.set_result(accepted)

    def _match(self, token: bytes) -> Ticket | None:
        for known, ticket in self._tickets.items():
            if hmac.compare_digest(known, token) and not ticket.connected.done():
                return ticket
        return None


async def _within_handshake(
    accepting: asyncio.Future[tuple[TlsStream, bytes]], conn: socket.socket
) -> tuple[TlsStream, bytes]:
    """``accepting`` (``_tls_accept`` in a thread) within ``HANDSHAKE_SECONDS`` in all;
    else the socket is shut down, which ends the thread's blocked read, and ``TimeoutError``.
    The thread is awaited either way, also when the listener closes (the task cancelled):
    the caller closes the socket it reads, and its failure is nobody's to report then."""
    try:
        done, _ = await asyncio.wait({accepting}, timeout=HANDSHAKE_SECONDS)
    except asyncio.CancelledError:
        await _ended(accepting, conn)
        raise
    if done:
        return accepting.result()
    await _ended(accepting, conn)
    raise TimeoutError(f"no TLS handshake and token within {HANDSHAKE_SECONDS:g}s")


async def _ended(accepting: asyncio.Future[tuple[TlsStream, bytes]], conn: socket.socket) -> None:
    """The accepting thread ended: the socket shut down under its blocked read."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        await accepting


def _tls_accept(conn: socket.socket, tls: TlsMaterial) -> tuple[TlsStream, bytes]:
    """The TLS handshake (a client certificate from the CA required), then the token, each
    read within ``HANDSHAKE_SECONDS`` (``_within_handshake`` bounds the whole); blocking,
    so it runs in a thread."""
    conn.setblocking(True)
    conn.settimeout(HANDSHAKE_SECONDS)
    stream = TlsStream(conn, tls.server_context(), server_side=True)
    stream.handshake()
    try:
        peer_node(stream.peer_certificate(), tls.rule)  # before a byte of the token is read
    except NotANode as exc:
        raise ChannelBroken(f"its certificate is not a node's: {exc}") from None
    token = bytearray(TOKEN_BYTES)
    view, got = memoryview(token), 0
    while got < TOKEN_BYTES:
        n = stream.recv_into(view[got:])
        if n == 0:
            raise ChannelBroken(f"closed after {got} of {TOKEN_BYTES} bytes")
        got += n
    return stream, bytes(token)


async def _read_exactly(conn: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = b""
    while len(buf) < n:
        more = await loop.sock_recv(conn, n - len(buf))
        if not more:
            raise ChannelBroken(f"closed after {len(buf)} of {n} bytes")
        buf += more
    return buf


# --- the connecting side -----------------------------------------------------------------------


def connect(
    address: str, port: int, token: bytes, timeout: float, tls: TlsMaterial | None = None
) -> Conn:
    """Open the data connection to ``address``'s host (the one gRPC reached), with TLS when
    ``tls`` is given, and present the token; blocking, its stalls timing out after
    ``timeout`` seconds."""
    host = _unbracket(address.rpartition(":")[0])
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise ChannelUnreachable(
            f"cannot open the data connection to {host}:{port}: {exc}"
        ) from None
    conn: Conn = sock
    try:
        set_idle_timeout(sock, timeout)
        if tls is not None:
            conn = TlsStream(
                sock, tls.client_context(), server_side=False, server_hostname=tls.server_name
            )
            conn.handshake()
        conn.sendall(token)
    except OSError as exc:
        sock.close()
        raise ChannelBroken(f"data connection to {host}:{port} failed: {exc}") from None
    return conn


# --- moving the bytes (blocking: run in a thread) ----------------------------------------------


def set_idle_timeout(conn: Conn, seconds: float) -> None:
    """Make ``sock`` blocking, its sends and receives giving up after ``seconds`` stalled.

    ``SO_RCVTIMEO``/``SO_SNDTIMEO`` rather than ``settimeout``: Python implements the latter
    with a non-blocking socket, under which ``MSG_WAITALL`` returns whatever has arrived and
    ``sendfile`` stops at a full send buffer.
    """
    sock = raw_socket(conn)
    sock.settimeout(None)
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


def _receive_failed(exc: OSError, idle: float) -> ChannelBroken:
    # A receive timeout is EAGAIN on a plain socket, "want read" through OpenSSL.
    if isinstance(exc, ssl.SSLWantReadError | ssl.SSLWantWriteError) or exc.errno in (
        errno.EAGAIN,
        errno.EWOULDBLOCK,
    ):
        return ChannelBroken(f"no bytes for {idle:g}s")
    return ChannelBroken(f"data connection failed: {exc}")


class _Slices:
    """Whole slices off the data connection, each read into the next of a ring of reused
    buffers: the slice handed out stays intact until ``count - 1`` more were read (the
    writer's digest lane may still hash it, ``ItemWriter.slices_held``). No ``bytes`` per
    slice: BLAKE3 and ``os.write`` take the view; only a format-1 entry's crc32c needs a
    copy (``ItemWriter.write_raw``)."""

    def __init__(self, sock: Conn, idle: float, count: int) -> None:
        self.sock = sock
        self.idle = idle
        size = min(RECV_BYTES, MAX_CHUNK)
        self.ring = [memoryview(bytearray(size)) for _ in range(max(1, count))]
        self.turn = 0

    def __call__(self, n: int) -> memoryview:
        view = self.ring[self.turn]
        self.turn = (self.turn + 1) % len(self.ring)
        got = 0
        try:
            if isinstance(self.sock, TlsStream):
                # No ``MSG_WAITALL`` through OpenSSL: it hands over one 16 KiB record a read.
                while got < n:
                    more = self.sock.recv_into(view[got:n])
                    if not more:
                        break
                    got += more
            else:
                got = self.sock.recv_into(view[:n], n, socket.MSG_WAITALL)
        except OSError as exc:
            raise _receive_failed(exc, self.idle) from None
        return view[:got]


def receive_into(
    writer: ItemWriter,
    sock: Conn,
    *,
    idle_timeout: float,
    cancelled: Callable[[], bool] = _never,
    root: Path | None = None,
) -> int:
    """Read every byte of ``writer``'s item from ``sock`` into it, verified; the bytes read.

    The stream must end right after the last byte: more is a ``ChannelProtocolError``, less
    a ``ChannelBroken``. A mismatch with the manifest is ``ItemWriter``'s ``CorruptItem``.
    The caller calls ``writer.finish`` (commit) or ``close``.
    """
    manifest = writer.manifest
    set_idle_timeout(sock, idle_timeout)
    recv = _Slices(sock, idle_timeout, writer.slices_held)
    for index, entry in enumerate(manifest.files):
        offset = 0
        while offset < entry.size:
            if cancelled():
                raise Cancelled(str(manifest.item))
            data = recv(min(RECV_BYTES, MAX_CHUNK, entry.size - offset))
            if not data:
                raise ChannelBroken(
                    f"{manifest.item}: the data connection closed after "
                    f"{writer.bytes_written} of {manifest.total_bytes} bytes"
                )
            writer.write_raw(index, offset, data)
            offset += len(data)
    if recv(1):
        raise ChannelProtocolError(f"{manifest.item}: more bytes came than the manifest lists")
    return writer.bytes_written


def send_item(
    sock: Conn,
    manifest: Manifest,
    data: Path,
    *,
    idle_timeout: float,
    abort: Abort | None = None,
    root: Path | None = None,
    meter: Meter | None = None,
) -> int:
    """Write every byte of a committed item to ``sock`` in manifest order, with ``sendfile``
    (the bytes never enter this process), then shut the sending side; the bytes sent.

    With ``meter``, every send is booked with the node's pacer first, one slice at a time,
    so a paced or held transfer never goes quiet for longer than a slice's wait (the other
    side's idle timeout must not fire); ``abort`` also ends such a wait. ``CorruptItem``
    when a local file is shorter than its manifest says (the local copy is bad),
    ``ChannelBroken`` when the connection fails (the other side's verdict, if any, comes
    over gRPC), ``Cancelled`` when aborted.
    """
    set_idle_timeout(sock, idle_timeout)
    stop = abort.event if abort is not None else None
    tls = isinstance(sock, TlsStream)
    most = TLS_SEND_BYTES if tls else SEND_SLICE
    buffer = bytearray(TLS_SEND_BYTES) if tls else bytearray()
    sent = 0
    with contextlib.closing(item_files(manifest, data, root)) as files:
        for _, entry, fd in files:
            offset = 0
            while offset < entry.size:
                if abort is not None and abort():
                    raise Cancelled(str(manifest.item))
                count = min(most, entry.size - offset)
                if meter is not None:
                    count = min(count, meter.slice())
                    meter.take(count, stop)
                try:
                    if isinstance(sock, TlsStream):
                        n = _send_through_tls(sock, fd, offset, count, buffer)
                    else:
                        n = os.sendfile(sock.fileno(), fd, offset, count)
                except OSError as exc:
                    raise ChannelBroken(f"{manifest.item}: data connection failed: {exc}") from None
                if n == 0:
                    raise short_file(manifest, entry, offset)
                if meter is not None and n < count:
                    meter.refund(count - n)  # booked, not sent: the next send uses it
                offset += n
                sent += n
    with contextlib.suppress(OSError):
        # The descriptor's half-close, also under TLS (no close_notify, which would wait for
        # the other side's): the manifest fixes every length, so a cut is told from an end
        # by the byte count, and bytes past the end are refused.
        raw_socket(sock).shutdown(socket.SHUT_WR)
    return sent


def _send_through_tls(sock: TlsStream, fd: int, offset: int, left: int, buffer: bytearray) -> int:
    """Read one buffer's worth of the file at ``offset`` and send it; the bytes sent."""
    view = memoryview(buffer)[: min(len(buffer), left)]
    n = os.preadv(fd, [view], offset)
    if n:
        sock.sendall(view[:n])
    return n


async def receive_staged(
    store: LocalStore,
    manifest: Manifest,
    socks: Sequence[Conn],
    *,
    idle_timeout: float,
    pool: TransferPool,
    progress: Progress | None = None,
) -> int:
    """Stage, verify and commit an item arriving on ``socks``; the bytes written. With
    several connections, each carries its part of the item's files (``core.stripes``) and
    is received on a thread of its own, with its own writer and digests.

    As with ``transfer.receive_item``, nothing outside the staging directory is written
    before the commit's rename, and on any error the staging directory is removed.
    """
    staged = store.new_staging()
    abort = Abort(socks)
    writers: list[ItemWriter] = []

    def open_writers() -> None:
        # In turn: the first part's writer makes the directories the others write into.
        # Digests inline: a hop to a hashing thread per slice cost more CPU than it saved;
        # a transfer that is to use more cores uses more connections.
        for n, part in enumerate(stripes.parts(manifest, len(socks))):
            writers.append(ItemWriter(part, staged, made=n > 0))

    def receive(writer: ItemWriter, sock: Conn) -> int:
        nbytes = receive_into(writer, sock, idle_timeout=idle_timeout, cancelled=abort)
        writer.finish()
        return nbytes

    try:
        try:
            await pool.run(open_writers, abort)
            if progress is not None:
                progress.writers = tuple(writers)
            parts = [
                functools.partial(receive, w, sock) for w, sock in zip(writers, socks, strict=True)
            ]
            nbytes = sum(await pool.run_all(parts, abort))
        finally:
            for writer in writers:  # no thread uses them any more (``run_all``)
                writer.close()
        await pool.run(functools.partial(store.commit_staged, staged, manifest), abort)
    except OSError as exc:
        raise StoreError(f"{manifest.item}: cannot stage the incoming copy: {exc}") from exc
    finally:
        await discard_staging(staged)
    return nbytes


async def send_staged(
    manifest: Manifest,
    data: Path,
    socks: Sequence[Conn],
    *,
    idle_timeout: float,
    pool: TransferPool,
    root: Path | None = None,
    meter: Meter | None = None,
) -> int:
    """``send_item`` on a thread of ``pool`` per connection, each with its part of the
    item's files (``core.stripes``), paced by ``meter`` when given (one account for all of
    them); cancelling the awaiting task stops them, also while they wait for the pacer."""
    abort = Abort(socks)
    if meter is not None and len(socks) > 1:
        meter = SharedMeter(meter)
    send = functools.partial(
        send_item, data=data, idle_timeout=idle_timeout, abort=abort, root=root, meter=meter
    )
    # On a pool thread, as the receiving side does: O(files x connections), 0.6 s for
    # 100,000 files on 8, must not stall the event loop.
    split = [manifest]
    if len(socks) > 1:
        split = await pool.run(functools.partial(stripes.parts, manifest, len(socks)), abort)
    parts = [functools.partial(send, sock, part) for part, sock in zip(split, socks, strict=True)]
    return sum(await pool.run_all(parts, abort))
