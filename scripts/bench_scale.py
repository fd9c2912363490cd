"""Measure one job's coordinator at 256, 1,024 and 4,096 ranks, over real gRPC.

Per N, two real daemons run ranks 0 and N/2 (rank 0's daemon hosts the coordinator; with
one peer per node they push their items to each other) on tmpfs, backing up to ``file://``;
the other N-2 ranks are simulated members in this process. Each simulated member has its own
gRPC channel (with mutual TLS unless ``--no-tls``) and speaks the coordinator protocol as an
agent does: it joins with an inventory (its own items of the steps it holds and its pusher's
copies, with the digests of the manifests it uploads) in a call that long-polls until the
round is planned, reports its restore in one that long-polls until the release, then
reports progress as an agent does (when it takes a step, when the step is
replicated, after each upload, and every ``report_every_seconds``), uploading its tiny
item's manifest when ordered to back up so that the coordinator's COMMIT finds every item.

Measured per N:

- ``round``: a job restart with nothing lost: first join to the last member released;
  ``plan``, the plan's computation alone (from the coordinator's log); the coordinator
  calls per member by method, and the calls the server dropped (retried);
- ``loss 1%/10%/100%``: the same with that share of members' RAM disks lost (they join
  empty; at 100% the real daemons are wiped too and fetch their items from the backup),
  with the plan's busiest peer (how many items one holder serves);
- ``steady``: the coordinator daemon's CPU seconds per minute and its RSS while every member
  saves every ``--save-every`` seconds and backups are ordered and committed;
- ``restart`` (largest N only): rank 0's daemon is killed with SIGKILL in steady state and
  started again; seconds until the next backup is ordered.

Prints a table; ``--json`` prints one JSON object per N instead.

    .venv/bin/python scripts/bench_scale.py                    # 256, 1024, 4096
    .venv/bin/python scripts/bench_scale.py --nodes 256 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import google_crc32c
import grpc
import grpc.aio

from mtc_replicator._pb.mtc.v1 import coordinator_pb2 as pb
from mtc_replicator._pb.mtc.v1 import coordinator_pb2_grpc, peer_pb2
from mtc_replicator.cluster.messages import cluster_view_json
from mtc_replicator.cluster.registry import Registry
from mtc_replicator.core.contract import JobConfig, parse_config
from mtc_replicator.core.layout import pushers, replication_targets
from mtc_replicator.core.manifest import FileEntry, ItemId, ItemKind, Manifest
from mtc_replicator.core.storedir import default_store_dir
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore, PreconditionFailed
from mtc_replicator.tools import certs
from mtc_replicator.transport.tls import TlsFiles, TlsMaterial

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: tests/ beside mtc_replicator

from tests import proc  # noqa: E402

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

JOB = "scale"
State = pb.RoundStatusResponse.State
_READY = re.compile(rb"daemon started:.* listen=(\S+) advertise=")
_PLAN = re.compile(
    r"round (\d+) plan (\d+): .* in ([0-9.]+)s \((\d+) items; the busiest peer serves (\d+)\)"
)
_PAYLOAD = b"bench-scale item\n"


# --- the real daemons ---------------------------------------------------------------------------


@dataclass
class Node:
    """A real daemon running one rank."""

    rank: int
    ckpt: Path
    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with self.log.open("rb") as f:
                f.seek(offset)
                if _READY.search(f.read()):
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"daemon of rank {self.rank} did not start:\n{self.log.read_text()}")

    def handshake(self, nodes: int) -> None:
        tmp = self.ckpt / "replicator.yaml.tmp"
        tmp.write_text(yaml_text(self.rank, nodes))
        os.rename(tmp, self.ckpt / "replicator.yaml")

    def save(self, step: int) -> None:
        tmp = self.ckpt / f"{step}.orbax-checkpoint-tmp-bench"
        tmp.mkdir()
        (tmp / "state").write_bytes(_PAYLOAD + f"{self.rank} {step}\n".encode())
        os.rename(tmp, self.ckpt / str(step))

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        return proc.cpu_seconds(self.proc.pid)

    def memory_mib(self, key: str = "VmRSS") -> float:
        assert self.proc is not None
        return proc.memory_mib(self.proc.pid, key)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)

    def wipe(self) -> None:
        for path in (self.ckpt, default_store_dir(self.ckpt)):
            shutil.rmtree(path, ignore_errors=True)
        self.ckpt.mkdir()

    def plans(self) -> list[tuple[int, int, float, int, int]]:
        text = self.log.read_text(errors="replace")
        return [(int(a), int(b), float(c), int(d), int(e)) for a, b, c, d, e in _PLAN.findall(text)]


def yaml_text(rank: int, nodes: int) -> str:
    return (
        f"job-name: {JOB}\nframework: orbax\nnode-rank: {rank}\nnodes: {nodes}\n"
        "peers-per-node: 1\nbackup-interval-steps: 1\n"
    )


def job_config(nodes: int, rank: int = 0) -> JobConfig:
    """The job's config as a rank's daemon reads it from ``yaml_text``."""
    return parse_config(yaml_text(rank, nodes))


# --- simulated members --------------------------------------------------------------------------


def fake_address(rank: int) -> str:
    return f"10.{(rank >> 16) & 255}.{(rank >> 8) & 255}.{rank & 255}:7070"


def fake_manifest(step: int, rank: int) -> Manifest:
    data = _PAYLOAD + f"{rank} {step}\n".encode()
    entry = FileEntry("", len(data), google_crc32c.value(data), blake3.blake3(data).hexdigest())
    return Manifest(ItemId(JOB, step, rank, 0), ItemKind.FILE, (entry,))


@dataclass
class Member:
    """One simulated rank: its channel, what it holds, its steady-state progress."""

    rank: int
    config: JobConfig
    stub: Any = None
    """Its ``CoordinatorStub``, on its own channel."""
    steps: set[int] = field(default_factory=set)
    """Steps whose own item (and pusher's copy) it holds."""
    incarnation: str = ""
    replicated: int | None = None
    uploaded: int | None = None
    uploading: int | None = None
    restorable: int | None = None
    keep: frozenset[int] = frozenset()
    report_every: float = 1.0
    reported: tuple[int | None, int | None] = (None, None)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    force: bool = False
    """A report is due regardless of news (a step was ingested)."""
    first_choices: Counter[int] = field(default_factory=Counter)

    def inventory(self, digests: dict[ItemId, str]) -> list[pb.HeldItem]:
        held = []
        for step in sorted(self.steps):
            for r in (self.rank, *pushers(self.config, self.rank)):
                item = ItemId(JOB, step, r, 0)
                digest = digests.get(item) or fake_manifest(step, r).digest
                ref = peer_pb2.ItemRef(job=JOB, step=step, rank=r, worker=0)
                held.append(pb.HeldItem(item=ref, manifest_digest=digest))
        return held


_RETRIED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def _stopping() -> bool:
    """Whether this task is being cancelled (as opposed to a call of it cut by a channel
    that closed under it, which grpc.aio also raises as CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


RETRIES = Counter[str]()
RETRY_DETAILS = Counter[str]()
"""Calls that failed and were tried again, by status (reported with the results)."""


async def restore_round(m: Member, digests: dict[ItemId, str]) -> float:
    """Join, follow the round, report ready; the time this member saw the release. A
    dropped call joins again with the same incarnation, as an agent does."""
    m.incarnation = os.urandom(8).hex()
    while True:
        try:
            return await _follow_round(m, digests)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _RETRIED:
                raise
            RETRIES[exc.code().name] += 1
            method = getattr(exc, "method", "?")
            RETRY_DETAILS[f"{method} {exc.code().name}: {(exc.details() or '')[:80]}"] += 1
            await asyncio.sleep(0.2)


async def _follow_round(m: Member, digests: dict[ItemId, str]) -> float:
    """As an agent does (``cluster.rounds``): a join that long-polls until the round is
    planned, a restore report that long-polls until the release; RoundStatus only when a
    wait ended first."""
    targets = replication_targets(job_config(m.config.nodes, m.rank))
    # What each of its round calls carries: who asks, the long poll, the addresses it needs.
    asks: dict[str, Any] = {
        "job": JOB,
        "rank": m.rank,
        "incarnation_id": m.incarnation,
        "wait_seconds": 10,
        "address_ranks": targets,
        "address_ranks_given": True,
    }
    join = pb.JoinRequest(
        **asks,
        cluster_view=cluster_view_json(m.config),
        address=fake_address(m.rank),
        items=m.inventory(digests),
    )
    joined = await _call("Join", m.stub.Join(join, timeout=70))
    round_ = joined.round
    news: pb.RoundStatusResponse | None = joined.status if joined.HasField("status") else None
    seen_state, seen_version, done = State.STATE_UNSPECIFIED, 0, -1
    while True:
        if news is None:
            poll = pb.RoundStatusRequest(
                **asks, round=round_, seen_state=seen_state, seen_plan_version=seen_version
            )
            news = await _call("RoundStatus", m.stub.RoundStatus(poll, timeout=70))
        status, news = news, None
        round_, seen_state, seen_version = status.round, status.state, status.plan_version
        if status.state == State.REJOIN:
            raise RuntimeError(f"rank {m.rank} must rejoin: {status.message}")
        if status.state == State.FETCH and status.plan_version != done:
            # No data moves: what this measures is the control plane.
            for a in status.assignments:
                first = a.sources[0]
                if first.kind == pb.ItemSource.PEER:
                    m.first_choices[first.holder_rank] += 1
            report = pb.ReportRestoreRequest(
                **asks, round=round_, plan_version=status.plan_version, ready=True
            )
            reported = await _call("ReportRestore", m.stub.ReportRestore(report, timeout=70))
            done = status.plan_version
            news = reported.status if reported.HasField("status") else None
            m.steps = {status.step} | m.steps if not status.fresh_start else m.steps
        if status.state == State.RELEASED:
            m.restorable = None if status.fresh_start else status.step
            return time.monotonic()


CALLS = Counter[str]()
"""Coordinator calls made in restore rounds, by method (reported with the results)."""


async def _call(method: str, call: Any) -> Any:
    """Await one coordinator call, counting it (and naming its method if it fails)."""
    CALLS[method] += 1
    try:
        return await call
    except grpc.aio.AioRpcError as exc:
        exc.method = method  # type: ignore[attr-defined]
        raise


class Steady:
    """Every simulated member's steady state, as an agent's ticks drive it: a report when
    there is news (a step replicated, an upload done), else every ``report_every_seconds``;
    after a failed report, a jittered backoff and a new registry lookup."""

    def __init__(
        self,
        members: list[Member],
        backups: BackupStore,
        tmp: Path,
        *,
        reconnect: Callable[[str], None],
        registry: Registry,
        address: str,
    ) -> None:
        self.members = members
        self.backups = backups
        self.tmp = tmp
        self.reconnect = reconnect
        self.registry = registry
        self.address = address
        self.reports = 0
        self.failures = 0
        self.failure_codes = Counter[str]()
        self.crashes = Counter[str]()
        """Reports that raised something other than a gRPC error, by what."""
        self.orders: list[tuple[float, int]] = []
        self.ordered = asyncio.Event()
        self.tasks = [asyncio.create_task(self.routine(m)) for m in members]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def report(self, m: Member) -> bool:
        held = sorted(
            {s for s in m.steps if s in m.keep or s == m.restorable} | set(sorted(m.steps)[-2:])
        )
        try:
            answer = await m.stub.ReportProgress(
                pb.ReportProgressRequest(
                    job=JOB,
                    rank=m.rank,
                    incarnation_id=m.incarnation,
                    replicated_step=m.replicated,
                    uploaded_step=m.uploaded,
                    address=fake_address(m.rank),
                    held_steps=held,
                    reports_holdings=True,
                    address_ranks=replication_targets(m.config),
                    address_ranks_given=True,
                ),
                timeout=30,
            )
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if _stopping():
                    raise
                # Another member's failure reconnected every member, and closing the old
                # channel cut this call (grpc.aio raises CancelledError in the caller):
                # a failed report to retry, not the end of this member.
                code = "CANCELLED by a reconnect"
            else:
                code = exc.code().name
            self.failures += 1
            self.failure_codes[code] += 1
            entry = await asyncio.to_thread(self.registry.lookup, JOB)
            if entry is not None and entry.address != self.address:
                self.address = entry.address
                self.reconnect(entry.address)
            return False
        self.reports += 1
        m.reported = (m.replicated, m.uploaded)
        m.report_every = answer.report_every_seconds or 1.0
        m.keep = frozenset(answer.keep_steps)
        if answer.HasField("restorable_step"):
            m.restorable = answer.restorable_step
        order = answer.backup_step if answer.HasField("backup_step") else None
        if order is not None and m.uploading is None and (m.uploaded or -1) < order:
            m.uploading = order
            self.orders.append((time.monotonic(), order))
            self.ordered.set()
            asyncio.get_running_loop().create_task(self.upload(m, order))
        return True

    async def routine(self, m: Member) -> None:
        await asyncio.sleep(random.uniform(0, m.report_every))
        backoff = 1.0
        while True:
            m.wake.clear()
            m.force = False
            try:
                answered = await self.report(m)
            except Exception as exc:  # a member that dies silently would stall every order
                self.crashes[f"{type(exc).__name__}: {exc}"[:120]] += 1
                answered = False
            if answered:
                backoff = 1.0
                if m.reported == (m.replicated, m.uploaded) and not m.force:
                    # Not asyncio.wait_for: on 3.11 it can swallow the cancel of ``stop``
                    # when it arrives as the wait ends (gh-86296); among 4,096 members one
                    # always does, and ``stop`` then waits forever.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(m.report_every * random.uniform(0.9, 1.1)):
                            await m.wake.wait()
            else:
                await asyncio.sleep(random.uniform(backoff / 2, backoff))
                backoff = min(backoff * 2, 30.0)

    async def upload(self, m: Member, step: int) -> None:
        await asyncio.sleep(random.uniform(0.2, 1.0))
        manifest = fake_manifest(step, m.rank)
        data = self.tmp / f"{m.rank}"
        data.write_bytes(_PAYLOAD + f"{m.rank} {step}\n".encode())
        with contextlib.suppress(PreconditionFailed):  # committed already: done
            await asyncio.to_thread(self.backups.upload_item, manifest, data)
        m.uploaded, m.uploading = step, None
        m.wake.set()

    async def saved(self, step: int) -> None:
        """Every member committed ``step`` (and reports it, as an agent does at ingest), then
        pushed it to its peer (and reports that), within a second."""

        async def one(m: Member) -> None:
            await asyncio.sleep(random.uniform(0.0, 0.5))
            # Ingest: an agent reports its new promise at once (it keeps the newest three,
            # and what the coordinator asks for) ...
            m.steps = {*sorted(m.steps)[-2:], step}
            m.force = True
            m.wake.set()
            # ... and again once the step reached its peer.
            await asyncio.sleep(random.uniform(0.2, 0.5))
            m.replicated = step
            m.wake.set()

        await asyncio.gather(*(one(m) for m in self.members))


# --- one N ----------------------------------------------------------------------------------------


def make_tls(root: Path, ca: certs.Pair, name: str) -> TlsFiles:
    directory = root / "tls" / name
    certs.write_node_files(directory, ca, certs.issue(ca, node=name))
    return certs.node_files(directory)


def open_channel(address: str, tls: TlsMaterial | None) -> grpc.aio.Channel:
    options = [("grpc.enable_retries", 0)]
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), options=[*options, *tls.channel_options()]
    )


class Run:
    def __init__(self, n: int, root: Path, args: argparse.Namespace) -> None:
        self.n = n
        self.root = root
        self.args = args
        self.backup = root / "backup"
        self.backup.mkdir(parents=True)
        self.tls: TlsMaterial | None = None
        daemon_tls: dict[int, TlsFiles] = {}
        if not args.no_tls:
            ca = certs.new_ca()
            daemon_tls = {r: make_tls(root, ca, f"node{r}") for r in (0, n // 2)}
            self.tls = TlsMaterial(make_tls(root, ca, "members"))
        self.nodes = {r: self._node(r, daemon_tls.get(r)) for r in (0, n // 2)}
        self.config = job_config(n)
        self.store = BackupStore(FileObjectStore(self.backup))
        self.result: dict[str, Any] = {"nodes": n, "tls": not args.no_tls}
        self.address = ""
        self.channels: list[grpc.aio.Channel] = []
        self.closing: list[asyncio.Task[None]] = []

    def _node(self, rank: int, tls: TlsFiles | None) -> Node:
        ckpt = self.root / f"node{rank}"
        ckpt.mkdir()
        args = [sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir", str(ckpt)]
        args += ["--listen", "127.0.0.1:0", "--backup", self.backup.as_uri()]
        args += ["--rescan-seconds", "0.5", "--settle-seconds", "0.5"]
        if tls is not None:
            args += [
                "--tls-cert",
                str(tls.cert),
                "--tls-key",
                str(tls.key),
                "--tls-ca",
                str(tls.ca),
            ]
        return Node(rank, ckpt, args, self.root / f"node{rank}.log")

    def connect(self, members: list[Member], address: str) -> None:
        """Every member's own channel to the coordinator at ``address``."""
        for channel in self.channels:
            self.closing.append(asyncio.get_running_loop().create_task(channel.close()))
        self.channels = []
        self.address = address
        for m in members:
            channel = open_channel(address, self.tls)
            self.channels.append(channel)
            m.stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def coordinator_address(self) -> str:
        registry = Registry(FileObjectStore(self.backup))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            entry = registry.lookup(JOB)
            if entry is not None:
                return entry.address
            time.sleep(0.05)
        raise RuntimeError("the coordinator never registered")

    def real_digests(self) -> dict[ItemId, str]:
        """The real ranks' items as their stores hold them (their peers report these)."""
        found: dict[ItemId, str] = {}
        for node in self.nodes.values():
            # Read-only, beside the running daemon: committed items never change, but
            # retention may remove a step (its directory, or a manifest) while we look.
            items = default_store_dir(node.ckpt) / "items" / JOB
            for step in _listdir(items):
                for item in _listdir(items / step):
                    try:
                        raw = (items / step / item / "MANIFEST.json").read_bytes()
                    except (FileNotFoundError, NotADirectoryError):
                        continue
                    manifest = Manifest.from_json(raw)
                    found[manifest.item] = manifest.digest
        return found

    async def round(self, members: list[Member], lost: set[int], wipe_real: bool) -> dict[str, Any]:
        """A job restart: every rank a new incarnation; ``lost`` ranks join empty."""
        for node in self.nodes.values():
            if wipe_real:
                node.stop()
                node.wipe()
                node.start()
            node.handshake(self.n)
        address = await asyncio.to_thread(self.coordinator_address)
        if address != self.address:
            self.connect(members, address)
        digests = self.real_digests()
        for m in members:
            m.first_choices = Counter()
            if m.rank in lost:
                m.steps = set()
        plans_before = len(self.nodes[0].plans())
        retried_before = RETRIES.total()
        calls_before = CALLS.copy()
        t0 = time.monotonic()
        released = await asyncio.gather(*(restore_round(m, digests) for m in members))
        elapsed = max(released) - t0
        plans = self.nodes[0].plans()[plans_before:]
        load = Counter[int]()
        for m in members:
            load.update(m.first_choices)
        return {
            "seconds": round(elapsed, 3),
            "plan_seconds": round(sum(p[2] for p in plans), 3),
            "busiest_peer_items": max((p[4] for p in plans), default=0),
            "busiest_peer_items_seen": max(load.values(), default=0),
            "retried_calls": RETRIES.total() - retried_before,
            "calls_per_member": {
                method: round((CALLS[method] - calls_before[method]) / len(members), 2)
                for method in sorted(CALLS)
            },
        }

    async def run(self) -> dict[str, Any]:
        for node in self.nodes.values():
            node.start()
        sims = [r for r in range(self.n) if r not in self.nodes]
        for node in self.nodes.values():
            node.handshake(self.n)
        address = await asyncio.to_thread(self.coordinator_address)
        members = [Member(r, job_config(self.n, r)) for r in sims]
        self.connect(members, address)
        # Round 1: a fresh start; then steady state.
        await asyncio.gather(*(restore_round(m, {}) for m in members))
        (self.root / "uploads").mkdir()
        self.result["steady"] = await self.steady(members, self.args.steady_seconds)
        if self.args.restart:
            self.result["restart"] = await self.restart(members)
        # Restore rounds: nothing lost, then 1%, 10% and 100% of the RAM disks.
        rng = random.Random(self.n)
        self.result["round"] = await self.round(members, set(), wipe_real=False)
        for share in (0.01, 0.10):
            lost = set(rng.sample(sims, max(1, round(share * self.n))))
            self.result[f"loss_{int(share * 100)}"] = await self.round(members, lost, False)
        self.result["loss_100"] = await self.round(members, set(sims), wipe_real=True)
        for node in self.nodes.values():
            node.stop()
        await asyncio.gather(*self.closing, *(c.close() for c in self.channels))
        return self.result

    def steady_state(self, members: list[Member]) -> Steady:
        return Steady(
            members,
            self.store,
            self.root / "uploads",
            reconnect=lambda address: self.connect(members, address),
            registry=Registry(FileObjectStore(self.backup)),
            address=self.address,
        )

    def save(self, step: int) -> None:
        for node in self.nodes.values():
            node.save(step)

    async def steady(self, members: list[Member], seconds: float) -> dict[str, Any]:
        coordinator = self.nodes[0]
        steady = self.steady_state(members)
        step = max((s for m in members for s in m.steps), default=0) + 1
        first = step
        t0, cpu0 = time.monotonic(), coordinator.cpu_seconds()
        commits0 = len(self.store.committed_steps(JOB))
        while time.monotonic() - t0 < seconds:
            self.save(step)
            await steady.saved(step)
            step += 1
            await asyncio.sleep(max(0.0, self.args.save_every - 1.0))
        elapsed = time.monotonic() - t0
        cpu = coordinator.cpu_seconds() - cpu0
        reports = steady.reports
        await steady.stop()
        return {
            "seconds": round(elapsed, 1),
            "cpu_seconds_per_minute": round(cpu / elapsed * 60, 2),
            "rss_mib": round(coordinator.memory_mib(), 1),
            "peak_rss_mib": round(coordinator.memory_mib("VmHWM"), 1),
            "reports_per_second": round(reports / elapsed, 1),
            "steps_saved": step - first,
            "backups_committed": len(self.store.committed_steps(JOB)) - commits0,
        }

    async def restart(self, members: list[Member]) -> dict[str, Any]:
        """Kill rank 0's daemon in steady state, right as the next step is saved; seconds
        until the restarted coordinator orders that step's backup."""
        steady = self.steady_state(members)
        await asyncio.sleep(2)
        t0 = time.monotonic()
        steady.orders.clear()  # orders of the coordinator before the restart do not count
        steady.ordered.clear()
        coordinator = self.nodes[0]
        coordinator.stop(signal.SIGKILL)
        step = max(s for m in members for s in m.steps) + 1
        await asyncio.to_thread(coordinator.start)
        self.save(step)
        await steady.saved(step)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(300):
                await self._watch(steady)
        ordered = steady.orders[0][0] - t0 if steady.orders else float("nan")
        failures = steady.failures
        await steady.stop()
        return {"seconds_to_backup_order": round(ordered, 2), "failed_reports": failures}

    @staticmethod
    async def _watch(steady: Steady) -> None:
        """Wait for the first order, saying on stderr every 10 s how the reports go."""
        t0 = time.monotonic()
        while not steady.ordered.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await steady.ordered.wait()
            print(
                f"  restart +{time.monotonic() - t0:.0f}s: {steady.reports} reports answered, "
                f"{steady.failures} failed {dict(steady.failure_codes)}, "
                f"{len(steady.orders)} orders, other errors {dict(steady.crashes)}",
                file=sys.stderr,
            )


# --- report -------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("restore round, s (target < 10 at 4096)", lambda r: r["round"]["seconds"]),
        ("  plan alone, s", lambda r: r["round"]["plan_seconds"]),
        ("  calls per member", lambda r: sum(r["round"]["calls_per_member"].values())),
        ("  calls retried", lambda r: r["round"]["retried_calls"]),
        ("round, 1% lost, s", lambda r: r["loss_1"]["seconds"]),
        ("  busiest peer serves, items", lambda r: r["loss_1"]["busiest_peer_items"]),
        ("round, 10% lost, s", lambda r: r["loss_10"]["seconds"]),
        ("  busiest peer serves, items", lambda r: r["loss_10"]["busiest_peer_items"]),
        ("round, 100% lost, s", lambda r: r["loss_100"]["seconds"]),
        ("  plan alone, s", lambda r: r["loss_100"]["plan_seconds"]),
        (
            "steady: coordinator CPU s/min (target < 15)",
            lambda r: r["steady"]["cpu_seconds_per_minute"],
        ),
        ("steady: coordinator RSS, MiB", lambda r: r["steady"]["rss_mib"]),
        ("steady: reports/s", lambda r: r["steady"]["reports_per_second"]),
        ("steady: backups committed", lambda r: r["steady"]["backups_committed"]),
        (
            "coordinator restart: s to next backup order",
            lambda r: r.get("restart", {}).get("seconds_to_backup_order", "-"),
        ),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'ranks':<{width}}  " + "  ".join(f"{r['nodes']:>8}" for r in results)]
    for label, get in rows:
        lines.append(f"{label:<{width}}  " + "  ".join(f"{get(r)!s:>8}" for r in results))
    return "\n".join(lines)


def _listdir(path: Path) -> list[str]:
    """The names in ``path``; none when retention removed it meanwhile."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="256,1024,4096", help="comma-separated job sizes")
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument(
        "--save-every",
        type=float,
        default=30.0,
        help="seconds between saves (every save is backed up); large jobs save every few minutes",
    )
    parser.add_argument("--no-tls", action="store_true", help="plaintext gRPC (default: mTLS)")
    parser.add_argument("--json", action="store_true", help="one JSON object per N")
    parser.add_argument("--keep", action="store_true", help="keep the daemons' directories")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a channel per member
    if uvloop is not None:
        uvloop.install()
    results = []
    base = Path(tempfile.mkdtemp(prefix="mtc-bench-scale-", dir="/dev/shm"))
    try:
        for n in sizes:
            args.restart = n == max(sizes)
            run = Run(n, base / f"n{n}", args)
            try:
                result = asyncio.run(run.run())
            finally:
                for node in run.nodes.values():
                    node.stop(signal.SIGKILL)
            result["retried_calls"] = dict(RETRIES)
            result["retried_why"] = dict(RETRY_DETAILS.most_common(5))
            RETRIES.clear()
            CALLS.clear()
            RETRY_DETAILS.clear()
            results.append(result)
            if args.json:
                print(json.dumps(result), flush=True)
            else:
                print(f"N={n}: done", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    if not args.json:
        print(table(results))


if __name__ == "__main__":
    main()
