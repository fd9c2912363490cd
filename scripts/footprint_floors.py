"""The floor under each stage of ``bench_footprint.py``'s profile, and the arithmetic that
sets each stage beside it.

A stage's floor is the sum of the bare primitives it cannot do without (``STAGE_FLOORS``),
each measured here, in this process, on the bytes of a step the benchmark saved, with the
libraries the product uses: ``os.readv`` of 1 MiB pieces from tmpfs into one buffer
(the least a read costs: no new buffer per piece), ``os.write`` of them
into tmpfs (and into the ``file://`` bucket's directory, then ``fsync``, as the store does),
``google_crc32c``, BLAKE3 on one thread, and TLS 1.3 over loopback TCP with the daemons'
own contexts (``TlsMaterial``: their certificates, their settings), whose sending and
receiving sides are timed apart. Every primitive's CPU is its thread's own
(``time.thread_time``, user and system), so it is the primitive's alone while the other
side runs beside it. The TLS sides work through memory BIOs a megabyte at a time: the
least CPU per byte Python's ``ssl`` gives (one 16 KiB record per socket call costs more).

The measurement does I/O; ``stage_rows``, ``cycle_row`` and ``table`` are pure.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3
import google_crc32c

from mtc_replicator.transport.tls import TlsMaterial

GiB = 1 << 30
PIECE = 1 << 20
"""Bytes per read, write, hash update and TLS write: the product's pieces are 1-4 MiB."""

PRIMITIVES = ("read", "write", "write_backup", "crc32c", "blake3", "tls_send", "tls_receive")
PRIMITIVE_NAMES = {
    "read": "read from tmpfs",
    "write": "write into tmpfs",
    "write_backup": "write into the bucket's directory, fsync",
    "crc32c": "crc32c",
    "blake3": "BLAKE3, one thread",
    "tls_send": "TLS 1.3 send (loopback)",
    "tls_receive": "TLS 1.3 receive (loopback)",
}

STAGE_FLOORS: dict[str, tuple[str, ...]] = {
    # The step is renamed into the store and hashed in one read: crc32c and BLAKE3.
    "ingest": ("read", "crc32c", "blake3"),
    # The item read from the store and sent over the TLS data channel.
    "push_send": ("read", "tls_send"),
    # Received over TLS, written to staging, its BLAKE3 checked (no crc32c: one hash per
    # byte where the manifest has a digest, local.digests).
    "push_receive": ("tls_receive", "write", "blake3"),
    # A file:// store copies the file and checks the crc32c it is handed.
    "upload": ("read", "crc32c", "write_backup"),
    "restore_receive": ("tls_receive", "write", "blake3"),
    "restore_serve": ("read", "tls_send"),
}
STAGE_NAMES = {
    "ingest": "ingest and both digests",
    "push_send": "push send (TLS)",
    "push_receive": "push receive and verify (TLS)",
    "upload": "upload to file://",
    "restore_receive": "restore receive and verify (TLS)",
    "restore_serve": "restore serve (TLS)",
}
CYCLE = ("ingest", "push_send", "push_receive", "upload")
"""A node's share of every step: its own item ingested, pushed and uploaded, and its
pusher's copy received (the same size, in a job of equal ranks)."""


# --- the arithmetic (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the stage table: CPU seconds per GiB, its floor's, and their ratio."""

    stage: str
    cpu: float | None
    """Measured; None when the run did not measure it."""
    floor: float
    formula: tuple[str, ...]

    @property
    def ratio(self) -> float | None:
        return None if self.cpu is None or self.floor <= 0 else self.cpu / self.floor


def floor_of(primitives: Sequence[str], measured: Mapping[str, float]) -> float:
    """The sum of ``primitives``' CPU seconds per GiB."""
    missing = [p for p in primitives if p not in measured]
    if missing:
        raise KeyError(f"primitives not measured: {', '.join(missing)}")
    return sum(measured[p] for p in primitives)


def stage_rows(stages: Mapping[str, float | None], measured: Mapping[str, float]) -> list[Row]:
    """Each stage of ``STAGE_FLOORS`` (in its order) beside its floor."""
    return [
        Row(name, stages.get(name), floor_of(formula, measured), formula)
        for name, formula in STAGE_FLOORS.items()
    ]


def cycle_row(cpu: float, measured: Mapping[str, float], *, backup: bool) -> Row:
    """The whole node's cycle beside the sum of its stages' floors (``CYCLE``; without a
    backup, no upload)."""
    stages = [s for s in CYCLE if backup or s != "upload"]
    return Row(
        "cycle", cpu, sum(floor_of(STAGE_FLOORS[s], measured) for s in stages), tuple(stages)
    )


def stages_sum(stages: Mapping[str, float | None], *, backup: bool) -> float | None:
    """The cycle's stages measured one by one, added up (None if one is missing)."""
    values = [stages.get(s) for s in CYCLE if backup or s != "upload"]
    return None if any(v is None for v in values) else sum(v for v in values if v is not None)


def _number(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def table(rows: Sequence[Row], cycle: Row | None = None, cycle_stages: float | None = None) -> str:
    """A Markdown table: stage, CPU s/GiB, floor s/GiB, ratio, what the floor is."""
    lines = [
        "| stage | CPU s/GiB | floor s/GiB | ratio | floor |",
        "|---|---:|---:|---:|---|",
    ]
    for row in rows:
        formula = " + ".join(row.formula)
        lines.append(
            f"| {STAGE_NAMES.get(row.stage, row.stage)} | {_number(row.cpu)} | "
            f"{row.floor:.2f} | {_number(row.ratio, 'x')} | {formula} |"
        )
    if cycle is not None:
        lines.append(
            f"| the node's cycle | {_number(cycle.cpu)} | {cycle.floor:.2f} | "
            f"{_number(cycle.ratio, 'x')} | the floors of {' + '.join(cycle.formula)} |"
        )
        lines.append(f"| (its stages measured apart, added) | {_number(cycle_stages)} | | | |")
    return "\n".join(lines)


# --- the measurement (I/O) -----------------------------------------------------------------------


class _BioTls:
    """TLS over a blocking socket through memory BIOs (as the data channel works): OpenSSL
    works on memory and the socket moves a megabyte per call. The bench's own, so a
    change to the product's ``TlsStream`` cannot move the floor it is judged by."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server: bool, name: str):
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        hostname = None if server else name
        self.tls = context.wrap_bio(
            self.incoming, self.outgoing, server_side=server, server_hostname=hostname
        )
        self.raw = bytearray(PIECE)

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data:
            self.sock.sendall(data)

    def _fill(self) -> None:
        n = self.sock.recv_into(self.raw)
        if n == 0:
            raise ConnectionError("the TLS floor's connection closed early")
        self.incoming.write(memoryview(self.raw)[:n])

    def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
            else:
                self._flush()
                return

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()

    def receive(self, buffer: memoryview) -> int:
        while True:
            try:
                return int(self.tls.read(len(buffer), buffer))
            except ssl.SSLWantReadError:
                self._fill()


def _tls_pair(server: TlsMaterial, client: TlsMaterial) -> tuple[_BioTls, _BioTls]:
    """Both ends of a loopback TLS 1.3 connection, handshaken with the daemons' contexts."""
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        out = socket.create_connection(listener.getsockname())
        into, _ = listener.accept()
    sender = _BioTls(out, client.client_context(), False, client.server_name)
    receiver = _BioTls(into, server.server_context(), True, server.server_name)
    shaken = threading.Thread(target=receiver.handshake)
    shaken.start()
    sender.handshake()
    shaken.join()
    return sender, receiver


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _receive(tls: _BioTls, nbytes: int, spent: dict[str, float]) -> None:
    buffer = memoryview(bytearray(PIECE))
    start, got = time.thread_time(), 0
    while got < nbytes:
        got += tls.receive(buffer)
    spent["tls_receive"] = time.thread_time() - start


def measure_round(
    source: Path, scratch: Path, backup_dir: Path, tls: tuple[TlsMaterial, TlsMaterial]
) -> dict[str, float]:
    """Every primitive once over ``source``'s bytes (on tmpfs), a piece at a time: CPU
    seconds per GiB of each. ``scratch``: a tmpfs directory to write into (the copy is
    removed after); ``backup_dir``: the bucket's directory (the same); ``tls``: the
    receiving (server) and sending (client) sides' material."""
    nbytes = source.stat().st_size
    sender, receiver = _tls_pair(*tls)
    spent = dict.fromkeys(PRIMITIVES, 0.0)
    received: dict[str, float] = {}
    beside = threading.Thread(target=_receive, args=(receiver, nbytes, received))
    beside.start()
    clock: Callable[[], float] = time.thread_time
    crc, digest = 0, blake3.blake3()
    copy = scratch / "floor.copy"
    kept = backup_dir / "floor.copy"
    src = os.open(source, os.O_RDONLY)
    dst = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    bak = os.open(kept, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    buffer = memoryview(bytearray(PIECE))
    try:
        while True:
            t0 = clock()
            n = os.readv(src, [buffer])
            spent["read"] += clock() - t0
            if not n:
                break
            piece = bytes(buffer[:n])  # not timed: google_crc32c takes bytes only
            t1 = clock()
            crc = google_crc32c.extend(crc, piece)
            t2 = clock()
            digest.update(piece)
            t3 = clock()
            _write_all(dst, piece)
            t4 = clock()
            _write_all(bak, piece)
            t5 = clock()
            sender.send(piece)
            t6 = clock()
            spent["crc32c"] += t2 - t1
            spent["blake3"] += t3 - t2
            spent["write"] += t4 - t3
            spent["write_backup"] += t5 - t4
            spent["tls_send"] += t6 - t5
        t0 = clock()
        os.fsync(bak)
        spent["write_backup"] += clock() - t0
        digest.hexdigest()
    finally:
        for fd in (src, dst, bak):
            os.close(fd)
        # A half-close: the receiver has every byte, or (after an error here) an end.
        sender.sock.shutdown(socket.SHUT_WR)
        beside.join()
        for end in (sender, receiver):
            end.sock.close()
        # The bucket's copy goes too, as the benchmark prunes the bucket (prune_backups).
        for path in (copy, kept):
            path.unlink(missing_ok=True)
    if "tls_receive" not in received:
        raise RuntimeError("the TLS floor's receiving side failed (its error is above)")
    spent["tls_receive"] = received["tls_receive"]
    return {name: seconds * GiB / nbytes for name, seconds in spent.items()}


def least(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each primitive's least CPU over ``rounds``: its floor. The box's other work only
    ever adds to what a primitive costs (cache, memory bandwidth, another core's
    interrupts), so the least is the most repeatable figure of the primitive itself."""
    if not rounds:
        raise ValueError("no rounds of the primitives were measured")
    return {p: min(r[p] for r in rounds) for p in PRIMITIVES}
