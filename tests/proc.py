"""A process's CPU time and memory from ``/proc``, for the tests and the benchmarks that
measure real daemons (Linux only)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid``, from ``/proc/<pid>/stat``."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def _stat_cpu(stat: Path) -> float:
    # The name in parentheses may hold spaces: the fields are counted after its ')'.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int, key: str = "VmRSS") -> float:
    """A memory figure of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``: the peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User plus system CPU time of each live thread of process ``pid``, by thread id
    (``/proc/<pid>/task/<tid>/stat``); a thread that ends while they are read is left out."""
    found: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found[int(task.name)] = _stat_cpu(task / "stat")
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def system_busy_seconds() -> float:
    """CPU seconds every core of the machine spent busy since boot (``/proc/stat``: all but
    idle and iowait): beside a process's own, what everything else spent meanwhile."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
