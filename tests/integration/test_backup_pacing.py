"""Backup uploads obey the node's rate limit on every backend, and restores ignore it.

``BackupStore.upload_item`` with a ``Pacer`` at a limit, against ``file://``, S3 on moto's
server and GCS on the emulator (one request from memory or streamed from the file, and a
multipart upload or a resumable one in chunks). The
cloud uploads pass a byte-counting TCP relay, so the pace is measured on the wire: the
relayed bytes take within 10% of what the limit allows (less the one-second burst), and no
second carries more than the burst plus a second's worth, which an SDK that read a body
whole and then sent it at once would break. The bytes stored are intact, and a download of
the same object with the same ``Pacer`` is not throttled.

Sizes: 128 MiB on ``file://`` and in the multipart upload (4 parts), 160 MiB in the chunked
one (5 chunks, above the single-request limit); 32 MiB in one request. moto and the
emulator take 512 MiB at 25-120 MiB/s here (measured unpaced; the number falls with the
other work on the 2 cores), so their limit is 16 MiB/s, well under it, and ``file://``'s
24 MiB/s is far under what a copy does even on a loaded CI box (it downloaded at 70 MiB/s
there), so a download that ignores the limit beats a paced one by a wide margin: each
upload takes 5-10 s.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.pacing import PaceRules, Traffic
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.pacer import Pacer
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.gcs import GcsObjectStore
from mtc_replicator.storage.objectstore import FileObjectStore, ObjectStore
from mtc_replicator.storage.s3 import S3ObjectStore
from tests.integration.helpers import ram_disk
from tests.storage_servers import HOST, Bucket

MiB = 1 << 20
PART = 32 * MiB
SOCKET_BUFFERS = 16 * MiB
"""What loopback sockets between the client, the relay and the server can hold at once."""
JOB = "job"
ITEM = ItemId(JOB, 7, 0, 0)


@dataclass(frozen=True)
class Case:
    backend: str
    size: int
    rate: float
    part_size: int


CASES = {
    "file": Case("file", 128 * MiB, 24 * MiB, PART),
    "s3-single": Case("s3", 32 * MiB, 6 * MiB, 64 * MiB),
    "s3-multipart": Case("s3", 128 * MiB, 16 * MiB, PART),
    "gcs-single": Case("gcs", 32 * MiB, 6 * MiB, 64 * MiB),
    # Above part_size, below single_limit: one request streamed from the file.
    "gcs-streamed": Case("gcs", 48 * MiB, 6 * MiB, 16 * MiB),
    # Above single_limit (150 MiB): one resumable upload, its chunks sent one after another.
    "gcs-chunked": Case("gcs", 160 * MiB, 16 * MiB, PART),
}


class Relay:
    """A TCP relay in front of a server that records when the client's bytes pass: what
    the server receives, second by second (the relay reads as fast as the server does)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server((HOST, 0))
        self._lock = threading.Lock()
        self.passed: list[tuple[float, int]] = []
        """(monotonic time, bytes) of each piece the client sent."""
        self._threads: list[threading.Thread] = []
        self._open: list[socket.socket] = []
        self._stopping = False

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self._listener.getsockname()[1]}"

    def start(self) -> Relay:
        self._spawn(self._accept)
        return self

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)  # to see ``stop``: closing does not wake accept()
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self._upstream)
            self._open += [client, server]
            self._spawn(self._pump, client, server, True)
            self._spawn(self._pump, server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if record:
                    with self._lock:
                        self.passed.append((time.monotonic(), len(data)))
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        self._stopping = True
        self._listener.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def span_until(self, nbytes: int) -> float:
        """Seconds from the first byte relayed until ``nbytes`` had passed."""
        with self._lock:
            passed = list(self.passed)
        total = 0
        for at, n in passed:
            total += n
            if total >= nbytes:
                return at - passed[0][0]
        raise AssertionError(f"only {total} of {nbytes} bytes passed the relay")

    def busiest_second(self) -> int:
        """The most bytes relayed within any one second."""
        with self._lock:
            passed = list(self.passed)
        most = window = first = 0
        for at, n in passed:
            window += n
            while passed[first][0] < at - 1.0:
                window -= passed[first][1]
                first += 1
            most = max(most, window)
        return most


@pytest.fixture(scope="module")
def ram(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A RAM disk for the source files and the ``file://`` store: no disk in the timing."""
    with ram_disk(tmp_path_factory.mktemp("pacing") / "ram", "1700m") as path:
        yield path


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[str(request.param)]


@pytest.fixture
def relay(
    case: Case, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Relay | None]:
    """The relay every request of a cloud backend passes (None for ``file://``)."""
    if case.backend == "file":
        yield None
        return
    bucket: Bucket = request.getfixturevalue(f"{case.backend}_bucket")
    relay = Relay(bucket.endpoint).start()
    variable = "AWS_ENDPOINT_URL_S3" if case.backend == "s3" else "STORAGE_EMULATOR_HOST"
    monkeypatch.setenv(variable, relay.url)
    try:
        yield relay
    finally:
        relay.stop()


def open_store(case: Case, request: pytest.FixtureRequest, ram: Path) -> ObjectStore:
    if case.backend == "file":
        return FileObjectStore(ram / "bucket")
    bucket: Bucket = request.getfixturevalue(f"{case.backend}_bucket")
    if case.backend == "s3":
        return S3ObjectStore.from_url(bucket.url, part_size=case.part_size)
    return GcsObjectStore.from_url(bucket.url, part_size=case.part_size)


def test_uploads_keep_to_the_limit_and_restores_ignore_it(
    case: Case, relay: Relay | None, request: pytest.FixtureRequest, ram: Path
) -> None:
    src = ram / "item"
    src.write_bytes(os.urandom(case.size))
    manifest = build_manifest(ITEM, src)
    rules = PaceRules(rate=case.rate)
    pacer = Pacer(rules)
    backup = BackupStore(open_store(case, request, ram), pacer=pacer)
    burst = case.rate * rules.burst_seconds
    least, most = 0.9 * (case.size - burst) / case.rate, 1.1 * case.size / case.rate
    try:
        t0 = time.monotonic()
        backup.upload_item(manifest, src)
        took = time.monotonic() - t0
        if relay is None:
            assert least <= took <= most, f"{took:.2f}s, not in [{least:.2f}, {most:.2f}]"
        else:
            # On the wire: the server's own work after the last byte (moto joins the parts
            # for seconds) is no part of the pace.
            span = relay.span_until(case.size)
            assert least <= span <= most, f"{span:.2f}s, not in [{least:.2f}, {most:.2f}]"
            assert took >= least
            # The pacer lets at most a burst plus a second's worth go in any second. On the
            # wire, what the kernel's socket buffers (client to relay, relay to server: a few
            # MiB each on loopback) held while the server stalled (the emulator does, when it
            # appends a chunk to a large upload) passes at once when it reads again.
            busiest = relay.busiest_second()
            allowed = 1.1 * (burst + case.rate) + SOCKET_BUFFERS
            assert busiest <= allowed, f"{busiest / MiB:.1f} MiB in 1 s"
        sent = pacer.sent[Traffic.BACKUP]
        assert case.size <= sent <= case.size + rules.slice + 64 * 1024, "every byte booked"

        record = backup.try_commit(JOB, ITEM.step, [ITEM.key])
        assert record is not None
        staged = ram / "staged"
        staged.mkdir()
        t0 = time.monotonic()
        assert backup.fetch_item(record, ITEM, staged) == manifest  # verifies every byte
        fetched = time.monotonic() - t0
        # The upload left the bucket empty: a throttled download would take ``least``.
        assert fetched < least, f"download throttled: {fetched:.2f}s"
        assert (staged / "data").read_bytes() == src.read_bytes()
        assert pacer.sent[Traffic.BACKUP] == sent, "a download booked bytes"
        assert pacer.waited[Traffic.RESTORE] == 0
    finally:
        for info in list(backup.objects.list(f"{JOB}/")):  # the servers are shared
            backup.objects.delete(info.key)
        for leftover in (src, ram / "staged" / "data"):
            leftover.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (ram / "staged").rmdir()
