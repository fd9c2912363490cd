"""Measure the peer data plane against a raw-socket copy of the same bytes, in one run.

Two real daemons on tmpfs (``/dev/shm`` subdirectories): daemon A holds a committed item,
daemon B serves the job as another rank. Each round (interleaved, so every transfer meets
the same page-cache conditions):

- raw: a tiny sender/receiver pair of processes copies A's item files over one loopback TCP
  socket (``sendfile`` out, ``recv_into`` + ``write`` in) into a fresh tmpfs directory;
- push: ``PeerClient.push_item`` (the code a daemon runs after ingest; here in this
  process, with the daemon's malloc tuning and uvloop) sends the item to daemon B, which
  verifies every file's crc32c and commits it: once over B's data channel (what daemons
  do by default) and once in gRPC chunks (``--data-port off``). B is restarted with an
  empty store before each, so its destination starts from the same state as the raw copy's;
- pull: ``PeerClient.pull_item`` restores the item from daemon A into a local store here,
  over A's data channel and in gRPC chunks;
- with mutual TLS (``--tls-cert`` etc., a throwaway CA made for the run): the same push into
  a B started with TLS, and the same pull from a daemon A' with TLS that holds its own copy
  of the item, both over the data channel (TLS 1.3 there, so no ``sendfile``).

Prints seconds and MB/s (median and best of the rounds), the push/raw ratio, daemon B's CPU
seconds per GiB received and its peak RSS. Numbers are only comparable within one run: writes into
already-allocated tmpfs pages measured 3-5x faster than the first touch of fresh pages
(~1.2 GB/s), so page state, not the code, can set a run's speed.

    .venv/bin/python scripts/bench_peer.py --size-mib 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mtc_replicator.core.grant import Grant, grant_json
from mtc_replicator.core.manifest import ItemId, Manifest
from mtc_replicator.core.storedir import default_store_dir
from mtc_replicator.local.grants_file import DIR_NAME as GRANTS_DIR
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.startup import tune_malloc
from mtc_replicator.tools import certs
from mtc_replicator.transport.attesting import manifest_trust
from mtc_replicator.transport.datachannel import RECV_BYTES
from mtc_replicator.transport.peer_client import PeerClient
from mtc_replicator.transport.tls import TlsFiles, TlsMaterial, TlsStream

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: tests/ beside mtc_replicator

from tests import proc  # noqa: E402

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

JOB = "bench"
_HEADER = struct.Struct("!HQ")
_READY = re.compile(rb"daemon started:.* listen=(\S+) advertise=")


# --- the raw-socket baseline (run as child processes) -----------------------------------------


def _fill(conn: socket.socket | TlsStream, view: memoryview) -> int:
    """Read until ``view`` is full or the stream ends; the bytes read. Whole slices, as the
    data channel's receiver reads them: writing whatever one read returned (a TLS record,
    a partial segment) costs tmpfs more CPU a byte (docs/performance.md, "Receive slices")."""
    if isinstance(conn, socket.socket):
        return conn.recv_into(view, len(view), socket.MSG_WAITALL)
    got = 0
    while got < len(view) and (n := conn.recv_into(view[got:])):
        got += n
    return got


def _read_exactly(conn: socket.socket | TlsStream, n: int) -> bytes:
    buf = bytearray(n)
    if _fill(conn, memoryview(buf)) != n:
        raise EOFError("sender stopped early")
    return bytes(buf)


def _tls_stream(conn: socket.socket, tls_dir: Path, *, server: bool) -> TlsStream:
    """The data channel's own TLS (``TlsStream``, the daemons' certificates), handshaken."""
    material = TlsMaterial(certs.node_files(tls_dir))
    context = material.server_context() if server else material.client_context()
    stream = TlsStream(
        conn,
        context,
        server_side=server,
        server_hostname=None if server else certs.DEFAULT_SERVER_NAME,
    )
    stream.handshake()
    return stream


def raw_receive(dest: Path, warm: int, tls_dir: Path | None = None) -> None:
    """Accept one connection; write each ``(name, size, bytes)`` record below ``dest``
    (``tls_dir``: the connection is TLS, with the certificates there). Once connected,
    ``warm_pages(warm)`` and a go-ahead byte: the sender starts only then, and the clock."""
    dest.mkdir(parents=True)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
    tls = _tls_stream(conn, tls_dir, server=True) if tls_dir is not None else None
    stream = tls or conn
    warm_pages(dest.parent, warm)
    t0 = time.perf_counter()
    cpu0 = os.times()
    stream.sendall(b"g")
    view = memoryview(bytearray(RECV_BYTES))
    total = 0
    with conn:
        while True:
            name_len, size = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
            if name_len == 0:
                break
            path = dest / _read_exactly(stream, name_len).decode()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            left = size
            while left:
                n = _fill(stream, view[: min(left, len(view))])
                if not n:
                    raise EOFError("sender stopped early")
                os.write(fd, view[:n])
                left -= n
            os.close(fd)
            total += size
        (tls or conn).sendall(b"k")
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    cores = sorted(os.sched_getaffinity(0))
    print(
        json.dumps(
            {"seconds": time.perf_counter() - t0, "bytes": total, "cpu": cpu, "cores": cores}
        )
    )


def raw_send(port: int, src: Path, tls_dir: Path | None = None) -> None:
    """Send every file below ``src``: ``sendfile`` in plaintext; with ``tls_dir``, a MiB
    read at a time through ``TlsStream`` (what the data channel does with TLS on)."""
    files = sorted(p for p in src.rglob("*") if p.is_file())
    cpu0 = os.times()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        tls = _tls_stream(conn, tls_dir, server=False) if tls_dir is not None else None
        out = tls or conn
        _read_exactly(out, 1)  # the receiver's go-ahead: its pages are warm
        buf = bytearray(1 << 20)
        for path in files:
            name = str(path.relative_to(src)).encode()
            out.sendall(_HEADER.pack(len(name), path.stat().st_size) + name)
            with path.open("rb") as f:
                if tls is None:
                    conn.sendfile(f)
                    continue
                while n := f.readinto(buf):
                    tls.sendall(memoryview(buf)[:n])
        out.sendall(_HEADER.pack(0, 0))
        if tls is not None:
            tls.recv_into(memoryview(bytearray(1)))
        else:
            conn.recv(1)
    cpu1 = os.times()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    print(json.dumps({"cpu": cpu, "cores": sorted(os.sched_getaffinity(0))}))


def raw_copy(
    src: Path,
    dest: Path,
    tls_dir: Path | None = None,
    *,
    warm: int = 0,
    pins: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> dict[str, Any]:
    """Copy ``src`` to ``dest`` between two processes over loopback TCP; with ``tls_dir``
    (a node's certificate files), over TLS. The receiver's seconds, CPU seconds (``cpu``)
    and cores it may run on (``cores``), and the sender's (``sender_cpu``,
    ``sender_cores``), each CPU figure from its connection to its end.

    ``warm``: bytes ``warm_pages`` writes and frees on ``dest``'s filesystem once both
    processes are up and connected, right before the first byte moves (not before the
    processes start, a second of imports earlier). Rounds still meet memory the host took
    back (docs/performance.md, "Fresh memory on this VM"): compare bests too.

    ``pins``: the cores of the sender and of the receiver (``taskset``), two nodes' cores
    played on one machine."""
    me = [sys.executable, __file__]
    tls = [str(tls_dir)] if tls_dir is not None else []
    send_on, recv_on = (taskset(pins[0]), taskset(pins[1])) if pins else ((), ())
    recv = subprocess.Popen(
        [*recv_on, *me, "_raw-recv", str(dest), str(warm), *tls],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert recv.stdout is not None
    port = recv.stdout.readline().strip()
    sent = subprocess.run(
        [*send_on, *me, "_raw-send", port, str(src), *tls],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = recv.communicate(timeout=600)
    if recv.returncode:
        raise RuntimeError(f"raw receiver failed: {recv.returncode}")
    result: dict[str, Any] = json.loads(out)
    sender = json.loads(sent.stdout)
    result["sender_cpu"], result["sender_cores"] = sender["cpu"], sender["cores"]
    return result


def taskset(cores: tuple[int, ...]) -> tuple[str, ...]:
    """The command prefix that runs a process (and every thread it makes) on ``cores``."""
    return ("taskset", "-c", ",".join(map(str, cores)))


# --- daemons --------------------------------------------------------------------------------------


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def cpu_seconds(self) -> float:
        return proc.cpu_seconds(self.proc.pid)

    def memory_mib(self, key: str) -> float:
        return proc.memory_mib(self.proc.pid, key)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def start_daemon(ckpt: Path, extra: tuple[str, ...] = ()) -> Daemon:
    ckpt.mkdir(parents=True, exist_ok=True)  # as the CSI plugin does: the daemon never does
    log = ckpt.parent / f"{ckpt.name}.log"
    args = [sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir", str(ckpt)]
    args += ["--listen", "127.0.0.1:0", "--rescan-seconds", "0.5", *extra]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (ready := _READY.search(log.read_bytes())) is not None:
            return Daemon(proc, ready.group(1).decode(), log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"daemon on {ckpt} did not start:\n{log.read_text()}")


def receiver_flags(ckpt: Path) -> tuple[str, ...]:
    """B takes pushes as rank 1 of a two-node job, whose rank 0 never comes: it waits in
    its restore round, on a registry of its own, for the whole run (only the data plane is
    measured)."""
    registry = ckpt.parent / f"{ckpt.name}-registry"
    registry.mkdir(exist_ok=True)
    return ("--registry", registry.as_uri(), "--report-after-seconds", "3600")


def take_job(ckpt: Path) -> None:
    """Hand the daemon a ``replicator.yaml`` so it accepts pushes of the bench job's rank 0:
    rank 1 of two nodes, to which rank 0 replicates (a node takes no push of its own rank,
    and a one-node job none at all)."""
    text = f"job-name: {JOB}\nframework: orbax\nnode-rank: 1\nnodes: 2\npeers-per-node: 1\n"
    tmp = ckpt / "replicator.yaml.tmp"
    tmp.write_text(text)
    os.rename(tmp, ckpt / "replicator.yaml")
    deadline = time.monotonic() + 30
    while (ckpt / "replicator.yaml").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ckpt}: replicator.yaml was not accepted")
        time.sleep(0.05)


def grant_ranks(ckpt: Path, holders: tuple[str, ...]) -> None:
    """Leave B a rank grant (what the controller's ``AssignRank`` keeps in the store): with
    TLS, a node takes a rank's pushes only from the node known to hold it, and B's
    coordinator never answers; the grant names the bench's certificate as rank 0's node."""
    grants = Path(default_store_dir(PurePosixPath(ckpt))) / GRANTS_DIR
    grants.mkdir(mode=0o700, parents=True, exist_ok=True)
    (grants / f"{JOB}.json").write_bytes(grant_json(Grant(JOB, "bench", holders)))


def make_item(ckpt: Path, size: int, files: int) -> Manifest:
    """A committed item of ``size`` random bytes in A's store, written before A starts."""
    src = ckpt / "1"
    (src / "state").mkdir(parents=True)
    block = os.urandom(4 << 20)
    per_file = size // files
    for i in range(files):
        with open(src / "state" / f"shard-{i}.bin", "wb") as f:
            left = per_file
            while left > 0:
                # A counter in every block: no two blocks of the item are equal.
                f.write(left.to_bytes(8, "little") + block[8 : min(left, len(block))])
                left -= len(block)
    store = LocalStore(ckpt)
    store.open()
    item = ItemId(JOB, 1, 0, 0)
    store.take(src, item)
    manifest = store.commit_ingested(item)
    store.close()
    return manifest


def make_tls(root: Path, ca: certs.Pair, name: str) -> TlsFiles:
    """A node certificate from the run's throwaway CA."""
    directory = root / "tls" / name
    certs.write_node_files(directory, ca, certs.issue(ca, node=name))
    return certs.node_files(directory)


# --- the run ----------------------------------------------------------------------------------


def warm_pages(root: Path, size: int) -> None:
    """Write and delete ``size`` bytes on the tmpfs, so the transfer that follows gets pages
    the kernel just freed. On this VM, pages never touched (or handed back to the
    hypervisor) cost up to 10x more to fill, and that noise would swamp the comparison."""
    block = bytes(4 << 20)
    scratch = root / "warm"
    with scratch.open("wb") as f:
        for _ in range(0, size, len(block)):
            f.write(block)
    scratch.unlink()


@dataclass
class Round:
    raw: float
    raw_cpu: float
    push: float
    push_cpu: float
    push_chunks: float
    push_chunks_cpu: float
    pull: float
    pull_chunks: float
    b_rss_before: float
    b_peak_rss: float
    push_tls: float
    push_tls_cpu: float
    pull_tls: float


async def run_rounds(  # noqa: PLR0917 (one call site, every argument named by its role)
    root: Path,
    a: Daemon,
    a_tls: Daemon,
    tls: TlsFiles,
    b_tls_args: tuple[str, ...],
    manifest: Manifest,
    rounds: int,
) -> list[Round]:
    size = manifest.total_bytes + manifest.total_bytes // 8
    attested = manifest_trust(TlsMaterial(tls), "client").attest(manifest, "", time.time())
    data = Path(default_store_dir(PurePosixPath(root / "a"))) / "items" / JOB / "1" / "0-0" / "data"
    local = LocalStore(root / "c")
    local.open()
    results = []
    async with (
        PeerClient() as client,
        PeerClient(data_channel=False) as chunked,
        PeerClient(tls=TlsMaterial(tls)) as secure,
    ):
        for c, holder in ((client, a), (chunked, a), (secure, a_tls)):
            await c.list_items(holder.address)  # connect before timing anything

        async def push(c: PeerClient) -> tuple[float, float, float]:
            """Seconds, B's CPU seconds and B's peak RSS of one push into a fresh B."""
            b = start_daemon(
                root / "b", (*receiver_flags(root / "b"), *(b_tls_args if c is secure else ()))
            )
            try:
                await c.list_items(b.address)
                warm_pages(root, size)
                cpu0, t0 = b.cpu_seconds(), time.perf_counter()
                # A daemon with TLS takes an item its producer attested (core.attestation).
                item = attested if c is secure else manifest
                assert not await c.push_item(b.address, item, data)
                seconds, cpu = time.perf_counter() - t0, b.cpu_seconds() - cpu0
                peak = b.memory_mib("VmHWM")
            finally:
                b.stop()
            shutil.rmtree(Path(default_store_dir(PurePosixPath(root / "b"))) / "items" / JOB)
            return seconds, cpu, peak

        async def pull(c: PeerClient) -> float:
            warm_pages(root, size)
            holder = a_tls if c is secure else a
            t0 = time.perf_counter()
            await c.pull_item(
                holder.address,
                manifest.item,
                local,
                manifest.digest,
                total_bytes=manifest.total_bytes,
            )
            seconds = time.perf_counter() - t0
            local.delete(manifest.item)
            return seconds

        def raw(r: int) -> dict[str, Any]:
            dest = root / f"raw-{r}"
            result = raw_copy(data, dest, warm=size)
            shutil.rmtree(dest)
            return result

        b = start_daemon(root / "b")
        rss_before = b.memory_mib("VmRSS")
        b.stop()
        for r in range(rounds):
            # Alternate the order: whoever goes first may meet colder tmpfs pages.
            if r % 2 == 0:
                raw_result = raw(r)
                push_s, push_cpu, peak = await push(client)
                tls_s, tls_cpu, _ = await push(secure)
                chunks_s, chunks_cpu, _ = await push(chunked)
                pull_s, pull_chunks_s = await pull(client), await pull(chunked)
                pull_tls_s = await pull(secure)
            else:
                pull_tls_s = await pull(secure)
                pull_chunks_s, pull_s = await pull(chunked), await pull(client)
                chunks_s, chunks_cpu, _ = await push(chunked)
                tls_s, tls_cpu, _ = await push(secure)
                push_s, push_cpu, peak = await push(client)
                raw_result = raw(r)
            results.append(
                Round(
                    raw_result["seconds"],
                    raw_result["cpu"],
                    push_s,
                    push_cpu,
                    chunks_s,
                    chunks_cpu,
                    pull_s,
                    pull_chunks_s,
                    rss_before,
                    peak,
                    tls_s,
                    tls_cpu,
                    pull_tls_s,
                )
            )
            print(
                f"round {r + 1}: raw {raw_result['seconds']:.3f}s  push {push_s:.3f}s "
                f"(chunks {chunks_s:.3f}s, TLS {tls_s:.3f}s)  pull {pull_s:.3f}s "
                f"(chunks {pull_chunks_s:.3f}s, TLS {pull_tls_s:.3f}s)",
                flush=True,
            )
    local.close()
    return results


def report(size: int, files: int, results: list[Round]) -> None:
    gib = size / (1 << 30)

    def stats(key: str) -> tuple[float, float]:
        values = [getattr(r, key) for r in results]
        return statistics.median(values), min(values)

    raw, push = stats("raw"), stats("push")
    print(f"\nitem: {size >> 20} MiB in {files} files, tmpfs -> tmpfs over loopback")
    print(f"{len(results)} interleaved rounds; median (and best) of each")
    print(f"{'transfer':56} {'seconds':>15} {'MB/s':>13} {'vs raw':>6}")
    rows = [
        ("raw socket copy (sendfile -> recv_into + write)", raw),
        ("push to daemon B, data channel (crc32c, commit)", push),
        ("push to daemon B, gRPC chunks (crc32c, commit)", stats("push_chunks")),
        ("pull from daemon A, data channel (restore from peer)", stats("pull")),
        ("pull from daemon A, gRPC chunks (restore from peer)", stats("pull_chunks")),
        ("push to daemon B, data channel, mutual TLS 1.3", stats("push_tls")),
        ("pull from daemon A', data channel, mutual TLS 1.3", stats("pull_tls")),
    ]
    for name, (median, best) in rows:
        print(
            f"{name:56} {median:6.3f} ({best:6.3f}) "
            f"{size / median / 1e6:5.0f} ({size / best / 1e6:5.0f}) {raw[0] / median:5.2f}x"
        )
    print(
        f"push / raw throughput ratio: {raw[0] / push[0]:.2f} median, "
        f"{raw[1] / push[1]:.2f} best (target >= 0.8)"
    )
    push_tls, pull_tls = stats("push_tls"), stats("pull_tls")
    print(
        f"with mutual TLS: push {raw[0] / push_tls[0]:.2f}x, pull {raw[0] / pull_tls[0]:.2f}x "
        "of the raw copy, medians (target >= 0.7)"
    )
    cpu = {
        k: statistics.median(getattr(r, k) for r in results) / gib
        for k in Round.__annotations__
        if k.endswith("cpu")
    }
    print(
        f"CPU seconds per GiB received: daemon B {cpu['push_cpu']:.2f} (data channel), "
        f"{cpu['push_tls_cpu']:.2f} (with TLS), {cpu['push_chunks_cpu']:.2f} (gRPC chunks); "
        f"raw receiver {cpu['raw_cpu']:.2f}"
    )
    peak = max(r.b_peak_rss for r in results)
    before = statistics.median(r.b_rss_before for r in results)
    print(
        f"daemon B peak RSS (VmHWM): {peak:.0f} MiB at most; {before:.0f} MiB at start "
        f"(item {size >> 20} MiB)"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_raw-recv":
        tls_dir = Path(sys.argv[4]) if len(sys.argv) > 4 else None
        raw_receive(Path(sys.argv[2]), int(sys.argv[3]), tls_dir)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_raw-send":
        tls_dir = Path(sys.argv[4]) if len(sys.argv) > 4 else None
        raw_send(int(sys.argv[2]), Path(sys.argv[3]), tls_dir)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    size = a.size_mib << 20
    tune_malloc()  # what the sending daemon does at start
    root = Path(tempfile.mkdtemp(prefix="mtc-bench-peer-", dir="/dev/shm"))
    daemons: list[Daemon] = []
    try:
        for name in ("a", "b", "c"):
            (root / name).mkdir()
        manifest = make_item(root / "a", size, a.files)
        shutil.copytree(root / "a", root / "a-tls", symlinks=True)  # A' holds the same item
        shutil.copytree(
            default_store_dir(PurePosixPath(root / "a")),
            default_store_dir(PurePosixPath(root / "a-tls")),
            symlinks=True,
        )
        ca = certs.new_ca()
        mine, b_tls = make_tls(root, ca, "client"), certs.daemon_flags(make_tls(root, ca, "b"))
        daemons.append(start_daemon(root / "a"))
        daemons.append(
            start_daemon(root / "a-tls", certs.daemon_flags(make_tls(root, ca, "a-tls")))
        )
        b = start_daemon(root / "b", receiver_flags(root / "b"))
        take_job(root / "b")  # kept in B's store: every restart resumes the job
        grant_ranks(root / "b", ("client", "b"))
        b.stop()
        run = uvloop.run if uvloop is not None else asyncio.run
        results = run(run_rounds(root, *daemons, mine, b_tls, manifest, a.rounds))
        report(size, a.files, results)
    finally:
        for d in daemons:
            d.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
