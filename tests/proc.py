"""A process's CPU time and memory from ``/proc``, for the tests and the benchmarks that
measure real daemons (Linux only)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid``, from ``/proc/<pid>/stat``."""
    # The name in parentheses may hold spaces: the fields are counted after its ')'.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int, key: str = "VmRSS") -> float:
    """A memory figure of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``: the peak) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)
