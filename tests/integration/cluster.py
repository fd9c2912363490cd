"""A cluster of real daemons on loopback for the multi-node integration tests.

One daemon process per node, each on its own CHECKPOINT_DIR, one shared ``file://`` backup
(or, without one, a shared registry directory); the test process plays the training job.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.stores import open_object_store
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    ERRORS,
    backup_commits,
    config_text,
    make_step,
    payload,
    read_prerestore,
    read_text,
    read_tree,
    store_root,
    wait_until,
    write_yaml_atomic,
)
from tests.tls import node_tls

NODES = 4
FAST = ("--rescan-seconds", "0.3", "--settle-seconds", "2", "--config-wait-seconds", "3")


class Cluster:
    """One daemon per node, each on its own CHECKPOINT_DIR; one shared backup + registry."""

    def __init__(
        self,
        root: Path,
        job: str,
        extra: tuple[str, ...] = (),
        *,
        backup: bool = True,
        tls: bool = True,
        nodes: int = NODES,
    ) -> None:
        self.root = root
        self.nodes = nodes
        self.job = job
        self.extra = extra
        self.keys: dict[str, object] = {"peers_per_node": 1, "backup_interval_steps": 100}
        self.backup = root / "backup"
        self.backup.mkdir()
        self.has_backup = backup
        """Without a backup the shared directory serves only as the registry."""
        self.backup_url = self.backup.as_uri()
        """Where the daemons back up (and register): a bucket URL replaces the directory."""
        self.env: dict[str, str] = {}
        """Extra environment of the daemons (a bucket's endpoint and credentials)."""
        self.node_env: dict[int, dict[str, str]] = {}
        """Extra environment of one node's daemon (its ``MTC_OWNER_FILE``)."""
        self.dirs = [root / f"node{r}" for r in range(self.nodes)]
        for d in self.dirs:
            d.mkdir()
        self.daemons: list[DaemonProcess | None] = [None] * nodes
        self.ca = certs.new_ca() if tls else None
        """Every node's certificate is its own, signed by this throwaway CA (TLS on)."""
        self.tls = [
            node_tls(root / "tls" / f"node{r}", self.ca, node=f"node{r}")
            if self.ca is not None
            else None
            for r in range(self.nodes)
        ]

    def start(self, rank: int) -> DaemonProcess:
        daemon = DaemonProcess(
            self.dirs[rank],
            backup=self.backup_url if self.has_backup else None,
            extra_args=(
                *FAST,
                *(() if self.has_backup else ("--registry", self.backup_url)),
                *(tls.args() if (tls := self.tls[rank]) is not None else ()),
                *self.extra,
            ),
            env={**self.env, **self.node_env.get(rank, {})},
            log_path=self.root / f"node{rank}.log",
        )
        self.daemons[rank] = daemon.start()
        return daemon

    def daemon(self, rank: int) -> DaemonProcess:
        d = self.daemons[rank]
        assert d is not None
        return d

    def handshake(self, ranks: list[int], *, max_delay: float = 0.0) -> None:
        for i, r in enumerate(ranks):
            if max_delay and i:
                time.sleep(random.uniform(0, max_delay))
            text = config_text(self.job, rank=r, nodes=self.nodes, **self.keys)
            write_yaml_atomic(self.dirs[r], text)

    def markers(self, rank: int) -> list[str]:
        return sorted(p.name for p in self.dirs[rank].iterdir() if p.name.endswith(".restore"))

    def wait_markers(self, step: int) -> None:
        for r in range(self.nodes):
            want = [f"{self.job}-s{step}-n{r}-w0.restore"]
            wait_until(
                lambda r=r, want=want: self.markers(r) == want,
                f"rank {r}'s marker {want}",
                daemon=self.daemon(r),
                timeout=60,
            )

    def held(self, rank: int) -> set[tuple[int, str]]:
        """(step, '<rank>-<worker>') of every committed item in the rank's store."""
        root = store_root(self.dirs[rank]) / "items" / self.job
        if not root.is_dir():
            return set()
        held = set()
        for step in root.iterdir():
            try:
                items = list(step.iterdir())
            except FileNotFoundError:
                continue  # retention removed it while we looked
            held |= {(int(step.name), i.name) for i in items if (i / "MANIFEST.json").exists()}
        return held

    def holder(self, rank: int, step: int) -> int:
        """The one other rank holding a peer copy of ``rank``'s item of ``step``."""
        holders = [
            h for h in range(self.nodes) if h != rank and (step, f"{rank}-0") in self.held(h)
        ]
        assert len(holders) == 1, f"rank {rank}'s step {step} held by {holders}"
        return holders[0]

    def wipe(self, rank: int) -> None:
        """The node loses its RAM disk: daemon killed, directory emptied, daemon restarted."""
        self.daemon(rank).kill()
        self.clear(rank)
        self.start(rank)

    def wipe_all(self) -> None:
        """Every node loses its RAM disk: all daemons stopped, directories emptied, restarted."""
        self.stop_all()
        for r in range(self.nodes):
            self.clear(r)
        for r in range(self.nodes):
            self.start(r)

    def clear(self, rank: int) -> None:
        """Empty the node's RAM disk, CHECKPOINT_DIR and the store beside it (daemon down)."""
        shutil.rmtree(self.dirs[rank])
        shutil.rmtree(store_root(self.dirs[rank]), ignore_errors=True)
        self.dirs[rank].mkdir()

    def fresh_start(self) -> None:
        """The job's first incarnation: every rank gets step 0 (nothing), markers removed."""
        self.handshake([3, 1, 2, 0] if self.nodes == 4 else list(reversed(range(self.nodes))))
        self.wait_markers(0)
        for r in range(self.nodes):
            assert read_prerestore(self.dirs[r]) == {}
            os.unlink(self.dirs[r] / f"{self.job}-s0-n{r}-w0.restore")

    def write_step(
        self, step: int, *, sizes: Mapping[int, int] | None = None
    ) -> dict[int, dict[str, bytes]]:
        """Every rank's trainer publishes ``step`` (``sizes``: a rank's big array)."""
        sizes = sizes or {}
        files = {
            r: payload(step, seed=f"rank{r}", size=sizes.get(r, 4096)) for r in range(self.nodes)
        }
        for r in range(self.nodes):
            make_step(self.dirs[r], step, files[r])
        return files

    def save(self, step: int, *, copies: bool = True) -> dict[int, dict[str, bytes]]:
        """Every rank saves ``step``; wait until committed at home (and at its peer)."""
        files = self.write_step(step)
        self.wait_saved(step, copies=copies)
        return files

    def wait_saved(
        self, step: int, *, copies: bool = True, ranks: Sequence[int] | None = None
    ) -> None:
        """``ranks`` committed ``step`` at home; with ``copies``, every rank's is at a peer."""
        for r in range(self.nodes) if ranks is None else ranks:
            wait_until(
                lambda r=r: (step, f"{r}-0") in self.held(r),
                f"rank {r} committed step {step}",
                daemon=self.daemon(r),
            )
        if copies:
            wait_until(
                lambda: all(
                    any((step, f"{r}-0") in self.held(h) for h in range(self.nodes) if h != r)
                    for r in range(self.nodes)
                ),
                f"a peer copy of every rank's step {step}",
                daemon=self.daemon(0),
            )

    def wait_backup(self, step: int) -> None:
        wait_until(
            lambda: step in self.committed_backups(),
            f"backup COMMIT of step {step}",
            daemon=self.daemon(0),
            timeout=30,
        )

    def committed_backups(self) -> set[int]:
        """Steps with a COMMIT in the backup, read the way the daemons read it."""
        if self.backup_url == self.backup.as_uri():
            return backup_commits(self.backup, self.job)
        return set(BackupStore(open_object_store(self.backup_url)).committed_steps(self.job))

    def restored(self, rank: int, step: int) -> Path:
        return self.dirs[rank] / f"{self.job}-s{step}-n{rank}-w0.restore"

    def source(self, rank: int) -> str:
        return str(read_prerestore(self.dirs[rank])["restore-source"])

    def errors(self, rank: int) -> str:
        return read_text(self.dirs[rank] / ERRORS)

    def pause(self, rank: int) -> None:
        """SIGSTOP: the daemon keeps its sockets but answers nothing (a stalled node)."""
        os.kill(self.daemon(rank).pid, signal.SIGSTOP)

    def resume(self, rank: int) -> None:
        os.kill(self.daemon(rank).pid, signal.SIGCONT)

    def staged_bytes(self, rank: int) -> int:
        """Bytes of incoming copies in the rank's staging area (a transfer in progress)."""
        staging = store_root(self.dirs[rank]) / "staging"
        if not staging.is_dir():
            return 0
        total = 0
        for path in staging.rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if path.is_file():
                    total += path.stat().st_size
        return total

    def wait_staging(self, rank: int, *, at_least: int = 1, timeout: float = 60.0) -> None:
        """Poll hard until a transfer into ``rank`` has staged ``at_least`` bytes, mid-item."""
        deadline = time.monotonic() + timeout
        while self.staged_bytes(rank) < at_least:
            if time.monotonic() > deadline:
                raise AssertionError(f"no transfer into rank {rank} began in {timeout}s")
            time.sleep(0.001)

    def stop_all(self) -> None:
        for d in self.daemons:
            if d is not None and d.running:
                os.kill(d.pid, signal.SIGCONT)  # a paused daemon would not see SIGTERM
                d.stop()


def assert_restored(cluster: Cluster, step: int, files: dict[int, dict[str, bytes]]) -> None:
    for r in range(cluster.nodes):
        marker = cluster.restored(r, step)
        assert os.path.islink(marker)
        assert not os.path.isabs(os.readlink(marker))
        assert read_tree(marker) == files[r], f"rank {r} restored other bytes"
        assert read_prerestore(cluster.dirs[r])["restore-step"] == step


@contextlib.contextmanager
def running(cluster: Cluster) -> Iterator[Cluster]:
    """Every node's daemon started; at the end stopped, and each node's log tail printed."""
    for r in range(cluster.nodes):
        cluster.start(r)
    try:
        yield cluster
    finally:
        cluster.stop_all()
        for r in range(cluster.nodes):
            log = cluster.root / f"node{r}.log"
            if log.exists():
                print(f"--- node {r} ---\n{log.read_text()[-6000:]}")
