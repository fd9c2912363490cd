"""The client's handshake against a small in-test daemon that follows docs/protocol.md."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypedDict

import pytest
import yaml

from mtc_replicator.client import (
    ConfigError,
    Framework,
    HandshakeError,
    HandshakeTimeout,
    JobConfig,
    RenameStyle,
    ReplicatorFailed,
    RestorePlan,
    RestoreResult,
    await_restore,
    handshake,
    job_config,
    plan_restore,
    publish_config,
)
from mtc_replicator.core import contract


class Fast(TypedDict):
    poll_interval: float
    timeout: float


FAST: Fast = {"poll_interval": 0.001, "timeout": 10.0}
"""Real time, short polls: a passing test takes milliseconds, a broken one fails in 10 s."""

JOB = "llama"


def config(rank: int = 0, workers: int = 1, job: str = JOB) -> JobConfig:
    return job_config(
        job_name=job,
        framework=Framework.PYTORCH_DISTRIBUTED,
        node_rank=rank,
        nodes=4,
        peer_ranks=[(rank + 1) % 4],
        workers_per_node=workers,
    )


class FakeClock:
    """A clock that only moves when the code under test sleeps: timeouts cost no time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


# --- The daemon's side, as docs/protocol.md describes it -----------------------------------------


def store_step(ckpt: Path, step: int, rank: int = 0, worker: int = 0, job: str = JOB) -> str:
    """A complete item in the daemon's hidden store; returns the marker's RELATIVE target."""
    rel = f"{contract.STORE_DIR}/{job}/{step}/n{rank}-w{worker}"
    (ckpt / rel).mkdir(parents=True)
    (ckpt / rel / "payload").write_text(f"step {step} rank {rank} worker {worker}")
    return rel


def restore_marker(
    ckpt: Path, step: int, rank: int = 0, worker: int = 0, job: str = JOB
) -> tuple[Path, str]:
    target = store_step(ckpt, step, rank, worker, job)
    marker = ckpt / contract.marker_name(job, step, rank, worker)
    os.symlink(target, marker)
    return marker, target


def empty_marker(ckpt: Path, rank: int = 0, worker: int = 0, job: str = JOB) -> Path:
    marker = ckpt / contract.marker_name(job, 0, rank, worker)
    marker.touch()
    return marker


def write_prerestore(ckpt: Path, data: dict[str, object]) -> None:
    tmp = ckpt / (contract.PRERESTORE_FILE + ".tmp")
    tmp.write_text(yaml.safe_dump(data))
    os.replace(tmp, ckpt / contract.PRERESTORE_FILE)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


Action = Callable[[Path, JobConfig], None]


class FakeDaemon:
    """Consumes one ``replicator.yaml`` the way the daemon does, on a thread.

    ``before_delete`` runs after parsing and before deleting the yaml (where the daemon
    writes ``replicator.failed``); ``after_delete`` runs after it (prerestore, markers).
    """

    def __init__(self, ckpt: Path, before_delete: Action | None, after_delete: Action | None):
        self.ckpt = ckpt
        self.before_delete = before_delete
        self.after_delete = after_delete
        self.configs: list[JobConfig] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fake-daemon", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            path = self.ckpt / contract.CONFIG_FILE
            while not self.stop.is_set():
                if path.exists():
                    cfg = contract.parse_config(path.read_text())
                    self.configs.append(cfg)
                    if self.before_delete:
                        self.before_delete(self.ckpt, cfg)
                    path.unlink()
                    if self.after_delete:
                        self.after_delete(self.ckpt, cfg)
                    return
                self.stop.wait(0.0005)
        except BaseException as exc:
            self.error = exc


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


@pytest.fixture
def daemon(ckpt: Path) -> Iterator[Callable[..., FakeDaemon]]:
    started: list[FakeDaemon] = []

    def start(
        before_delete: Action | None = None, after_delete: Action | None = None
    ) -> FakeDaemon:
        d = FakeDaemon(ckpt, before_delete, after_delete)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop.set()
        d.thread.join(timeout=10)
        assert not d.thread.is_alive(), "fake daemon thread leaked"
        if d.error is not None:
            raise d.error


# --- End to end against the fake daemon ------------------------------------------------------


def test_fresh_start_returns_none_and_deletes_the_empty_marker(
    ckpt: Path, daemon: Callable[..., FakeDaemon]
) -> None:
    def nothing_to_restore(ckpt: Path, cfg: JobConfig) -> None:
        write_prerestore(ckpt, {})
        empty_marker(ckpt)

    d = daemon(after_delete=nothing_to_restore)
    cfg = config()

    result = handshake(ckpt, cfg, **FAST)

    assert result == RestoreResult(step=None, path=None, source=None)
    assert d.configs == [cfg]  # What we wrote parses back to exactly our config.
    assert os.listdir(ckpt) == [contract.PRERESTORE_FILE]  # Marker gone, nothing renamed.


@pytest.mark.parametrize(("rename", "name"), [("orbax", "200"), ("step", "step=200")])
def test_restore_renames_the_highest_marker_and_deletes_the_others(
    ckpt: Path, daemon: Callable[..., FakeDaemon], rename: RenameStyle, name: str
) -> None:
    targets: dict[int, str] = {}

    def restore(ckpt: Path, cfg: JobConfig) -> None:
        write_prerestore(ckpt, {"restore-step": 200, "restore-source": "peer"})
        for step in (100, 200, 30):
            _, targets[step] = restore_marker(ckpt, step)

    # All markers are in place before the yaml goes: the client sees them together, as when
    # an older daemon left several (a protocol-following one creates exactly one).
    daemon(before_delete=restore)

    result = handshake(ckpt, config(), rename=rename, **FAST)

    assert result == RestoreResult(step=200, path=ckpt / name, source="peer")
    assert result.path is not None
    assert result.path.is_symlink()
    assert os.readlink(result.path) == targets[200]  # Still relative, not resolved.
    assert (result.path / "payload").read_text() == "step 200 rank 0 worker 0"
    assert not [n for n in os.listdir(ckpt) if n.endswith(".restore")]


def test_errors_are_logged_line_by_line_and_deleted(
    ckpt: Path, daemon: Callable[..., FakeDaemon], caplog: pytest.LogCaptureFixture
) -> None:
    errors = ckpt / contract.ERRORS_FILE

    def complain_then_restore(ckpt: Path, cfg: JobConfig) -> None:
        write_atomically(errors, "rank 2 has not joined the restore round\nbackup is slow\n")
        # Markers only after the client took the errors: it must poll for them meanwhile.
        while errors.exists():
            threading.Event().wait(0.0005)
        write_prerestore(ckpt, {"restore-step": 5, "restore-source": "local"})
        restore_marker(ckpt, 5)

    daemon(after_delete=complain_then_restore)
    caplog.set_level(logging.WARNING, logger="mtc_replicator.client.handshake")

    result = handshake(ckpt, config(), **FAST)

    assert result.step == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("rank 2 has not joined the restore round" in m for m in warnings)
    assert any("backup is slow" in m for m in warnings)
    assert not errors.exists()
    assert not [n for n in os.listdir(ckpt) if n.startswith(contract.ERRORS_FILE)]


def test_failed_raises_with_its_text_and_is_deleted(
    ckpt: Path, daemon: Callable[..., FakeDaemon]
) -> None:
    text = "replicator.yaml: 'nodes' = 0 is invalid: must be >= 1\n"

    def reject(ckpt: Path, cfg: JobConfig) -> None:
        write_atomically(ckpt / contract.FAILED_FILE, text)

    daemon(before_delete=reject)

    with pytest.raises(ReplicatorFailed, match="'nodes' = 0 is invalid") as info:
        handshake(ckpt, config(), **FAST)

    assert info.value.text == text
    assert not (ckpt / contract.FAILED_FILE).exists()


def test_timeout_when_the_yaml_is_never_consumed(ckpt: Path) -> None:
    clock = FakeClock()
    cfg = config()

    with pytest.raises(HandshakeTimeout, match="not consumed within 300 s") as info:
        handshake(ckpt, cfg, timeout=300, poll_interval=1.0, clock=clock, sleep=clock.sleep)

    assert isinstance(info.value, TimeoutError)
    assert clock.now >= 300
    # The config was published, atomically: no temp file, and it parses back.
    assert not (ckpt / contract.CONFIG_TMP_FILE).exists()
    assert contract.parse_config((ckpt / contract.CONFIG_FILE).read_text()) == cfg


def test_timeout_when_no_marker_for_this_worker_appears(ckpt: Path) -> None:
    restore_marker(ckpt, 7, rank=1)  # Another rank's: it must not satisfy us.
    clock = FakeClock()

    with pytest.raises(HandshakeTimeout, match="no restore marker llama-s<N>-n0-w0") as info:
        await_restore(ckpt, config(), timeout=300, clock=clock, sleep=clock.sleep)

    assert "llama-s7-n1-w0.restore" in str(info.value)
    assert (ckpt / "llama-s7-n1-w0.restore").is_symlink()


def test_a_pending_yaml_of_an_earlier_incarnation_is_not_overwritten(ckpt: Path) -> None:
    stale = ckpt / contract.CONFIG_FILE
    stale.write_text("job-name: other\n")
    clock = FakeClock()

    with pytest.raises(HandshakeTimeout):
        publish_config(ckpt, config(), timeout=5, clock=clock, sleep=clock.sleep)

    assert stale.read_text() == "job-name: other\n"


def test_worker_1_waits_for_its_own_marker_without_writing_the_yaml(
    ckpt: Path, daemon: Callable[..., FakeDaemon]
) -> None:
    cfg = config(workers=2)

    def restore(ckpt: Path, cfg: JobConfig) -> None:
        write_prerestore(ckpt, {"restore-step": 40})
        for worker in range(cfg.workers_per_node):
            restore_marker(ckpt, 40, worker=worker)

    d = daemon(after_delete=restore)
    results: dict[int, RestoreResult | BaseException] = {}

    def run(worker: int) -> None:
        try:
            results[worker] = handshake(ckpt, cfg, worker=worker, **FAST)  # Only w0 writes.
        except BaseException as exc:
            results[worker] = exc

    threads = [threading.Thread(target=run, args=(w,)) for w in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)

    assert len(d.configs) == 1  # Only worker 0 wrote a config.
    for worker in (0, 1):
        path = ckpt / f"40-w{worker}"  # Both cannot become "40".
        assert results[worker] == RestoreResult(step=40, path=path, source=None)
        assert os.readlink(path) == f"{contract.STORE_DIR}/{JOB}/40/n0-w{worker}"


def test_worker_1_tolerates_the_yaml_being_gone_already(ckpt: Path) -> None:
    _, target = restore_marker(ckpt, 9, worker=1)
    restore_marker(ckpt, 9, worker=0)

    result = handshake(ckpt, config(workers=2), worker=1, **FAST)

    assert result == RestoreResult(step=9, path=ckpt / "9-w1", source=None)
    assert os.readlink(ckpt / "9-w1") == target
    assert (ckpt / "llama-s9-n0-w0.restore").is_symlink()  # Worker 0's is left alone.


def test_markers_of_other_jobs_ranks_and_workers_are_ignored(ckpt: Path) -> None:
    others = [
        restore_marker(ckpt, 300, job="other")[0],
        restore_marker(ckpt, 300, rank=1)[0],
        restore_marker(ckpt, 300, worker=1)[0],
    ]
    (ckpt / "not-a-marker.restore").touch()
    _, target = restore_marker(ckpt, 100)

    result = await_restore(ckpt, config(workers=1), **FAST)

    assert result.step == 100
    assert os.readlink(ckpt / "100") == target
    assert all(p.is_symlink() for p in others)


def test_handshake_takes_the_config_as_keywords(
    ckpt: Path, daemon: Callable[..., FakeDaemon]
) -> None:
    d = daemon(after_delete=lambda ckpt, cfg: empty_marker(ckpt, rank=cfg.node_rank))

    result = handshake(
        ckpt,
        job_name=JOB,
        framework="pytorch",
        node_rank=2,
        nodes=4,
        peers_per_node=1,
        backup_interval_steps=50,
        **FAST,
    )

    assert result.step is None
    (cfg,) = d.configs
    assert (cfg.framework, cfg.node_rank, cfg.peers_per_node) == (Framework.PYTORCH, 2, 1)
    assert cfg.backup_interval.steps == 50


def test_an_invalid_config_fails_in_the_job_before_anything_is_written(ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="node-rank"):
        handshake(ckpt, job_name=JOB, framework="orbax", node_rank=4, nodes=4, **FAST)
    bad = JobConfig(job_name="../etc", framework=Framework.ORBAX, node_rank=0, nodes=1)
    with pytest.raises(ConfigError, match="job-name"):
        handshake(ckpt, bad, **FAST)
    assert os.listdir(ckpt) == []


def test_bad_arguments_are_rejected_at_once(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="worker"):
        handshake(ckpt, config(workers=2), worker=2, **FAST)
    with pytest.raises(ValueError, match="rename"):
        handshake(ckpt, config(), rename="nemo", **FAST)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not both"):
        handshake(ckpt, config(), nodes=2, **FAST)
    with pytest.raises(FileNotFoundError, match="mounted"):
        handshake(ckpt / "missing", config(), **FAST)
    assert os.listdir(ckpt) == []


def test_a_real_directory_in_the_way_gives_a_clear_error(ckpt: Path) -> None:
    (ckpt / "12").mkdir()
    (ckpt / "12" / "data").touch()
    marker, _ = restore_marker(ckpt, 12)

    with pytest.raises(HandshakeError, match="move away"):
        await_restore(ckpt, config(), **FAST)

    assert marker.is_symlink()


def test_a_stale_renamed_marker_is_replaced(ckpt: Path) -> None:
    os.symlink(".mtc/llama/old", ckpt / "12")
    _, target = restore_marker(ckpt, 12)

    result = await_restore(ckpt, config(), **FAST)

    assert result.path == ckpt / "12"
    assert os.readlink(ckpt / "12") == target


@pytest.mark.parametrize(
    ("prerestore", "source"),
    [
        ({"restore-step": 3, "restore-source": "backup"}, "backup"),
        ({"restore-step": 3, "restore-backup": "2025-01-01_00-00"}, "backup"),
        ({"restore-step": 3}, None),
        ({"restore-step": "²", "restore-source": "local"}, "local"),
        (None, None),
    ],
)
def test_source_comes_from_the_prerestore_file(
    ckpt: Path, prerestore: dict[str, object] | None, source: str | None
) -> None:
    if prerestore is not None:
        write_prerestore(ckpt, prerestore)
    restore_marker(ckpt, 3)

    assert await_restore(ckpt, config(), **FAST).source == source


# --- The pure decision ---------------------------------------------------------------------


def marker(step: int, rank: int = 0, worker: int = 0, job: str = JOB) -> str:
    return contract.marker_name(job, step, rank, worker)


@pytest.mark.parametrize(
    ("markers", "expected"),
    [
        ([], None),
        ([(marker(5, rank=1), False), (marker(5, job="x"), False)], None),
        ([(marker(0), True)], RestorePlan(step=None, chosen=None, stale=(marker(0),))),
        (
            [(marker(0), True), (marker(8), False), (marker(10), False)],
            RestorePlan(step=10, chosen=marker(10), stale=(marker(8), marker(0))),
        ),
        # A step-0 symlink is a real checkpoint of step 0, as Orbax reads it.
        ([(marker(0), False)], RestorePlan(step=0, chosen=marker(0), stale=())),
        ([("garbage.restore", False), (marker(4), False)], RestorePlan(4, marker(4), ())),
    ],
)
def test_plan_restore(markers: list[tuple[str, bool]], expected: RestorePlan | None) -> None:
    assert plan_restore(markers, job=JOB, rank=0, worker=0) == expected


def test_job_config_validates_like_the_daemon() -> None:
    cfg = job_config(job_name=JOB, framework="orbax", node_rank="1", nodes=2, peer_ranks=(0,))  # type: ignore[arg-type]
    assert (cfg.node_rank, cfg.peer_ranks) == (1, (0,))
    with pytest.raises(ConfigError, match="peer-ranks"):
        job_config(job_name=JOB, framework="orbax", node_rank=1, nodes=2, peer_ranks=[1])
    with pytest.raises(TypeError, match="unexpected keyword"):
        job_config(job_name=JOB, framework="orbax", node_rank=0, nodes=1, color=1)  # type: ignore[call-arg]


def test_importing_the_client_pulls_in_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # As if torch were not installed.
        "import mtc_replicator.client\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in"
        " ('grpc', 'inotify_simple', 'google', 'boto3', 'botocore', 'numpy')]\n"
        "assert not heavy, heavy\n"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
