"""``mtc demo``: the whole single-node story with real processes, checked end to end.

A real ``mtc-replicator`` daemon watches a RAM-disk directory with a ``file://`` backup; a
PyTorch trainer (``mtc_replicator.demo.trainer``) saves through ``mtc_replicator/client/``. The demo
kills the trainer, resumes it from the local tier, then wipes the RAM disk and resumes from the
backup. Every restore must give bit-identical weights, and every resumed run must end with the same
weights as an uninterrupted run; otherwise the demo exits non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from mtc_replicator.core.storedir import default_store_dir
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs

JOB = "demo"
STEPS = 30
SAVE_EVERY = 5
BACKUP_EVERY = 10


class DemoFailure(Exception):
    pass


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


@dataclass
class Trainer:
    """One run of the training process; its JSON events arrive on stdout."""

    checkpoint_dir: Path
    step_seconds: float
    extra_args: tuple[str, ...] = ()
    """More ``demo.trainer`` flags (``--rank``, ``--nodes``... for the cluster demo)."""
    events: list[dict[str, object]] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None

    def start(self) -> Trainer:
        args = [
            sys.executable, "-m", "mtc_replicator.demo.trainer", "--dir", str(self.checkpoint_dir),
            "--job", JOB, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--backup-interval-steps", str(BACKUP_EVERY), "--step-seconds", str(self.step_seconds),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        return self

    def next_event(self) -> dict[str, object] | None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            return None
        event: dict[str, object] = json.loads(line)
        self.events.append(event)
        return event

    def run_to_end(self) -> None:
        while self.next_event() is not None:
            pass
        assert self.proc is not None
        if self.proc.wait() != 0:
            raise DemoFailure(f"trainer exited with {self.proc.returncode}")

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def first(self, kind: str) -> dict[str, object]:
        for e in self.events:
            if e["event"] == kind:
                return e
        raise DemoFailure(f"trainer never reported {kind!r}: {self.events}")


def throwaway_tls(work: Path, ca: certs.Pair, name: str) -> tuple[str, ...]:
    """A node certificate from the demo's own CA in ``work/tls/NAME``, as daemon flags: the
    demo runs with mutual TLS on, as a cluster should (``mtc certs`` does this for real)."""
    directory = work / "tls" / name
    certs.write_node_files(directory, ca, certs.issue(ca, node=name))
    return certs.daemon_flags(certs.node_files(directory))


class Daemon:
    def __init__(
        self,
        checkpoint_dir: Path,
        backup: Path,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        name: str = "daemon",
    ) -> None:
        self.args = [
            sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir",
            str(checkpoint_dir), "--listen", "127.0.0.1:0", "--backup", backup.as_uri(),
            *extra_args,
        ]  # fmt: skip
        self.log_path = log_path
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                if b"daemon started" in f.read():
                    say(f"{self.name} started (pid {self.proc.pid}), log: {self.log_path}")
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise DemoFailure(f"daemon did not start; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
            say(f"{self.name} stopped (exit code {self.proc.returncode})")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            say(f"{self.name} killed with SIGKILL")


def store_of(checkpoint_dir: Path) -> Path:
    """The daemon's store beside CHECKPOINT_DIR (its default ``--store-dir``)."""
    return Path(default_store_dir(PurePosixPath(checkpoint_dir)))


def wipe(directory: Path) -> None:
    """Empty a RAM disk, as a node reboot would: CHECKPOINT_DIR and the store beside it."""
    for child in directory.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    shutil.rmtree(store_of(directory), ignore_errors=True)


def wait_for_backups(
    backup: Path, quiet_seconds: float = 2.0, timeout: float = 60, want: int | None = None
) -> int:
    """Newest committed backup step, once no new COMMIT appeared for ``quiet_seconds``.

    With ``want``, return as soon as that step (or a newer one) is committed.
    """
    store = BackupStore(FileObjectStore(backup))
    deadline = time.monotonic() + timeout
    last: int | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        steps = store.committed_steps(JOB)
        newest = max(steps) if steps else None
        if want is not None and newest is not None and newest >= want:
            return newest
        if newest != last:
            last, since = newest, time.monotonic()
        elif newest is not None and time.monotonic() - since >= quiet_seconds:
            return newest
        time.sleep(0.2)
    raise DemoFailure("no committed backup appeared")


def check(label: str, got: object, want: object, failures: list[str]) -> None:
    ok = got == want
    say(f"  {'OK  ' if ok else 'FAIL'} {label}: got {got}, expected {want}")
    if not ok:
        failures.append(label)


def ram_disk(workdir: Path, name: str = "ramdisk") -> Path:
    """A new directory on tmpfs: /dev/shm where it exists (a RAM disk without mounting),
    else in ``workdir`` (the daemon then warns it is not in RAM). Made here, as the CSI
    plugin makes CHECKPOINT_DIR on a node: the daemon never creates it."""
    shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp below it, not a fixed name
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=f"mtc-demo-{name}-", dir=shm))
    path = workdir / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def run(workdir: Path | None = None, step_seconds: float = 0.05) -> int:
    from mtc_replicator.demo.trainer import reference_digest

    work = workdir or Path(tempfile.mkdtemp(prefix="mtc-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = ram_disk(work)
    ckpt.mkdir(parents=True, exist_ok=True)
    backup = work / "backup"
    daemon = Daemon(ckpt, backup, work / "daemon.log", throwaway_tls(work, certs.new_ca(), "node"))
    failures: list[str] = []
    say(f"CHECKPOINT_DIR (RAM disk): {ckpt}")
    say(f"backup: {backup.as_uri()}   work dir: {work}")
    want_final = reference_digest(STEPS)
    say(f"reference: {STEPS} uninterrupted steps end with weights {want_final}")
    try:
        daemon.start()

        say("stage 1: fresh start, train and save every 5 steps, kill the trainer after step 15")
        t1 = Trainer(ckpt, step_seconds).start()
        saved: dict[int, str] = {}
        while (e := t1.next_event()) is not None:
            if e["event"] == "saved":
                saved[int(str(e["step"]))] = str(e["digest"])
                say(f"  saved step {e['step']} (weights {e['digest']})")
                if e["step"] == 15:
                    t1.kill()
                    say("  trainer killed with SIGKILL")
                    break
        check("stage 1 started fresh", t1.first("fresh")["event"], "fresh", failures)

        say("stage 2: restart the trainer -> restore from the local RAM-disk tier")
        t2 = Trainer(ckpt, step_seconds).start()
        t2.run_to_end()
        for e in t2.events:
            if e["event"] == "saved":
                saved[int(str(e["step"]))] = str(e["digest"])
        r2 = t2.first("restored")
        check("restored step", r2["step"], max(s for s in saved if s <= 15), failures)
        check("restore source", r2["source"], "local", failures)
        check("restored weights", r2["digest"], saved.get(int(str(r2["step"]))), failures)
        check(
            "final weights vs uninterrupted run", t2.first("done")["digest"], want_final, failures
        )

        wait_for_backups(backup)
        say("stage 3: stop the daemon (its drain backs up the newest step), wipe the RAM disk")
        daemon.stop()
        newest_backup = max(BackupStore(FileObjectStore(backup)).committed_steps(JOB))
        say(f"  newest committed backup: step {newest_backup}")
        wipe(ckpt)
        say(f"  {ckpt} is now empty: {sorted(p.name for p in ckpt.iterdir())}")
        daemon.start()
        t3 = Trainer(ckpt, step_seconds).start()
        t3.run_to_end()
        r3 = t3.first("restored")
        check("restored step", r3["step"], newest_backup, failures)
        check("restore source", r3["source"], "backup", failures)
        check("restored weights", r3["digest"], saved.get(newest_backup), failures)
        check(
            "final weights vs uninterrupted run", t3.first("done")["digest"], want_final, failures
        )
    except DemoFailure as exc:
        failures.append(str(exc))
        say(f"FAILED: {exc}")
    finally:
        daemon.stop()
        if workdir is None and not failures:
            shutil.rmtree(work, ignore_errors=True)
        if not failures:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(store_of(ckpt), ignore_errors=True)
    if failures:
        say(f"FAILED checks: {failures}; logs in {work}")
        return 1
    say("all checks passed: every restore was bit-identical, from the local tier and the backup")
    return 0
