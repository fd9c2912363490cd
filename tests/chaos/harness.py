"""Run one chaos trial against real daemons and check the invariants at every job restart.

Four daemon processes with mutual TLS, each on its own RAM disk (a tmpfs per node, the store
beside CHECKPOINT_DIR) and, where ``ip netns`` works, in its own network namespace. The test
process plays the training job (handshake, saves, markers) and injects the plan's faults.

Invariants, checked at every restart of the job:

- markers: every rank gets exactly one restore marker within ``MARKER_BOUND`` seconds of the
  restart (plus the length of any fault during the round), and all name the same step;
- bytes: each rank's marker leads to exactly the bytes that rank saved for that step;
- nothing committed lost: the restored step is at least the *floor*, the newest step that
  was durable just before the restart: a step with a backup ``COMMIT``, or a step of which
  every rank's item was committed (``MANIFEST.json``) in some node's store. Faults only
  destroy copies before the snapshot, so a step above the restored one that is still in the
  snapshot was lost by the daemons, not by the faults;
- no spinning: after the markers, each daemon uses under ``CPU_BOUND`` of a core and its log
  grows by under ``LOG_BOUND`` bytes in ``IDLE_SECONDS``; while the job waits, the same
  numbers are reported when the markers do not come.

Does I/O (processes, tmpfs mounts, network namespaces).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.stores import open_object_store
from tests.chaos import network
from tests.chaos.invariants import Violation, check_floor, floor, restored_step, spinning
from tests.chaos.nodes import ChaosCluster, Meter, Servers
from tests.chaos.plan import IN_ROUND, Epoch, Fault, Plan
from tests.chaos.store_faults import FullDisk, StoreFaults
from tests.integration.cluster import NODES
from tests.integration.helpers import (
    FAILED,
    make_step,
    mount_tmpfs,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    unmount,
)
from tests.storage_servers import (
    create_gcs_bucket,
    create_s3_bucket,
    gcs_env,
    s3_env,
    unique_bucket_name,
)

MARKER_BOUND = 60.0
"""Seconds from a job restart to its last marker (clients give up at 300)."""
SAVE_BOUND = 30.0
"""Seconds for a running daemon to take a saved step into its store."""
IDLE_SECONDS = 2.0
CPU_BOUND = 0.6
"""Share of one core a daemon may use while the job trains after a restore (tiny steps)."""
LOG_BOUND = 256 << 10
"""Log bytes a daemon may write in ``IDLE_SECONDS``."""
WEDGE = "is not admitted to round"
"""The log line of the known wedge (issue 23: a restarted rank 0 then a job restart)."""
TRIAL_LOG_BOUND = 8 << 20
"""Log bytes a daemon may write in a whole trial (a few incarnations, a few faults)."""
FULL_DISK = "16m"
TRAIN_SECONDS = 0.3
"""The job's compute between two saves."""


@dataclass
class Result:
    seed: int
    ok: bool = False
    message: str = ""
    known: str = ""
    """The known bug whose signature the failure shows, if any."""
    steps_lost: int = 0
    """Steps between the floor and the restored step, summed over restarts (should be 0)."""
    rolled_back: int = 0
    """Steps between the newest save and the restored step, summed (faults cause these)."""
    fault_to_marker: list[float] = field(default_factory=list)
    restart_to_marker: list[float] = field(default_factory=list)
    seconds: float = 0.0
    logs: Path | None = None


# --- the trial ------------------------------------------------------------------------------------


class Trial:
    def __init__(
        self,
        plan: Plan,
        root: Path,
        servers: Servers,
        *,
        netns: bool,
        keep: bool = False,
        marker_bound: float = MARKER_BOUND,
    ) -> None:
        self.plan = plan
        self.marker_bound = marker_bound
        self.keep = keep
        """Keep the trial's directory (the daemons' logs) when it passes too."""
        self.root = root
        self.servers = servers
        self.netns = netns
        self.result = Result(plan.seed)
        self.files: dict[int, dict[int, dict[str, bytes]]] = {}
        """What the job saved: step -> rank -> relative path -> bytes."""
        self.pending: list[tuple[float, str, Callable[[], None]]] = []
        """Heals and restarts due at a time (monotonic), with what they are."""
        self.store: StoreFaults | FullDisk | None = None
        self.backups: BackupStore | None = None
        self.fault_times: list[float] = []
        """When each fault since the last restart was injected."""
        self.upstream_env: dict[str, str] = {}
        self.job_down = False
        """A node was lost: its pod died with it, so the job stops until it restarts."""

    # The trial's whole life: set up, run every incarnation, tear down.
    def run(self) -> Result:
        start = time.monotonic()
        with contextlib.ExitStack() as stack:
            try:
                self._setup(stack)
                self._incarnations()
                self._check_logs()
            except Violation as e:
                self.result.message = str(e)
            except Exception as e:  # a daemon that would not start, a tool that failed
                self.result.message = f"{type(e).__name__}: {e}"
            else:
                self.result.ok = True
            finally:
                if not self.result.ok and self._wedged():
                    self.result.known = "wedge: rank 0's agent refused by its own coordinator"
                self.result.seconds = time.monotonic() - start
        if self.result.ok and not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            self.result.logs = self.root
        return self.result

    def _setup(self, stack: contextlib.ExitStack) -> None:
        self.root.mkdir(parents=True)
        net = None
        if self.netns:
            net = network.Network(NODES).open()
            stack.callback(net.close)
        self.net = net
        job = f"chaos{self.plan.seed}"
        cluster = ChaosCluster(self.root, job, net)
        cluster.extra = self.plan.flags
        stack.callback(cluster.close)
        self.cluster = cluster
        cluster.keys["backup_interval_steps"] = self.plan.interval
        cluster.keys.update(self.plan.keys)
        if "backup_interval_minutes" in cluster.keys:
            del cluster.keys["backup_interval_steps"]  # at most one of the two
        host = net.gateway if net else "127.0.0.1"
        backend = self.plan.backend
        if backend == "full":
            fs = self.root / "backup-fs"
            fs.mkdir()
            if not mount_tmpfs(fs, FULL_DISK):  # never fill a real disk
                raise RuntimeError("the full-disk backend needs root (a tmpfs of its own)")
            stack.callback(unmount, fs)
            cluster.backup = fs / "backup"
            cluster.backup.mkdir()
            cluster.backup_url = cluster.backup.as_uri()
            self.store = FullDisk(cluster.backup)
        elif backend in ("s3", "gcs"):
            upstream = self.servers.upstream(backend)
            bucket = unique_bucket_name()
            if backend == "s3":
                create_s3_bucket(upstream, bucket)
            else:
                create_gcs_bucket(upstream, bucket)
            faults = StoreFaults(backend, upstream, self.plan.seed, host)
            self.store = faults
            cluster.backup_url = f"{'s3' if backend == 's3' else 'gs'}://{bucket}/chaos"
            cluster.env = s3_env(faults.url) if backend == "s3" else gcs_env(faults.url)
            # The harness reads the bucket itself, past the proxy and its faults.
            self.upstream_env = s3_env(upstream) if backend == "s3" else gcs_env(upstream)
            with _environ(self.upstream_env):
                self.backups = BackupStore(open_object_store(cluster.backup_url))
        if self.store is not None:
            stack.callback(self.store.close)
        stack.callback(cluster.kill_all)
        cluster.start_all()

    def _incarnations(self) -> None:
        c = self.cluster
        self._restart(Epoch(0, (), 0.0), newest=0)  # the job's first start: nothing to restore
        step = 0
        for epoch in self.plan.epochs:
            self.job_down = False
            for i in range(epoch.saves):
                if self.job_down:
                    break
                step += 10
                self.files[step] = c.write_step(step)
                self._wait_saved(step)
                self._schedule([f for f in epoch.faults if f.after_save == i])
                self._run_due(until=time.monotonic() + TRAIN_SECONDS)
            newest = step
            self._run_due(until=None)  # every heal and restart done before the job restarts
            time.sleep(epoch.restart_delay)
            step = self._restart(epoch, newest=newest)

    # --- faults -----------------------------------------------------------------------------------

    def _start(self, rank: int) -> None:
        d = self.cluster.daemons[rank]
        if d is None or not d.running:  # two faults on one node: one restart
            self.cluster.start(rank)

    def _schedule(self, faults: list[Fault], *, base: float | None = None) -> None:
        now = time.monotonic() if base is None else base
        for f in faults:
            self.pending.append(
                (now + f.delay, f"inject {f.describe()}", lambda f=f: self._inject(f))
            )
        self.pending.sort(key=lambda p: p[0])

    def _after(self, seconds: float, what: str, action: Callable[[], None]) -> None:
        self.pending.append((time.monotonic() + seconds, what, action))
        self.pending.sort(key=lambda p: p[0])

    def _run_due(self, *, until: float | None) -> None:
        """Run what is due; wait until ``until`` (None: until nothing is pending)."""
        while True:
            now = time.monotonic()
            while self.pending and self.pending[0][0] <= now:
                _, _, action = self.pending.pop(0)
                action()
            if until is None and not self.pending:
                return
            wake = self.pending[0][0] if self.pending else until
            if until is not None:
                wake = min(wake or until, until)
                if now >= until:
                    return
            time.sleep(max(0.0, min((wake or now) - time.monotonic(), 0.05)))

    def _inject(self, f: Fault) -> None:
        c = self.cluster
        self.fault_times.append(time.monotonic())
        if f.kind in ("kill", "lose"):
            c.daemon(f.rank).kill()
            if f.kind == "lose":
                c.clear(f.rank)
                self.job_down = True
            self._after(f.duration, f"restart rank {f.rank}", lambda: self._start(f.rank))
            return
        if f.kind == "store":
            assert self.store is not None
            self.store.begin(f.mode)
            self._after(f.duration, "store healed", self.store.end)
            return
        assert self.net is not None
        others = [r for r in range(NODES) if r != f.rank]
        if f.kind == "isolate":
            self.net.isolate(f.rank)
        elif f.kind == "cut-coordinator":
            self.net.cut(f.rank, [0])
        else:
            self.net.cut(f.rank, [r for r in others if r != 0] if f.rank else others)
        self._after(f.duration, "network healed", self.net.heal)

    # --- the job ----------------------------------------------------------------------------------

    def _wait_saved(self, step: int) -> None:
        """Each rank whose daemon runs takes the step into its store (a dead one later)."""
        deadline = time.monotonic() + SAVE_BOUND
        for r in range(NODES):
            while not self._taken(r, step):
                d = self.cluster.daemons[r]
                if d is None or not d.running or self.job_down:
                    break
                if time.monotonic() > deadline:
                    raise Violation(f"rank {r}'s daemon did not take step {step} in {SAVE_BOUND}s")
                self._run_due(until=time.monotonic() + 0.05)

    def _taken(self, rank: int, step: int) -> bool:
        return not (self.cluster.dirs[rank] / str(step)).is_dir()

    def _floor(self) -> tuple[int, str]:
        """The newest durable step now, and why (``invariants.floor``)."""
        held = {h: self.cluster.held(h) for h in range(NODES)}
        return floor(held, self._committed_backups(), NODES)

    def _committed_backups(self) -> set[int]:
        if self.backups is None:
            return self.cluster.committed_backups()
        with _environ(self.upstream_env):
            return set(self.backups.committed_steps(self.cluster.job))

    def _restart(self, epoch: Epoch, *, newest: int) -> int:
        """The whole job restarts: handshake on every rank, markers, invariants."""
        c = self.cluster
        floor_step, why = self._floor()
        meter = Meter(c)
        t0 = time.monotonic()
        order = list(epoch.order or range(NODES))  # the order the ranks' pods come up in
        if not epoch.order:
            random.Random(f"{self.plan.seed}/{newest}").shuffle(order)
        in_round = [f for f in epoch.faults if f.after_save == IN_ROUND]
        # A negative delay: the fault comes that long before the job's handshake (a daemon
        # down while the pods restart).
        early = [f for f in in_round if f.delay < 0]
        for f in early:
            self._inject(f)
        if epoch.torn:
            # The job dies mid-save: these ranks published the next step, the others not.
            files = {r: payload(newest + 10, seed=f"rank{r}") for r in range(NODES)}
            self.files[newest + 10] = files
            for r in epoch.torn:
                make_step(c.dirs[r], newest + 10, files[r])
        time.sleep(max((-f.delay for f in early), default=0.0))
        c.handshake(order)
        self._schedule([f for f in in_round if f.delay >= 0], base=t0)
        bound = self.marker_bound + sum(abs(f.delay) + f.duration for f in in_round)
        seen: dict[int, float] = {}
        while len(seen) < NODES:
            now = time.monotonic()
            for r in range(NODES):
                if r not in seen and c.markers(r):
                    seen[r] = now
            if now - t0 > bound:
                missing = [r for r in range(NODES) if r not in seen]
                raise Violation(
                    f"restart after step {newest}: no marker on ranks {missing} in {bound:.0f}s "
                    f"({meter.describe()}); errors: "
                    + "; ".join(f"rank {r}: {self._said(r)!r}" for r in missing)
                )
            self._run_due(until=time.monotonic() + 0.05)
        self._run_due(until=None)
        last = max(seen.values())
        self.result.restart_to_marker.append(last - t0)
        # A fault of the round that came after its last marker counts for the next restart.
        self.result.fault_to_marker += [last - t for t in self.fault_times if t <= last]
        self.fault_times = [t for t in self.fault_times if t > last]
        for r in range(NODES):
            d = c.daemon(r)
            if not d.running:
                raise Violation(
                    f"rank {r}'s daemon exited by itself (code {d.proc and d.proc.returncode})"
                )
        step = self._check_markers(floor_step, why, newest)
        self._check_idle()
        return step

    def _said(self, rank: int) -> str:
        """What the daemon told the job: ``replicator.failed``, else ``replicator.errors``."""
        failed = read_text(self.cluster.dirs[rank] / FAILED)
        return (failed or self.cluster.errors(rank)).strip()[-300:]

    def _check_markers(self, floor_step: int, why: str, newest: int) -> int:
        c = self.cluster
        step = restored_step({r: c.markers(r) for r in range(NODES)})
        if step < floor_step:
            self.result.steps_lost += floor_step - step
        check_floor(step, floor_step, why, newest)
        self.result.rolled_back += newest - step
        for r in range(NODES):
            marker = c.restored(r, step)
            if step == 0:
                if marker.is_symlink() or marker.stat().st_size:
                    raise Violation(f"rank {r}'s step-0 marker is not an empty file")
            elif read_tree(marker) != self.files[step][r]:
                raise Violation(f"rank {r}'s step {step} is not the bytes it saved")
            if step and read_prerestore(c.dirs[r]).get("restore-step") != step:
                raise Violation(f"rank {r}'s prerestore disagrees with its marker {step}")
            os.unlink(marker)  # the client takes it
        return step

    def _check_idle(self) -> None:
        meter = Meter(self.cluster)
        time.sleep(IDLE_SECONDS)
        busy = spinning(meter.read(), CPU_BOUND, LOG_BOUND)
        if busy:
            raise Violation(f"ranks {busy} spin after the restore: {meter.describe()}")

    def _check_logs(self) -> None:
        for r in range(NODES):
            size = self.cluster.log(r).stat().st_size
            if size > TRIAL_LOG_BOUND:
                raise Violation(f"rank {r}'s daemon logged {size} bytes in one trial")

    def _wedged(self) -> bool:
        return WEDGE in read_text(self.cluster.log(0)) if hasattr(self, "cluster") else False


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
