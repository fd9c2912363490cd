"""The real daemons of a chaos trial: a cluster with a RAM disk and a network per node,
the storage servers the trials share, and a meter of each daemon's CPU and log growth.

Does I/O (processes, tmpfs mounts, /proc).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path

from tests.chaos import network
from tests.daemon_process import DaemonProcess
from tests.integration.cluster import FAST, NODES, Cluster
from tests.integration.helpers import mount_tmpfs, unmount
from tests.storage_servers import ServerProcess, free_port, start_gcs_emulator, start_moto

NODE_RAM = "64m"
GRPC_PORT = 7070
"""Every node's gRPC port in its own network namespace (its data port is the next)."""


class Servers:
    """moto and the GCS emulator, started once and shared by the trials of one run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._moto: ServerProcess | None = None
        self._gcs: ServerProcess | None = None

    def upstream(self, vendor: str) -> str:
        if vendor == "s3":
            if self._moto is None:
                self._moto = start_moto(self.log_dir)
            return self._moto.url
        if self._gcs is None:
            self._gcs = start_gcs_emulator(self.log_dir)
        return self._gcs.url

    def close(self) -> None:
        for server in (self._moto, self._gcs):
            if server is not None:
                server.stop()


class ChaosCluster(Cluster):
    """The integration suite's cluster, with a RAM disk per node and a network per node."""

    def __init__(self, root: Path, job: str, net: network.Network | None) -> None:
        super().__init__(root, job)
        self.net = net
        self.mounts: list[Path] = []
        # Fixed ports, as a DaemonSet's: a restarted daemon is where its peers last saw it.
        self.ports = [
            (GRPC_PORT, GRPC_PORT + 1) if net else (free_port(), free_port()) for _ in range(NODES)
        ]
        for r in range(NODES):
            ram = root / f"ram{r}"
            ram.mkdir()
            if mount_tmpfs(ram, NODE_RAM):
                self.mounts.append(ram)
            self.dirs[r] = ram / "ckpt"
            self.dirs[r].mkdir()

    def start(self, rank: int) -> DaemonProcess:
        tls = self.tls[rank]
        assert tls is not None
        daemon = DaemonProcess(
            self.dirs[rank],
            backup=self.backup_url,
            extra_args=(*FAST, *tls.args(), "--data-port", str(self.ports[rank][1]), *self.extra),
            env={**self.env, **self.node_env.get(rank, {})},
            log_path=self.log(rank),
            prefix=self.net.prefix(rank) if self.net else (),
            listen=f"{self.net.address(rank) if self.net else '127.0.0.1'}:{self.ports[rank][0]}",
        )
        self.daemons[rank] = daemon.start(timeout=60)
        return daemon

    def log(self, rank: int) -> Path:
        return self.root / f"node{rank}.log"

    def start_all(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(NODES) as pool:
            list(pool.map(self.start, range(NODES)))

    def kill_all(self) -> None:
        for d in self.daemons:
            if d is not None and d.running:
                d.kill()

    def close(self) -> None:
        for ram in self.mounts:
            unmount(ram)


def _cpu(pid: int) -> tuple[int, int] | None:
    """(utime + stime, start time) of a process, in clock ticks; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[11]) + int(fields[12]), int(fields[19])


def _uptime_ticks() -> float:
    return float(Path("/proc/uptime").read_text().split()[0]) * Meter.TICKS


class Meter:
    """CPU (from /proc) and log growth of each node's daemon since ``reset``; a daemon
    restarted since is measured from its own start."""

    TICKS = os.sysconf("SC_CLK_TCK")

    def __init__(self, cluster: ChaosCluster) -> None:
        self.cluster = cluster
        self.reset()

    def _sample(self) -> dict[int, tuple[int, tuple[int, int] | None, int]]:
        out = {}
        for r in range(NODES):
            d = self.cluster.daemons[r]
            pid = d.pid if d is not None and d.running else -1
            log = self.cluster.log(r)
            size = log.stat().st_size if log.exists() else 0
            out[r] = (pid, _cpu(pid) if pid > 0 else None, size)
        return out

    def reset(self) -> None:
        self.t0 = time.monotonic()
        self.s0 = self._sample()

    def read(self) -> dict[int, tuple[float, int]]:
        """Per rank: share of a core (NaN when no daemon runs) and log bytes written."""
        elapsed = max(time.monotonic() - self.t0, 1e-3)
        out = {}
        for r, (pid, cpu, size) in self._sample().items():
            pid0, cpu0, size0 = self.s0[r]
            share = float("nan")
            if cpu is not None and pid == pid0 and cpu0 is not None:
                share = (cpu[0] - cpu0[0]) / self.TICKS / elapsed
            elif cpu is not None:  # restarted meanwhile: since its start
                age = max(_uptime_ticks() - cpu[1], 1.0)
                share = cpu[0] / age
            out[r] = (share, size - size0)
        return out

    def describe(self) -> str:
        return ", ".join(
            f"rank {r}: {cpu:.0%} of a core, log +{grown} B"
            for r, (cpu, grown) in self.read().items()
        )
