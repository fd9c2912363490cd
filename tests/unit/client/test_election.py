"""Several processes per node: which one runs the handshake (``client.election``), how the
others get its result whichever starts first, and the saves only local rank 0 may make.

The handshake runs against the small in-test daemon of ``test_handshake``; the launch key
is read from this machine's real ``/proc`` in subprocesses. Eight real processes against a
real daemon: ``tests/integration/test_multiprocess_node.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mtc_replicator.client import (
    HandshakeError,
    HandshakeTimeout,
    JobConfig,
    NotLocalRankZero,
    ReplicatorFailed,
    RestoreResult,
    election,
    handshake,
    save_file,
    save_state_dict,
)
from mtc_replicator.client.election import (
    LaunchUnknown,
    LocalRank,
    SharedResult,
    launch_key,
    local_rank,
    parse_result,
    render_result,
    start_time,
)
from mtc_replicator.core import contract
from tests.unit.client.test_handshake import (
    FAST,
    FakeClock,
    FakeDaemon,
    config,
    restore_marker,
    write_atomically,
    write_prerestore,
)

LAUNCHER = (*election.LOCAL_RANK_VARIABLES, "MTC_LAUNCH_ID", "RAY_RAYLET_PID")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says itself which launcher it runs under."""
    for name in (*LAUNCHER, election.RESTART_COUNT_VARIABLE):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    return directory


@pytest.fixture
def fake_daemons(ckpt: Path) -> Iterator[list[FakeDaemon]]:
    started: list[FakeDaemon] = []
    yield started
    for d in started:
        d.stop.set()
        d.thread.join(timeout=10)
        assert not d.thread.is_alive(), "fake daemon thread leaked"
        if d.error is not None:
            raise d.error


def shared(cfg: JobConfig, launch: str = "id:run-1", **fields: object) -> SharedResult:
    return SharedResult(launch, contract.render_config(cfg), **fields)  # type: ignore[arg-type]


# --- the pure parts ----------------------------------------------------------------------------


def test_the_local_rank_comes_from_the_first_launcher_variable_set() -> None:
    assert local_rank({}) is None
    assert local_rank({"LOCAL_RANK": " "}) is None
    assert local_rank({"SLURM_LOCALID": "3"}) == LocalRank(3, "SLURM_LOCALID")
    # torchrun under srun: torchrun's own numbering wins.
    both = {"SLURM_LOCALID": "0", "LOCAL_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert local_rank(both) == LocalRank(5, "LOCAL_RANK")
    assert local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == LocalRank(
        2, "OMPI_COMM_WORLD_LOCAL_RANK"
    )


@pytest.mark.parametrize("value", ["-1", "one", "1.0", "²"])
def test_a_local_rank_that_is_not_one_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match=f"LOCAL_RANK={value!r} is not a local rank"):
        local_rank({"LOCAL_RANK": value})


def test_the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(str(n) for n in range(3, 30))  # field 3 (state) onwards; 22 is "22"
    assert start_time(f"1234 (torch run (x) 1) {fields}") == 22


PARENT_STAT = "77 (torchrun) S " + " ".join(["0"] * 18) + " 5555 rest"


def test_a_launch_is_its_parent_and_torchruns_restart_count() -> None:
    def key(env: dict[str, str], parent: int = 77, stat: str = PARENT_STAT) -> str:
        return launch_key(env, parent=parent, parent_stat=stat, boot_id="b")

    assert key({}) == key({}) == "parent:b:77:5555:-"
    assert key({"TORCHELASTIC_RESTART_COUNT": "1"}) != key({"TORCHELASTIC_RESTART_COUNT": "0"})
    assert key({}, parent=78) != key({})
    assert key({}, stat=PARENT_STAT.replace("5555", "5556")) != key({})  # a pid reused
    assert key({"MTC_LAUNCH_ID": "run-7"}) == "id:run-7"
    explicit = launch_key(
        {"MTC_LAUNCH_ID": "x"}, parent=1, parent_stat=None, boot_id=None, explicit="y"
    )
    assert explicit == "id:y"


def test_a_launch_that_cannot_be_told_apart_says_what_to_set() -> None:
    with pytest.raises(LaunchUnknown, match=r"Ray worker.*RayCheckpointer.*MTC_LAUNCH_ID"):
        launch_key({"RAY_RAYLET_PID": "9"}, parent=9, parent_stat=PARENT_STAT, boot_id="b")
    with pytest.raises(LaunchUnknown, match=r"cannot read the parent process 9.*MTC_LAUNCH_ID"):
        launch_key({}, parent=9, parent_stat=None, boot_id="b")
    # Ray with an explicit launch: fine.
    assert (
        launch_key(
            {"RAY_RAYLET_PID": "9", "MTC_LAUNCH_ID": "t1"}, parent=9, parent_stat=None, boot_id=None
        )
        == "id:t1"
    )


def test_siblings_share_a_launch_and_a_new_parent_makes_a_new_one() -> None:
    """Read from this machine's /proc: two children of one parent agree; a child of
    another parent (the next launch) does not."""
    show = "from mtc_replicator.client import election; print(election.this_launch())"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    run = [sys.executable, "-c", show]

    def key(argv: list[str]) -> str:
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout

    nested = [sys.executable, "-c", f"import subprocess; subprocess.run({run!r}, check=True)"]
    first, second, other = key(run), key(run), key(nested)
    assert first == second
    assert first.startswith("parent:")
    assert other != first


def test_a_result_reads_back_and_a_bad_one_is_no_result() -> None:
    record = shared(config(), step=5, path="5", source="peer")
    assert parse_result(render_result(record)) == record
    failed = shared(config(), error="boom", error_kind="ReplicatorFailed")
    assert parse_result(render_result(failed)) == failed
    good = json.loads(render_result(record))
    assert parse_result(b'{"launch": ') is None  # half written
    assert parse_result(b"[]") is None
    for bad in ({"step": True}, {"step": "5"}, {"path": "../5"}, {"path": ".."}, {"launch": 1}):
        assert parse_result(json.dumps({**good, **bad}).encode()) is None, bad


# --- the node's other processes ------------------------------------------------------------


def test_a_process_that_starts_first_takes_only_this_launchs_result(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    cfg = config()
    # An earlier launch's result is still there when this process starts.
    election.write_result(ckpt, shared(cfg, "id:run-1", step=5, path="5", source="local"))

    def local_rank_zero() -> None:
        threading.Event().wait(0.05)
        election.write_result(ckpt, shared(cfg, "id:run-2", step=9, path="9", source="peer"))

    leader = threading.Thread(target=local_rank_zero)
    leader.start()
    result = handshake(ckpt, cfg, **FAST)
    leader.join()

    assert result == RestoreResult(step=9, path=ckpt / "9", source="peer")
    assert not (ckpt / contract.CONFIG_FILE).exists()


def test_a_process_that_starts_after_local_rank_zero_finished_gets_its_result(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "7")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    cfg = config()
    election.write_result(ckpt, shared(cfg, "id:run-2"))

    assert handshake(ckpt, cfg, **FAST) == RestoreResult(step=None, path=None, source=None)
    assert os.listdir(ckpt) == [contract.RESULT_FILE]  # wrote nothing, renamed nothing


def test_local_rank_zeros_failure_reaches_the_others(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    cfg = config()
    text = "replicator.yaml: 'nodes' = 0 is invalid\n"
    election.write_result(ckpt, shared(cfg, "id:run-2", error=text, error_kind="ReplicatorFailed"))
    with pytest.raises(ReplicatorFailed) as info:
        handshake(ckpt, cfg, **FAST)
    assert info.value.text == text

    election.write_result(
        ckpt, shared(cfg, "id:run-2", error="no daemon", error_kind="HandshakeTimeout")
    )
    with pytest.raises(HandshakeTimeout, match="local rank 0's handshake failed: no daemon"):
        handshake(ckpt, cfg, **FAST)


def test_another_config_than_local_rank_zeros_is_refused(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    election.write_result(ckpt, shared(config(rank=1), "id:run-2"))
    with pytest.raises(
        HandshakeError,
        match=r"local rank 2.*another config.*\(node-rank: 1 -> 0; peer-ranks: \[2\] -> \[1\]\)",
    ):
        handshake(ckpt, config(rank=0), **FAST)


def test_a_process_waiting_in_vain_says_what_it_found(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    election.write_result(ckpt, shared(config(), "id:run-1"))
    clock = FakeClock()
    with pytest.raises(HandshakeTimeout, match=r"id:run-2.*within 20 s.*of launch id:run-1"):
        handshake(ckpt, config(), timeout=10, poll_interval=1, clock=clock, sleep=clock.sleep)


def test_a_ray_worker_without_a_launch_id_is_told_what_to_do(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RAY_RAYLET_PID", str(os.getppid()))
    with pytest.raises(HandshakeError, match=r"local rank 1 .*RayCheckpointer"):
        handshake(ckpt, config(), **FAST)
    # With one, it waits for local rank 0 as any other launcher's process.
    election.write_result(ckpt, shared(config(), "id:trial-3"))
    assert handshake(ckpt, config(), launch_id="trial-3", **FAST).step is None


# --- local rank 0 ------------------------------------------------------------------------------


def test_local_rank_zero_hands_over_and_shares_its_result(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fake_daemons: list[FakeDaemon]
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    cfg = config()
    election.write_result(ckpt, shared(cfg, "id:run-1", step=1, path="1"))
    seen: list[bool] = []

    def restore(ckpt: Path, cfg: JobConfig) -> None:
        seen.append((ckpt / contract.RESULT_FILE).exists())
        write_prerestore(ckpt, {"restore-step": 40, "restore-source": "backup"})
        restore_marker(ckpt, 40)

    fake_daemons.append(FakeDaemon(ckpt, None, restore))
    result = handshake(ckpt, cfg, **FAST)

    assert result == RestoreResult(step=40, path=ckpt / "40", source="backup")
    assert seen == [False], "the earlier launch's result is removed before the yaml"
    assert election.read_result(ckpt) == shared(
        cfg, "id:run-2", step=40, path="40", source="backup"
    )


def test_local_rank_zeros_failure_is_shared_and_raised(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fake_daemons: list[FakeDaemon]
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MTC_LAUNCH_ID", "run-2")
    text = "replicator.yaml: 'nodes' = 0 is invalid\n"

    def reject(ckpt: Path, cfg: JobConfig) -> None:
        write_atomically(ckpt / contract.FAILED_FILE, text)

    fake_daemons.append(FakeDaemon(ckpt, reject, None))
    with pytest.raises(ReplicatorFailed):
        handshake(ckpt, config(), **FAST)
    assert election.read_result(ckpt) == shared(
        config(), "id:run-2", error=text, error_kind="ReplicatorFailed"
    )


def test_an_explicit_write_config_and_several_workers_keep_their_old_ways(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, fake_daemons: list[FakeDaemon]
) -> None:
    """``write_config=True`` writes the yaml whatever the launcher says; on a node of several
    workers (``.save`` files) each worker waits for its own marker, as before."""
    monkeypatch.setenv("LOCAL_RANK", "3")

    def restore(step: int) -> Callable[[Path, JobConfig], None]:
        def markers(ckpt: Path, cfg: JobConfig) -> None:
            for w in range(cfg.workers_per_node):
                restore_marker(ckpt, step, worker=w)

        return markers

    fake_daemons.append(FakeDaemon(ckpt, None, restore(8)))
    assert handshake(ckpt, config(), write_config=True, **FAST).step == 8
    assert not (ckpt / contract.RESULT_FILE).exists()

    cfg = config(workers=4)
    fake_daemons.append(FakeDaemon(ckpt, None, restore(9)))
    assert handshake(ckpt, cfg, write_config=True, **FAST).step == 9
    result = handshake(ckpt, cfg, worker=3, **FAST)  # local rank 3 is worker 3
    assert result == RestoreResult(step=9, path=ckpt / "9-w3", source=None)
    assert not (ckpt / contract.RESULT_FILE).exists()


# --- saves ---------------------------------------------------------------------------------


def test_only_local_rank_zero_saves_the_nodes_step_directory(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    from mtc_replicator.client import AsyncSaver

    state = {"w": torch.ones(4)}
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(NotLocalRankZero, match=r"local rank 3 .LOCAL_RANK.*save_distributed"):
        save_state_dict(ckpt, 5, state)
    with AsyncSaver(ckpt) as saver, pytest.raises(NotLocalRankZero, match="local rank 3"):
        saver.save_state_dict(5, state)
    assert os.listdir(ckpt) == []
    # A .save file is each worker's own: allowed anywhere.
    assert save_file(ckpt, 5, state, job="llama", rank=0, worker=3).is_file()

    monkeypatch.setenv("LOCAL_RANK", "0")
    assert save_state_dict(ckpt, 6, state) == ckpt / "6"
