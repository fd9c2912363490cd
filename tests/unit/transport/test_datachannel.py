"""Tests for ``mtc_replicator.transport.datachannel``: the ticketed listener and the byte movers.

Real sockets on loopback (and socket pairs), real files in ``tmp_path``. The whole data
channel between daemon processes, with hostile senders, is tested in
``tests/integration/test_peer_hostile.py`` and ``test_peer.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from mtc_replicator.core.manifest import CorruptItem, ItemId, Manifest
from mtc_replicator.local.hashing import build_manifest, verify_item
from mtc_replicator.tools import certs
from mtc_replicator.transport import datachannel, datapool
from mtc_replicator.transport.datachannel import (
    TOKEN_BYTES,
    Abort,
    ChannelBroken,
    ChannelProtocolError,
    DataListener,
    receive_into,
    send_item,
)
from mtc_replicator.transport.tls import TlsMaterial, TlsStream
from mtc_replicator.transport.transfer import ItemWriter
from tests.tls import node_tls

T = TypeVar("T")
ITEM = ItemId("job", 3, 1, 0)


def run(fn: Callable[[DataListener], Awaitable[T]], tls: TlsMaterial | None = None) -> T:
    async def main() -> T:
        listener = DataListener("127.0.0.1", tls=tls)
        listener.start()
        try:
            return await fn(listener)
        finally:
            await listener.close()

    return asyncio.run(main())


async def dial(port: int, payload: bytes) -> socket.socket:
    """A client connection that wrote ``payload``; non-blocking, for ``closed_by_peer``."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(payload)
    sock.setblocking(False)
    await asyncio.sleep(0)  # let the listener accept it
    return sock


async def closed_by_peer(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the other side closed ``sock`` (a read returns EOF) within ``within`` s."""
    loop = asyncio.get_running_loop()
    try:
        data = await asyncio.wait_for(loop.sock_recv(sock, 1), within)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return data == b""


def test_a_ticket_gets_the_connection_that_presents_its_token() -> None:
    async def scenario(listener: DataListener) -> bytes:
        ticket = listener.issue()
        client = await dial(listener.port, ticket.token + b"payload")
        server = await listener.connection(ticket, timeout=5)
        try:
            server.settimeout(5)
            return server.recv(100)  # the bytes after the token are the caller's
        finally:
            server.close()
            client.close()
            listener.withdraw(ticket)

    assert run(scenario) == b"payload"


def test_a_wrong_token_is_closed_and_the_ticket_still_waits() -> None:
    async def scenario(listener: DataListener) -> tuple[bool, bool]:
        ticket = listener.issue()
        wrong = bytes(b ^ 1 for b in ticket.token)
        intruder = await dial(listener.port, wrong + b"evil")
        refused = await closed_by_peer(intruder)
        intruder.close()
        client = await dial(listener.port, ticket.token)
        server = await listener.connection(ticket, timeout=5)
        served = server.fileno() >= 0
        server.close()
        client.close()
        return refused, served

    assert run(scenario) == (True, True)


def test_a_token_is_good_for_one_connection_only() -> None:
    async def scenario(listener: DataListener) -> bool:
        ticket = listener.issue()
        first = await dial(listener.port, ticket.token)
        server = await listener.connection(ticket, timeout=5)
        second = await dial(listener.port, ticket.token)
        refused = await closed_by_peer(second)
        for s in (first, second, server):
            s.close()
        return refused

    assert run(scenario)


def test_a_withdrawn_ticket_refuses_its_token() -> None:
    async def scenario(listener: DataListener) -> bool:
        ticket = listener.issue()
        listener.withdraw(ticket)
        late = await dial(listener.port, ticket.token)
        refused = await closed_by_peer(late)
        late.close()
        return refused

    assert run(scenario)


def test_no_connection_in_time_is_channel_broken() -> None:
    async def scenario(listener: DataListener) -> None:
        ticket = listener.issue()
        try:
            await listener.connection(ticket, timeout=0.2)
        finally:
            listener.withdraw(ticket)

    with pytest.raises(ChannelBroken, match=r"no data connection came within 0\.2s"):
        run(scenario)


def test_a_silent_connection_is_closed_after_the_handshake_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(datachannel, "HANDSHAKE_SECONDS", 0.3)

    async def scenario(listener: DataListener) -> tuple[bool, bool]:
        half = await dial(listener.port, b"\x00" * (TOKEN_BYTES // 2))
        early = await closed_by_peer(half, within=0.1)
        late = await closed_by_peer(half, within=3)
        half.close()
        return early, late

    assert run(scenario) == (False, True)


def test_connections_past_the_handshake_limit_are_closed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(datachannel, "MAX_HANDSHAKES", 2)

    async def scenario(listener: DataListener) -> tuple[list[bool], bool]:
        silent = [await dial(listener.port, b"") for _ in range(2)]
        await asyncio.sleep(0.2)  # both are presenting (nothing) now
        extra = await dial(listener.port, b"")
        refused = await closed_by_peer(extra, within=2)
        kept = [await closed_by_peer(s, within=0.1) for s in silent]
        for s in (*silent, extra):
            s.close()
        return kept, refused

    assert run(scenario) == ([False, False], True)


def test_one_host_cannot_take_every_handshake_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Silent connections from one address fill that address's slots only: another
    address still presents its token and gets its ticket."""
    monkeypatch.setattr(datachannel, "MAX_HANDSHAKES_PER_PEER", 2)

    async def scenario(listener: DataListener) -> tuple[bool, bytes]:
        silent = [await dial(listener.port, b"") for _ in range(2)]
        await asyncio.sleep(0.2)
        extra = await dial(listener.port, b"")
        refused = await closed_by_peer(extra, within=2)
        ticket = listener.issue()
        other = socket.create_connection(
            ("127.0.0.1", listener.port), timeout=5, source_address=("127.0.0.2", 0)
        )
        other.sendall(ticket.token + b"hello")
        conn = await listener.connection(ticket, timeout=5)
        assert isinstance(conn, socket.socket)
        got = conn.recv(5, socket.MSG_WAITALL)
        for s in (*silent, extra, other, conn):
            s.close()
        return refused, got

    assert run(scenario) == (True, b"hello")


def test_the_transfer_pool_bounds_threads_in_all_and_per_peer() -> None:
    pool = datapool.TransferPool(size=3, per_peer=2)
    assert [pool.claim("a"), pool.claim("a"), pool.claim("a")] == [True, True, False]
    assert [pool.claim("b"), pool.claim("c")] == [True, False]
    pool.release("a")
    assert pool.claim("c")
    assert not pool.claim("a")
    pool.shutdown()


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen for data on 127.0.0.1:{port}"):
            DataListener("127.0.0.1", port)


# --- moving the bytes --------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Manifest, Path]:
    data = tmp_path / "src"
    (data / "state" / "deep").mkdir(parents=True)
    (data / "empty_dir").mkdir()
    (data / "meta").write_bytes(b'{"step": 3}')
    (data / "state" / "big.bin").write_bytes(os.urandom(3 << 20 | 4321))
    (data / "state" / "deep" / "zero.bin").write_bytes(b"")
    return build_manifest(ITEM, data), data


def body(manifest: Manifest, data: Path) -> bytes:
    """What a sender writes: every file's bytes in manifest order."""
    return b"".join((data / e.path).read_bytes() for e in manifest.files)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def feed(sock: socket.socket, payload: bytes, *, close: bool = True) -> threading.Thread:
    def run() -> None:
        try:
            sock.sendall(payload)
            if close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the receiver gave up first: what these tests provoke

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def receive(manifest: Manifest, staged: Path, sock: socket.socket, idle: float = 5.0) -> int:
    staged.mkdir()
    writer = ItemWriter(manifest, staged)
    try:
        n = receive_into(writer, sock, idle_timeout=idle)
        writer.finish()
        return n
    finally:
        writer.close()


def test_send_then_receive_reproduces_the_item(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, data = tree
    out, into = pair
    sent: list[int] = []
    sender = threading.Thread(
        target=lambda: sent.append(send_item(out, manifest, data, idle_timeout=5))
    )
    sender.start()
    assert receive(manifest, tmp_path / "staged", into) == manifest.total_bytes
    sender.join()
    assert sent == [manifest.total_bytes]
    verify_item(manifest, tmp_path / "staged" / "data")


def test_a_flipped_byte_is_corrupt(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, data = tree
    payload = bytearray(body(manifest, data))
    payload[len(payload) // 2] ^= 0x40
    feed(pair[0], bytes(payload))
    with pytest.raises(CorruptItem, match=r"big\.bin"):
        receive(manifest, tmp_path / "staged", pair[1])


def test_extra_bytes_break_the_protocol(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, data = tree
    feed(pair[0], body(manifest, data) + b"!")
    with pytest.raises(ChannelProtocolError, match="more bytes"):
        receive(manifest, tmp_path / "staged", pair[1])


def test_a_stream_that_ends_early_is_channel_broken(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, data = tree
    feed(pair[0], body(manifest, data)[:-10])
    with pytest.raises(ChannelBroken, match=f"of {manifest.total_bytes} bytes"):
        receive(manifest, tmp_path / "staged", pair[1])


def test_a_stalled_sender_times_out(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, data = tree
    feed(pair[0], body(manifest, data)[:1000], close=False)
    t0 = time.monotonic()
    with pytest.raises(ChannelBroken, match=r"no bytes for 0\.3s"):
        receive(manifest, tmp_path / "staged", pair[1], idle=0.3)
    assert time.monotonic() - t0 < 3


def test_abort_unblocks_a_waiting_receive(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    manifest, _ = tree
    abort = Abort([pair[1]])
    (tmp_path / "staged").mkdir()
    writer = ItemWriter(manifest, tmp_path / "staged")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            receive_into(writer, pair[1], idle_timeout=30, cancelled=abort)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.2)
    abort.set()
    thread.join(timeout=5)
    writer.close()
    assert not thread.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], ChannelBroken)


def test_a_local_file_shorter_than_its_manifest_is_corrupt(
    tree: tuple[Manifest, Path], pair: tuple[socket.socket, socket.socket]
) -> None:
    manifest, data = tree
    with (data / "state" / "big.bin").open("r+b") as f:
        f.truncate(1000)
    got: list[bytes] = []
    drain = threading.Thread(target=lambda: got.append(pair[1].recv(1 << 20)), daemon=True)
    drain.start()
    with pytest.raises(CorruptItem, match="ends at 1000 bytes"):
        send_item(pair[0], manifest, data, idle_timeout=5)
    drain.join(timeout=5)
    assert got  # what was there went out before the short file was noticed


# --- under mutual TLS ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> certs.Pair:
    return certs.new_ca()


def test_an_item_crosses_a_tls_connection_verified(tmp_path: Path, ca: certs.Pair) -> None:
    server_tls = node_tls(tmp_path / "server", ca).material()
    client_tls = node_tls(tmp_path / "client", ca).material()
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "big").write_bytes(os.urandom(3 * (1 << 20) + 17))
    (src / "small").write_bytes(b"x" * 100)
    manifest = build_manifest(ITEM, src)

    async def scenario(listener: DataListener) -> int:
        ticket = listener.issue()
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(
            None, datachannel.connect, f"127.0.0.1:{listener.port - 1}", listener.port,
            ticket.token, 5.0, client_tls,
        )  # fmt: skip
        server = await listener.connection(ticket, timeout=5)
        assert isinstance(server, TlsStream)
        assert isinstance(client, TlsStream)
        assert server.version() == "TLSv1.3"
        sender = loop.run_in_executor(
            None, lambda: send_item(client, manifest, src, idle_timeout=5.0)
        )
        received = await loop.run_in_executor(None, receive, manifest, tmp_path / "staged", server)
        assert await sender == manifest.total_bytes
        client.close()
        server.close()
        return received

    assert run(scenario, server_tls) == manifest.total_bytes
    verify_item(manifest, tmp_path / "staged" / "data")


@pytest.mark.parametrize("who", ["plaintext", "no certificate", "another CA", "expired"])
def test_a_connection_without_a_valid_certificate_gets_no_ticket(
    tmp_path: Path, ca: certs.Pair, who: str
) -> None:
    server_tls = node_tls(tmp_path / "server", ca).material()

    async def scenario(listener: DataListener) -> bool:
        ticket = listener.issue()
        loop = asyncio.get_running_loop()

        def attack() -> None:
            raw = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
            try:
                if who == "plaintext":
                    with contextlib.suppress(OSError):  # reset: the token is not TLS
                        raw.sendall(ticket.token)  # the token alone, as before TLS
                        raw.recv(1)
                    return
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.load_verify_locations(cadata=ca.cert.decode())
                context.check_hostname = False
                if who == "another CA":
                    other = certs.new_ca()
                    own = node_tls(tmp_path / "other", other, trust=ca)
                    context.load_cert_chain(own.files.cert, own.files.key)
                elif who == "expired":
                    own = node_tls(tmp_path / "expired", ca, expired=True)
                    context.load_cert_chain(own.files.cert, own.files.key)
                with contextlib.suppress(OSError):
                    secure = context.wrap_socket(raw, server_hostname="mtc-replicator")
                    secure.sendall(ticket.token)
                    secure.recv(1)
            finally:
                raw.close()

        await loop.run_in_executor(None, attack)
        try:
            await listener.connection(ticket, timeout=0.5)
        except ChannelBroken:
            return False
        return True

    assert run(scenario, server_tls) is False


def test_a_client_refuses_a_server_of_another_ca(tmp_path: Path, ca: certs.Pair) -> None:
    impostor = certs.new_ca()
    server_tls = node_tls(tmp_path / "server", impostor).material()
    client_tls = node_tls(tmp_path / "client", ca).material()

    async def scenario(listener: DataListener) -> None:
        ticket = listener.issue()
        with pytest.raises(ChannelBroken, match="certificate verify failed"):
            await asyncio.get_running_loop().run_in_executor(
                None, datachannel.connect, f"127.0.0.1:{listener.port - 1}", listener.port,
                ticket.token, 5.0, client_tls,
            )  # fmt: skip

    run(scenario, server_tls)


def test_closing_the_listener_ends_a_tls_handshake_in_flight_and_hears_its_failure(
    tmp_path: Path, ca: certs.Pair
) -> None:
    # A connection that sends nothing holds an accepting thread in its TLS handshake when
    # the listener closes: the close shuts the socket down under the thread and waits for
    # it (the socket is closed only after; before, the thread read on for up to
    # HANDSHAKE_SECONDS, a descriptor number the process may have reused meanwhile), and
    # the thread's failure is heard, not left on a future nobody reads.
    tls = node_tls(tmp_path / "server", ca).material()
    unheard: list[dict[str, object]] = []
    silent: list[socket.socket] = []

    async def main() -> float:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unheard.append(ctx))
        listener = DataListener("127.0.0.1", tls=tls)
        listener.start()
        silent.append(socket.create_connection(("127.0.0.1", listener.port), timeout=5))
        await asyncio.sleep(0.2)  # accepted: its thread waits for a ClientHello
        started = time.monotonic()
        await listener.close()
        took = time.monotonic() - started
        gc.collect()
        await asyncio.sleep(0)
        return took

    try:
        took = asyncio.run(main())
        assert took < datachannel.HANDSHAKE_SECONDS / 2
        assert not unheard, unheard
        deadline = time.monotonic() + 1.0  # an idle pool thread leaves at its next look
        while any(t.name.startswith("mtc-tls-accept") for t in threading.enumerate()):
            assert time.monotonic() < deadline, "an accepting thread outlived the listener"
            time.sleep(0.01)
    finally:
        for sock in silent:  # open until here: its close would end the thread's read
            sock.close()
