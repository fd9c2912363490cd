"""Small helpers for the integration tests: the workload's side of the file contract.

Each helper does what a training job (or an operator) does to CHECKPOINT_DIR, or reads what
the daemon published there. Waiting is always polling against a deadline, never a bare
sleep used as an assertion.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import pytest
import yaml

from mtc_replicator.core.storedir import default_store_dir
from tests.daemon_process import DaemonProcess

T = TypeVar("T")

CONFIG = "replicator.yaml"
PRERESTORE = "replicator.prerestore"
ERRORS = "replicator.errors"
FAILED = "replicator.failed"
TIMEOUT = 20.0
"""Generous for a loaded 2-core box; a passing wait returns as soon as the state is reached."""


FAST_ARGS = (
    "--settle-seconds",
    "0.5",
    "--config-wait-seconds",
    "1.5",
    "--rescan-seconds",
    "0.3",
)
"""Short timers so the suite stays fast; each test that depends on one says so."""


# --- RAM disks and daemons ---------------------------------------------------------------------


def mount_tmpfs(path: Path, size: str) -> bool:
    """Mount a size-limited tmpfs like the CSI driver does; False when we may not."""
    if os.geteuid() != 0:
        return False
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def unmount(path: Path) -> None:
    proc = subprocess.run(["umount", str(path)], capture_output=True, check=False)
    if proc.returncode != 0:
        # Something still holds it (a leaked process); detach so the next test is unaffected.
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def ram_disk(path: Path, size: str = "256m") -> Iterator[Path]:
    """A fresh RAM disk at ``path`` (a tmpfs when we are root, else a directory), laid out as
    in production: CHECKPOINT_DIR is ``path/checkpoint``, yielded, and the daemon's store
    its sibling on the same filesystem."""
    path.mkdir(parents=True)
    mounted = mount_tmpfs(path, size)
    try:
        (path / "checkpoint").mkdir()
        yield path / "checkpoint"
    finally:
        if mounted:
            unmount(path)


@contextlib.contextmanager
def running_daemon(
    ckpt: Path, *, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[DaemonProcess]:
    """A real daemon on ``ckpt`` with the fast timers (and ``env`` added to its
    environment); stopped (or killed) on exit, and its log printed so a failing test shows
    what the daemon did."""
    daemon = DaemonProcess(ckpt, extra_args=(*FAST_ARGS, *extra), env=env or {})
    try:
        yield daemon.start()
    finally:
        if daemon.running:
            with contextlib.suppress(subprocess.TimeoutExpired):  # stop() killed it
                daemon.stop(timeout=10)
        print(f"--- daemon log {daemon.log_path} ---\n{daemon.log()[-20000:]}")


RECEIVER: dict[str, Any] = {"rank": 1, "nodes": 2, "peers_per_node": 1}
"""``config_text`` keys for a daemon that tests push rank 0's items to: in this layout rank 0
replicates to rank 1 (a one-node job takes no pushes, and nobody pushes a node its own rank).
Such a daemon waits in its restore round for the whole test (no rank 0 ever registers), so
it needs ``receiver_args``."""


def receiver_args(ckpt: Path) -> tuple[str, ...]:
    """Daemon flags for a ``RECEIVER``: a registry of its own to wait in, beside ``ckpt``."""
    registry = ckpt.parent / f"{ckpt.name}-registry"
    registry.mkdir(exist_ok=True)
    return ("--registry", registry.as_uri(), "--report-after-seconds", "3600")


# --- waiting ---------------------------------------------------------------------------------


def _log_tail(daemon: DaemonProcess | None) -> str:
    return f"\n--- daemon log (tail) ---\n{daemon.log()[-6000:]}" if daemon else ""


def wait_until(
    predicate: Callable[[], T],
    what: str,
    *,
    daemon: DaemonProcess | None = None,
    timeout: float = TIMEOUT,
    interval: float = 0.02,
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with the daemon's log."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}{_log_tail(daemon)}")
        time.sleep(interval)


def holds(
    predicate: Callable[[], object],
    what: str,
    seconds: float,
    *,
    daemon: DaemonProcess | None = None,
    interval: float = 0.02,
) -> None:
    """Assert ``predicate`` stays truthy for ``seconds`` (checked on every poll)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            pytest.fail(f"expected {what} to hold for {seconds}s, it did not{_log_tail(daemon)}")
        time.sleep(interval)


# --- the handshake ---------------------------------------------------------------------------


def config_text(
    job: str, *, framework: str = "orbax", rank: int = 0, nodes: int = 1, **keys: Any
) -> str:
    """A ``replicator.yaml`` body; keyword ``backup_interval_steps=1`` becomes the dashed key."""
    lines = [
        f"job-name: {job}",
        f"framework: {framework}",
        f"node-rank: {rank}",
        f"nodes: {nodes}",
    ]
    for key, value in keys.items():
        lines.append(f"{key.replace('_', '-')}: {value}")
    return "\n".join(lines) + "\n"


def write_yaml_atomic(ckpt: Path, text: str) -> None:
    """How Orbax/MaxText write the handshake: ``replicator.yaml.tmp`` then one rename."""
    tmp = ckpt / f"{CONFIG}.tmp"
    tmp.write_text(text)
    os.rename(tmp, ckpt / CONFIG)


def write_yaml_in_place(
    ckpt: Path, text: str, *, split: int | None = None, pause: float = 0.3
) -> None:
    """How the PyTorch reference writes it: in place, so the daemon can read a partial file."""
    cut = len(text) // 2 if split is None else split
    with open(ckpt / CONFIG, "w") as f:
        f.write(text[:cut])
        f.flush()
        time.sleep(pause)  # the writer is slow; the daemon sees the half meanwhile
        f.write(text[cut:])


def marker_names(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".restore"))


def expected_markers(job: str, step: int, workers: int = 1, rank: int = 0) -> list[str]:
    return sorted(f"{job}-s{step}-n{rank}-w{w}.restore" for w in range(workers))


def wait_markers(
    ckpt: Path, job: str, step: int, daemon: DaemonProcess, *, workers: int = 1
) -> list[Path]:
    """Wait for this node's markers of ``step``; they must be the only ``*.restore`` names.

    The yaml goes only after the stale markers of an earlier handshake were cleaned up, so
    once it is gone every marker seen is from this handshake.
    """
    want = expected_markers(job, step, workers)
    wait_until(lambda: not (ckpt / CONFIG).exists(), f"{CONFIG} accepted", daemon=daemon)
    wait_until(
        lambda: all(os.path.lexists(ckpt / n) for n in want),
        f"markers {want}",
        daemon=daemon,
    )
    assert marker_names(ckpt) == want, f"other markers present: {marker_names(ckpt)}"
    return [ckpt / n for n in want]


def read_prerestore(ckpt: Path) -> Any:
    return yaml.safe_load((ckpt / PRERESTORE).read_text())


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


# --- saving like a workload ------------------------------------------------------------------


def _random_bytes(rng: random.Random, size: int) -> bytes:
    """``size`` seeded bytes; a big array repeats a 1 MiB block (randbytes caps at 256 MiB)."""
    if size <= 1 << 24:
        return rng.randbytes(size)
    block = rng.randbytes(1 << 20)
    return block * (size >> 20) + block[: size & ((1 << 20) - 1)]


def payload(step: int, *, seed: str = "", size: int = 4096) -> dict[str, bytes]:
    """A small Orbax-shaped step: metadata, a nested state file, an empty dir's sibling."""
    rng = random.Random(f"{seed}/{step}")
    return {
        "_CHECKPOINT_METADATA": f'{{"step": {step}, "seed": "{seed}"}}'.encode(),
        "process_metadata/process_index.json": b"0",
        "state/array_0.bin": _random_bytes(rng, size),
        "state/array_1.bin": rng.randbytes(size // 3 + 1),
        "state/empty.bin": b"",
    }


def make_step(ckpt: Path, step: int, files: Mapping[str, bytes]) -> Path:
    """Write a step into ``<N>.orbax-checkpoint-tmp-*/`` then publish it with one rename."""
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-{uuid.uuid4().hex[:8]}"
    for rel, data in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    final = ckpt / str(step)
    os.rename(tmp, final)
    return final


def write_big_step_tmp(
    ckpt: Path, step: int, files: int, mib_each: int
) -> tuple[Path, dict[str, str]]:
    """A large unpublished step dir; returns it and the sha256 of each file."""
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-{uuid.uuid4().hex[:8]}"
    (tmp / "state").mkdir(parents=True)
    (tmp / "_CHECKPOINT_METADATA").write_bytes(f'{{"step": {step}}}'.encode())
    block = random.Random(step).randbytes(1 << 20)
    for i in range(files):
        with open(tmp / "state" / f"shard_{i}.bin", "wb") as f:
            for j in range(mib_each):
                # Different bytes in every MiB, cheaply: a counter prefix on one random block.
                f.write(j.to_bytes(8, "little") + block[8:])
    return tmp, sha256_tree(tmp)


def read_tree(root: Path) -> dict[str, bytes]:
    """Every regular file below ``root`` (followed if it is a symlink), by relative path."""
    out: dict[str, bytes] = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            full = Path(dirpath) / name
            out[str(full.relative_to(root))] = full.read_bytes()
    return out


def sha256_tree(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            full = Path(dirpath) / name
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[str(full.relative_to(root))] = h.hexdigest()
    return out


# --- the daemon's side -----------------------------------------------------------------------


def store_root(ckpt: Path) -> Path:
    """The daemon's store of ``ckpt`` when ``--store-dir`` is not given (outside ``ckpt``)."""
    return Path(default_store_dir(PurePosixPath(ckpt)))


def item_dir(ckpt: Path, job: str, step: int, rank: int = 0, worker: int = 0) -> Path:
    return store_root(ckpt) / "items" / job / str(step) / f"{rank}-{worker}"


def stored_steps(ckpt: Path, job: str, rank: int = 0, worker: int = 0) -> set[int]:
    """Steps with a committed item (``MANIFEST.json`` present) for this rank and worker."""
    root = store_root(ckpt) / "items" / job
    if not root.is_dir():
        return set()
    return {
        int(p.name)
        for p in root.iterdir()
        if p.name.isdigit() and (p / f"{rank}-{worker}" / "MANIFEST.json").is_file()
    }


def top_level_step_dirs(ckpt: Path) -> set[int]:
    """Real ``<N>/`` directories the workload published and the daemon has not taken yet."""
    return {
        int(p.name)
        for p in ckpt.iterdir()
        if p.name.isdigit() and p.is_dir() and not p.is_symlink()
    }


def wait_ingested(ckpt: Path, job: str, step: int, daemon: DaemonProcess) -> Path:
    """``<N>/`` gone from the top level and committed in the store; the item's data path."""
    wait_until(
        lambda: step not in top_level_step_dirs(ckpt) and step in stored_steps(ckpt, job),
        f"step {step} ingested",
        daemon=daemon,
    )
    return item_dir(ckpt, job, step) / "data"


def backup_commits(backup: Path, job: str) -> set[int]:
    root = backup / job
    if not root.is_dir():
        return set()
    return {int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "COMMIT").is_file()}


def ingested_order(daemon: DaemonProcess, job: str) -> list[int]:
    """Steps in the order the daemon's log says it ingested them."""
    pattern = re.compile(rf"ingested {re.escape(job)}/s(\d+)/n\d+-w\d+:")
    return [int(m.group(1)) for m in pattern.finditer(daemon.log())]
