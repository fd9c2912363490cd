"""Ray Train through the replicator: real ``TorchTrainer`` runs (gloo, CPU) on a local Ray
cluster whose nodes stand on 127.0.0.x, one real daemon per simulated node.

One Ray cluster, two daemons and one job serve the three scenarios in order (each starts
from where the previous one left the job, to stay within the suite's budget): a worker
killed (Ray restarts the whole group) restores from the RAM disks; a node lost with its
daemon and RAM disk, its Ray node replaced, restores that node's data from its peer; every
RAM disk wiped and a new ``fit()`` restores from the ``file://`` backup. Each checks the
step on every rank, the restore source the daemons announced, and the final weights
against an uninterrupted run. Then Ray Tune trials one after the other on the same nodes,
and the refusals: another job beside a live one, an elastic worker count.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import ray

from mtc_replicator.client.ray_train import CLAIM_FILE
from mtc_replicator.core.storedir import default_store_dir
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from mtc_replicator.tools import certs
from tests.daemon_process import DaemonProcess
from tests.ray import train_loop
from tests.tls import node_tls

JOB = "ray-mtc"
FAST = ("--rescan-seconds", "0.3", "--settle-seconds", "2", "--config-wait-seconds", "3")
RAY_ENV = {
    # The controller polls its workers this often; report() is throttled by it (2 s default).
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_DEDUP_LOGS": "0",
    # Ray's agents look up this host's own address (a UDP "connect" to 8.8.8.8, then the
    # hostname through DNS) though every node here is given its IP. With no default route
    # and a hostname DNS never answers, that lookup outlasts the raylet's 30 s to register
    # ("The current node timed out during startup"; CI failed so). Off: the loopback IP.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
HEAD_IP = "127.0.0.10"
"""Ray's head, without CPUs: every worker node can be lost. Not 127.0.0.1: Ray rewrites a
bootstrap address on 127.0.0.1 to the host's own IP."""
TUNE_DRIVER = "tune-driver"
"""A resource only the head has: where a Tune trial's own function runs (Tune refuses a
trial that asks for nothing, and a CPU would leave a node too few for its Train worker)."""


@dataclass
class RayNodes:
    """The Ray cluster, the simulated nodes' RAM disks and daemons, and where the job stands."""

    root: Path
    cluster: Any
    dirs: list[Path]
    daemons: list[DaemonProcess]
    ray_nodes: list[Any]
    backup: Path
    next_ip: int = 4
    steps_done: int = 0
    fits: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def node_args(self, index: int, ip: str) -> dict[str, Any]:
        return {
            "num_cpus": 1,
            "node_ip_address": ip,
            "include_dashboard": False,
            "env_vars": {"MTC_CHECKPOINT_DIR": str(self.dirs[index]), **RAY_ENV},
        }

    def add_ray_node(self, index: int, ip: str) -> Any:
        return self.cluster.add_node(**self.node_args(index, ip))

    def lose_every_ram_disk(self) -> None:
        """Every node loses its RAM disk: daemons killed, directories and stores emptied,
        daemons started again."""
        for d in self.daemons:
            d.kill()
        for i in range(len(self.dirs)):
            self.wipe(i)
        for d in self.daemons:
            d.start()

    def wipe(self, index: int) -> None:
        shutil.rmtree(self.dirs[index])
        shutil.rmtree(default_store_dir(PurePosixPath(self.dirs[index])), ignore_errors=True)
        self.dirs[index].mkdir()


def _daemon(root: Path, ckpt: Path, backup: Path, ca: certs.Pair, index: int) -> DaemonProcess:
    tls = node_tls(root / "tls" / f"node{index}", ca, node=f"node{index}")
    return DaemonProcess(
        ckpt,
        backup=backup.as_uri(),
        extra_args=(*FAST, *tls.args()),
        log_path=root / f"node{index}.log",
    )


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("ray")
    shm = Path("/dev/shm")
    ram = Path(tmp_path_factory.mktemp("ram", numbered=True))
    if shm.is_dir() and os.access(shm, os.W_OK):
        ram = shm / f"mtc-ray-test-{os.getpid()}"
        ram.mkdir()
    dirs = [ram / f"node{i}" / "ckpt" for i in range(2)]
    for d in dirs:
        d.mkdir(parents=True)
    backup = root / "backup"
    backup.mkdir()
    ca = certs.new_ca()
    daemons = [_daemon(root, d, backup, ca, i).start() for i, d in enumerate(dirs)]
    # ray.init sets PYTHONBREAKPOINT and a SIGTERM handler in this process: put them back
    # for the tests that run after these.
    saved_env = {k: os.environ.get(k) for k in (*RAY_ENV, "PYTHONBREAKPOINT")}
    saved_sigterm = signal.getsignal(signal.SIGTERM)
    os.environ.update(RAY_ENV)  # The driver's own Ray processes (the controller's node).
    cluster = Cluster()
    state = RayNodes(root, cluster, dirs, daemons, [], backup)
    try:
        try:
            cluster.add_node(
                num_cpus=0,
                resources={TUNE_DRIVER: 1},
                node_ip_address=HEAD_IP,
                include_dashboard=False,
            )
            state.ray_nodes = [state.add_ray_node(i, f"127.0.0.{2 + i}") for i in range(2)]
            ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        except Exception as exc:
            message = f"the local Ray cluster did not start: {exc}\n{_ray_logs()}"
            raise RuntimeError(message) from exc
        yield state
    finally:
        ray.shutdown()
        cluster.shutdown()
        signal.signal(signal.SIGTERM, saved_sigterm)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for d in state.daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.stop()
        shutil.rmtree(ram, ignore_errors=True)
        for d in dirs:
            shutil.rmtree(default_store_dir(PurePosixPath(d)), ignore_errors=True)


def _ray_logs(lines: int = 15) -> str:
    """The last lines of the newest Ray session's own process logs, for a start that failed."""
    logs = Path("/tmp/ray/session_latest/logs")
    out = []
    for name in ("gcs_server.err", "raylet.out", "raylet.err", "runtime_env_agent.err"):
        for path in sorted(logs.glob(name.replace(".", "*."))):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(out) or f"(no Ray logs under {logs})"


def _fit(
    state: RayNodes,
    steps: int,
    *,
    name: str = JOB,
    max_failures: int = 1,
    num_workers: int | tuple[int, int] = 2,
    **config: object,
) -> list[dict[str, Any]]:
    """One ``TorchTrainer.fit()`` to ``steps``; the events of every attempt."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    state.fits += 1
    events = state.root / f"events-{state.fits}"
    events.mkdir()
    trainer = TorchTrainer(
        train_loop.train_func,
        train_loop_config={
            "steps": steps,
            "events": str(events),
            "dirs": [str(d) for d in state.dirs],
            **config,
        },
        scaling_config=ScalingConfig(num_workers=num_workers, placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(
            name=name,
            storage_path=str(state.root / "ray-storage"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    if name == JOB:
        state.steps_done = steps
    return _read_events(events)


def _read_events(events: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in events.glob("*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _check_end(events: list[dict[str, Any]], steps: int) -> None:
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1], done
    want = train_loop.reference_digest(steps)
    assert {e["digest"] for e in done} == {want}, f"final weights {done} != uninterrupted {want}"


def _fit_until_held(
    state: RayNodes, steps: int, **config: object
) -> tuple[threading.Thread, list[object], Path]:
    """``_fit`` in a thread, returned once both workers hold at ``hold_at`` (the flag that
    makes them hold is set, so the next attempt runs through)."""
    result: list[object] = []

    def fit() -> None:
        try:
            result.append(_fit(state, steps, **config))
        except BaseException as exc:
            result.append(exc)

    events_dir = state.root / f"events-{state.fits + 1}"
    runner = threading.Thread(target=fit, name="fit")
    runner.start()
    deadline = time.monotonic() + 120
    while sum(e["event"] == "holding" for e in _read_events(events_dir)) < 2:
        assert runner.is_alive(), result
        assert time.monotonic() < deadline, "the workers never reached the held step"
        time.sleep(0.2)
    (events_dir / "acted").touch()
    return runner, result, events_dir


def _joined(runner: threading.Thread, result: list[object]) -> list[dict[str, Any]]:
    runner.join(timeout=180)
    assert not runner.is_alive(), "fit() did not finish"
    events = result[0]
    assert isinstance(events, list), events
    return events


def test_a_killed_worker_resumes_from_the_ram_disks(nodes: RayNodes) -> None:
    events = _fit(nodes, 6, kill_rank_at=[1, 4])
    assert any(e["event"] == "killed" for e in events), events
    assert sorted(e["rank"] for e in events if e["event"] == "fresh") == [0, 1]
    restored = [e for e in events if e["event"] == "restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1], events
    assert {e["step"] for e in restored} == {4}
    assert {e["source"] for e in restored} == {"local"}
    assert len({e["digest"] for e in restored}) == 1
    _check_end(events, 6)


def test_a_lost_node_resumes_from_its_peer(nodes: RayNodes) -> None:
    hold = nodes.steps_done + 3
    runner, result, events_dir = _fit_until_held(nodes, hold + 3, hold_at=hold)
    # The node that runs rank 1 dies, not rank 0's, so that the coordinator stays where it
    # is; rank 0 moving between nodes is tests/integration/test_rank0_moves.py's.
    held = [e for e in _read_events(events_dir) if e["event"] == "holding"]
    victim = nodes.dirs.index(Path(next(e["dir"] for e in held if e["rank"] == 1)))
    survivor = 1 - victim
    # Its daemon, RAM disk and store, and Ray node are lost; a new Ray node replaces it.
    nodes.daemons[victim].kill()
    nodes.wipe(victim)
    nodes.cluster.remove_node(nodes.ray_nodes[victim], allow_graceful=False)
    nodes.daemons[victim].start()
    nodes.ray_nodes[victim] = nodes.add_ray_node(victim, f"127.0.0.{nodes.next_ip}")
    nodes.next_ip += 1
    events = _joined(runner, result)
    restored = [e for e in events if e["event"] == "restored" and e["step"] == hold]
    assert sorted(e["rank"] for e in restored) == [0, 1], events
    sources = {e["dir"]: e["source"] for e in restored}
    assert sources == {str(nodes.dirs[survivor]): "local", str(nodes.dirs[victim]): "peer"}
    assert len({e["digest"] for e in restored}) == 1
    _check_end(events, hold + 3)


def test_wiped_ram_disks_resume_from_the_backup(nodes: RayNodes) -> None:
    if nodes.steps_done == 0:
        _fit(nodes, 6)
    store = BackupStore(FileObjectStore(nodes.backup))
    deadline = time.monotonic() + 60
    while max(store.committed_steps(JOB), default=0) < nodes.steps_done - 3:
        assert time.monotonic() < deadline, f"no recent backup: {store.committed_steps(JOB)}"
        time.sleep(0.2)
    for d in nodes.daemons:
        d.stop()
    newest = max(store.committed_steps(JOB))
    for i in range(len(nodes.dirs)):
        nodes.wipe(i)
    for d in nodes.daemons:
        d.start()
    steps = nodes.steps_done + 3
    events = _fit(nodes, steps)
    restored = [e for e in events if e["event"] == "restored"]
    assert sorted(e["rank"] for e in restored) == [0, 1], events
    assert {e["step"] for e in restored} == {newest}
    assert {e["source"] for e in restored} == {"backup"}
    _check_end(events, steps)


def test_an_elastic_worker_count_is_refused(nodes: RayNodes) -> None:
    """Ray tells an elastic ScalingConfig only through an internal module: this checks that
    the checkpointer still reads it in the Ray under test. Placed before the Tune tests: an
    elastic trainer starts only on resources Ray's autoscaling coordinator reports free,
    and the trainer of a Tune driver killed below keeps its request there for 180 s."""
    with pytest.raises(Exception, match="ElasticWorkers") as err:
        _fit(nodes, 3, name="ray-elastic", max_failures=0, num_workers=(1, 2))
    assert "Use a fixed ScalingConfig(num_workers=N)" in str(err.value)


def _tune(
    nodes: RayNodes,
    name: str,
    names: list[str],
    concurrent: int,
    loop: dict[str, object],
    **config: object,
) -> tuple[dict[str, object], dict[str, list[dict[str, Any]]]]:
    """A Tune run of ``train_loop.tune_trial`` (3 steps each, ``concurrent`` at once, the
    driver's resource split among them): the errors by trial, and each trial's events, each
    trial checked to have started fresh and ended as an uninterrupted run would."""
    from ray import tune

    events = nodes.root / f"{name}-events"
    events.mkdir()
    tuner = tune.Tuner(
        tune.with_resources(train_loop.tune_trial, {"cpu": 0, TUNE_DRIVER: 1 / concurrent}),
        param_space={
            "trial": tune.grid_search(names),
            "loop": {
                "steps": 3,
                "events": str(events),
                "dirs": [str(d) for d in nodes.dirs],
                **loop,
            },
            "storage": str(nodes.root / "ray-storage"),
            **config,
        },
        tune_config=tune.TuneConfig(max_concurrent_trials=concurrent),
        run_config=tune.RunConfig(name=name, storage_path=str(nodes.root / "tune-storage")),
    )
    errors = {r.config["trial"]: r.error for r in tuner.fit() if r.error is not None}
    trials = {trial: _read_events(events / trial) for trial in names}
    for trial, run in trials.items():
        assert sorted(e["rank"] for e in run if e["event"] == "fresh") == [0, 1], (trial, run)
        _check_end(run, 3)
    return errors, trials


def test_tune_trials_one_after_the_other_share_the_nodes(nodes: RayNodes) -> None:
    """Ray Tune trials one at a time on the same nodes (``max_concurrent_trials=1``, as
    docs/ray.md advises), each a ``TorchTrainer`` of its own run name: a trial's ``close()``
    gives the nodes back, so the next one starts at once instead of being refused for the
    claim's 120 s lease. Trial b, once trained, is asked to continue from trial a's
    checkpoint, as PopulationBasedTraining's exploit asks: refused before any handshake,
    naming both jobs, instead of answered with b's own newest step."""
    errors, trials = _tune(nodes, "sweep", ["a", "b"], 1, {"ray_every": 1}, exploits={"b": "a"})
    assert list(errors) == ["b"], errors
    refused = [e for e in trials["b"] if e["event"] in ("refused", "exploited")]
    assert sorted(e["rank"] for e in refused) == [0, 1], trials["b"]
    for e in refused:
        assert e["error"] == "ForeignCheckpoint", e
        assert (
            "job 'tune-b' was asked to continue from job 'tune-a''s checkpoint of step 3"
            in (e["message"])
        )
        assert "PopulationBasedTraining" in e["message"]
    # Every trial's close() released its claim; the refused restore wrote none.
    assert not [d for d in nodes.dirs if (d / CLAIM_FILE).exists()]


def test_tune_trials_side_by_side_each_in_its_job_directory(nodes: RayNodes) -> None:
    """Two Ray Tune trials at once on the same two nodes (issue 36), each a ``TorchTrainer``
    whose ``RayCheckpointer(job_directory=True)`` hands its files to
    ``CHECKPOINT_DIR/jobs/tune-<trial>/``: neither is refused ``SharedNodes``, they overlap,
    both train to the end, each node's replicator holds both trials' saves, and each trial's
    ``close()`` released only its own directory's claim. (In CHECKPOINT_DIR's root the second
    trial would be refused: ``test_another_job_on_the_same_nodes_is_refused``.)"""
    # Each trial's workers wait, once restored, until the other trial's are: side by side
    # by construction, not by luck of the scheduling (a slot freed late runs them in turn).
    loop = {"job_directory": True, "meet": ["c", "d"]}
    errors, trials = _tune(nodes, "side", ["c", "d"], 2, loop, worker_cpus=0.5)
    assert not errors, errors
    spans = {
        trial: (min(e["t"] for e in run), max(e["t"] for e in run)) for trial, run in trials.items()
    }
    assert spans["c"][0] < spans["d"][1], spans  # they overlapped
    assert spans["d"][0] < spans["c"][1], spans
    for d in nodes.dirs:
        for trial in ("c", "d"):
            job_dir = d / "jobs" / f"tune-{trial}"
            assert job_dir.is_dir(), job_dir
            assert not (job_dir / CLAIM_FILE).exists()
            held = default_store_dir(PurePosixPath(d))
            assert (Path(held) / "items" / f"tune-{trial}" / "3").is_dir(), (d, trial)
        assert not (d / CLAIM_FILE).exists()


def test_a_one_worker_trial_resumes_on_the_other_node_from_its_pool_copy(
    nodes: RayNodes,
) -> None:
    """A Tune trial of one worker (a one-node job in its job directory) has no peer rank;
    its saves still reach the other node as pool copies (issue 36). The trial's node is
    lost at step 4 (daemon killed, RAM disk and store wiped, Ray node removed): Ray Train
    restarts the worker on the other node, which restores step 4 from the pool copy in its
    own RAM disk, the weights exactly those of 4 uninterrupted steps, and ends as an
    uninterrupted run does."""
    from ray import tune

    events = nodes.root / "pool-events"
    events.mkdir()
    loop = {
        "steps": 6,
        "events": str(events),
        "dirs": [str(d) for d in nodes.dirs],
        "workers": 1,
        "job_directory": True,
        "hold_at": 4,
        "backup_every": 100,
        "claim_lease_seconds": 0,
    }
    tuner = tune.Tuner(
        tune.with_resources(train_loop.tune_trial, {"cpu": 0, TUNE_DRIVER: 1}),
        param_space={
            "trial": "p",
            "loop": loop,
            "storage": str(nodes.root / "ray-storage"),
            "max_failures": 1,
        },
        run_config=tune.RunConfig(name="pool", storage_path=str(nodes.root / "tune-storage")),
    )
    result: list[object] = []
    runner = threading.Thread(target=lambda: result.append(tuner.fit()), name="tune")
    runner.start()
    trial_events = events / "p"
    deadline = time.monotonic() + 120
    while not any(e["event"] == "holding" for e in _read_events(trial_events)):
        assert runner.is_alive(), result
        assert time.monotonic() < deadline, "the trial never reached the held step"
        time.sleep(0.2)
    held = next(e for e in _read_events(trial_events) if e["event"] == "holding")
    victim = nodes.dirs.index(Path(held["dir"]))
    survivor = 1 - victim
    nodes.daemons[victim].kill()
    nodes.wipe(victim)
    nodes.cluster.remove_node(nodes.ray_nodes[victim], allow_graceful=False)
    (trial_events / "acted").touch()
    try:
        runner.join(timeout=180)
        assert not runner.is_alive(), "the Tune run did not finish"
    finally:  # the next tests want both nodes again
        nodes.daemons[victim].start()
        nodes.ray_nodes[victim] = nodes.add_ray_node(victim, f"127.0.0.{nodes.next_ip}")
        nodes.next_ip += 1
    errors = [r.error for r in result[0] if r.error is not None]  # type: ignore[attr-defined]
    assert not errors, errors
    run = _read_events(trial_events)
    restored = [e for e in run if e["event"] == "restored"]
    assert [(e["step"], e["dir"]) for e in restored] == [(4, str(nodes.dirs[survivor]))], run
    assert restored[0]["digest"] == train_loop.reference_digest(4, world=1)
    done = [e for e in run if e["event"] == "done"]
    assert [e["digest"] for e in done] == [train_loop.reference_digest(6, world=1)], run


def test_population_based_training_exploits_load_the_donors_exact_state(
    nodes: RayNodes,
) -> None:
    """PopulationBasedTraining over 3 trials of the function API on ``TuneCheckpointer``
    (issue 36): each saves every step to the RAM tier and reports a checkpoint of a few
    bytes naming its step. Every exploit Tune makes (at least one) loads the donor trial's
    step exactly as the donor saved it, brought by the replicator from whichever node held
    it, and the trial then runs on under its own continued name."""
    from ray import tune
    from ray.tune.schedulers import PopulationBasedTraining

    events = nodes.root / "pbt-events"
    events.mkdir()
    pbt = PopulationBasedTraining(
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [1e-4, 3e-2, 1e-1]},
        quantile_fraction=0.34,
        resample_probability=0.0,
    )
    tuner = tune.Tuner(
        tune.with_resources(train_loop.pbt_trial, {"cpu": 0.5}),
        param_space={"lr": tune.grid_search([1e-4, 3e-2, 1e-1]), "steps": 8,
                     "events": str(events)},
        tune_config=tune.TuneConfig(scheduler=pbt, metric="score", mode="max"),
        run_config=tune.RunConfig(name="pbt", storage_path=str(nodes.root / "tune-storage")),
    )  # fmt: skip
    results = tuner.fit()
    assert not [r.error for r in results if r.error is not None]
    run = _read_events(events)
    saved = {(e["job"], e["step"]): e["digest"] for e in run if e["event"] == "saved"}
    exploits = [e for e in _check_restores(run) if e["continued_from"]]
    assert exploits, "PopulationBasedTraining exploited no trial"
    print(f"{len(exploits)} exploits: {[(e['continued_from'], e['step']) for e in exploits]}")
    for e in exploits:
        assert e["digest"] == saved[(e["continued_from"], e["step"])], e
        assert e["job"].startswith("pbt-"), e
        assert e["source"] == "local", e  # adopted here before the round, then restored
        if e["step"] < 8:
            assert (e["job"], e["step"] + 1) in saved, e  # it trained on as its new job
    # The replicator held every trial's steps: Tune's checkpoints only name them.
    stored = list((nodes.root / "tune-storage" / "pbt").glob("*/checkpoint_*/*"))
    assert stored
    assert {p.name for p in stored} == {"mtc-ray.json"}, stored


def _check_restores(run: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every restore of a ``pbt_trial`` loaded exactly the state saved at its step (the
    donor's under an exploit); the restores."""
    saved = {(e["job"], e["step"]): e["digest"] for e in run if e["event"] == "saved"}
    restored = [e for e in run if e["event"] == "restored"]
    for e in restored:
        assert e["digest"] == saved[(e["continued_from"] or e["job"], e["step"])], e
    return restored


def test_paused_trials_resume_from_the_ram_tier(nodes: RayNodes) -> None:
    """A scheduler pauses each of four trials of the function API on ``TuneCheckpointer``,
    running at once on two nodes, at its second result, and resumes it later, as HyperBand
    does at a milestone (``TrialScheduler.PAUSE``; HyperBand's own pauses hang on which
    trial reaches a milestone last, too loose for a test on this box): every resume loads
    the trial's own step exactly as saved, from the RAM tier, with nothing of the state in
    ``storage_path``."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler, TrialScheduler

    class PauseOnce(FIFOScheduler):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.paused: set[str] = set()

        def on_trial_result(self, controller: Any, trial: Any, result: dict[str, Any]) -> str:
            if result["training_iteration"] == 2 and trial.trial_id not in self.paused:
                self.paused.add(trial.trial_id)
                return str(TrialScheduler.PAUSE)
            return str(TrialScheduler.CONTINUE)

    events = nodes.root / "paused-events"
    events.mkdir()
    tuner = tune.Tuner(
        tune.with_resources(train_loop.pbt_trial, {"cpu": 0.5}),
        param_space={"lr": tune.grid_search([1e-1, 1e-4, 1e-3, 3e-2]), "steps": 5,
                     "events": str(events), "step_seconds": 0.3},
        tune_config=tune.TuneConfig(scheduler=PauseOnce(), metric="score", mode="max"),
        run_config=tune.RunConfig(name="paused", storage_path=str(nodes.root / "tune-storage")),
    )  # fmt: skip
    results = tuner.fit()
    assert not [r.error for r in results if r.error is not None]
    run = _read_events(events)
    restored = _check_restores(run)
    assert len({e["job"] for e in restored}) == 4, restored  # every trial, once paused
    assert {e["source"] for e in restored} <= {"local", "peer"}, restored
    # Each trial process's life, from its entry to its last event: four at once.
    lives: dict[int, tuple[float, float]] = {}
    for e in run:
        first, last = lives.get(e["pid"], (e["t"], e["t"]))
        lives[e["pid"]] = (min(first, e["t"]), max(last, e["t"]))
    at_once = max(sum(a <= t <= b for a, b in lives.values()) for t, _ in lives.values())
    assert at_once >= 4, f"the four trials never ran at once: {lives}"
    stored = list((nodes.root / "tune-storage" / "paused").glob("*/checkpoint_*/*"))
    assert stored
    assert {p.name for p in stored} == {"mtc-ray.json"}, stored


def _kill_driver_then_restore(
    nodes: RayNodes, kind: str, events: Path, started: Callable[[], bool]
) -> float:
    """Run ``tune_driver`` of ``kind`` in a process, SIGKILL it once ``started()``,
    then ``Tuner.restore`` the experiment here and fit it to the end; the kill's time."""
    import subprocess
    import sys

    from ray import tune

    from tests.ray import tune_driver

    storage = nodes.root / "tune-storage"
    env = {
        **os.environ,
        **RAY_ENV,
        "TUNE_GLOBAL_CHECKPOINT_S": "1",
        "MTC_TEST_DIRS": os.pathsep.join(str(d) for d in nodes.dirs),
    }
    argv = [sys.executable, "-m", "tests.ray.tune_driver", nodes.cluster.address]
    driver = subprocess.Popen(
        [*argv, str(storage), str(events), kind],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not started():
            assert driver.poll() is None, "the driver ended before the kill"
            assert time.monotonic() < deadline, "the trials never got far enough"
            time.sleep(0.2)
        time.sleep(1.5)  # the experiment's state saved past the trials' checkpoints
    finally:
        driver.kill()
        driver.wait()
    killed_at = time.time()
    time.sleep(2)  # Ray ends the dead driver's trials
    name = tune_driver.EXPERIMENTS[kind]
    tuner = tune.Tuner.restore(str(storage / name), trainable=tune_driver.trainable(kind))
    results = tuner.fit()
    assert not [r.error for r in results if r.error is not None]
    return killed_at


def test_tuner_restore_after_the_driver_was_killed_resumes_trials_from_the_ram_tier(
    nodes: RayNodes,
) -> None:
    """The Tune driver is killed (SIGKILL) with two trials on ``TuneCheckpointer`` past
    their fourth step; ``Tuner.restore`` of the experiment in another process resumes each
    from its own newest step on the RAM tier, exactly as it was saved, and runs it to the
    end."""
    events = nodes.root / "restore-events"
    events.mkdir()

    def started() -> bool:
        run = _read_events(events)
        return len({e["job"] for e in run if e["event"] == "saved" and e["step"] >= 4}) == 2

    killed_at = _kill_driver_then_restore(nodes, "function", events, started)
    run = _read_events(events)
    restored = [e for e in _check_restores(run) if e["t"] > killed_at]
    assert sorted(e["job"] for e in restored) == sorted({e["job"] for e in run}), run
    assert all(e["step"] >= 4 for e in restored), restored
    assert {e["source"] for e in restored} <= {"local", "peer"}, restored
    done = {e["job"] for e in run if e["event"] == "saved" and e["step"] == 40}
    assert done == {e["job"] for e in restored}


def test_tuner_restore_resumes_a_torchtrainer_trial_from_the_ram_tier(nodes: RayNodes) -> None:
    """The same for a trial that runs a ``TorchTrainer`` of two workers on
    ``RayCheckpointer(job_directory=True)``: the driver killed at step 6 or later, the
    restored experiment's trial starts its trainer again under its run name, and both
    workers restore the newest step from the RAM tier, the weights those of as many
    uninterrupted steps, and end as an uninterrupted run does."""
    events = nodes.root / "restore-torch-events"
    events.mkdir()

    def started() -> bool:
        return any(
            e["event"] == "saved-step" and e["step"] >= 6 for e in _read_events(events / "r")
        )

    killed_at = _kill_driver_then_restore(nodes, "torch", events, started)
    run = _read_events(events / "r")
    restored = [e for e in run if e["event"] == "restored" and e["t"] > killed_at]
    assert sorted(e["rank"] for e in restored) == [0, 1], run
    assert len({e["step"] for e in restored}) == 1
    step = restored[0]["step"]
    assert step >= 6
    assert {e["source"] for e in restored} <= {"local", "peer"}, restored
    assert {e["digest"] for e in restored} == {train_loop.reference_digest(step)}
    _check_end([e for e in run if e["t"] > killed_at], 30)


def test_another_job_on_the_same_nodes_is_refused(nodes: RayNodes) -> None:
    """A second run (or a concurrent Tune trial) on nodes where job ``ray-mtc`` failed
    moments ago: Ray could restart ``ray-mtc``'s workers there, so it keeps its nodes for
    the claim's lease (no ``close()``). Refused on every worker, and ``ray-mtc``'s data is
    untouched."""
    with pytest.raises(Exception, match="failed at step"):
        _fit(nodes, nodes.steps_done + 1, max_failures=0, fail_at=nodes.steps_done + 1)
    with pytest.raises(Exception, match="SharedNodes") as err:
        _fit(nodes, 3, name="ray-other", max_failures=0)
    assert f"serves job '{JOB}'" in str(err.value)
    assert "max_concurrent_trials" in str(err.value)
    assert not (nodes.dirs[0] / "replicator.yaml").exists()


def test_dcp_state_resumes_from_ram_then_from_a_newer_ray_checkpoint(nodes: RayNodes) -> None:
    """mode="dcp": torch.distributed.checkpoint over each node's workers (FSDP-style state
    dicts keyed by parameter name), restored in place. A worker killed at step 4: the
    replicator's step 4 wins over Ray's own DCP checkpoint of step 3. Then every RAM disk
    lost at step 7 (daemons killed: no drain; the backup holds only the first step) and a
    worker killed: Ray's checkpoint of step 6 is newer than anything the replicator
    offers, and is restored."""
    runner, result, events_dir = _fit_until_held(
        nodes, 8, name="ray-mtc-dcp", max_failures=2, mode="dcp", kill_rank_at=[0, 4],
        hold_at=7, ray_every=1, backup_every=100, claim_lease_seconds=0,
    )  # fmt: skip
    nodes.lose_every_ram_disk()
    held = [e for e in _read_events(events_dir) if e["event"] == "holding"]
    os.kill(held[0]["pid"], signal.SIGKILL)
    events = _joined(runner, result)
    restored = sorted(
        (e["step"], e["source"], e["rank"]) for e in events if e["event"] == "restored"
    )
    assert restored == [(4, "local", 0), (4, "local", 1), (6, "ray", 0), (6, "ray", 1)], events
    run_dir = nodes.root / "ray-storage" / "ray-mtc-dcp"
    ray_checkpoints = sorted(c for c in run_dir.glob("checkpoint_*") if c.is_dir())
    assert [json.loads((c / "mtc-ray.json").read_text())["step"] for c in ray_checkpoints][:2] == [
        3,
        6,
    ]
    assert (ray_checkpoints[0] / ".metadata").is_file()
    _check_end(events, 8)


@pytest.mark.parametrize("mode", ["files", "dcp"])
def test_a_later_report_checkpoints_the_newest_save_as_it_was_saved(
    nodes: RayNodes, mode: str
) -> None:
    """``report`` need not follow ``save`` (docs/ray.md): saves at steps 1 and 3, step 4
    trained, then a report whose Ray checkpoint (``ray_every=1``) holds step 3 as it was
    saved, not the weights of step 4. Every RAM disk then lost (daemons killed: no drain;
    the backup holds at most step 1): a new ``fit()`` restores Ray's checkpoint, step 3
    with step 3's weights, and ends as an uninterrupted run does."""
    name = f"ray-mtc-late-{mode}"
    common: dict[str, Any] = {"name": name, "mode": mode, "claim_lease_seconds": 0}
    _fit(nodes, 5, save_at=[1, 3], report_at=[4], ray_every=1, backup_every=100, **common)
    run_dir = nodes.root / "ray-storage" / name
    checkpoints = sorted(c for c in run_dir.glob("checkpoint_*") if c.is_dir())
    assert [json.loads((c / "mtc-ray.json").read_text())["step"] for c in checkpoints] == [3]
    nodes.lose_every_ram_disk()
    events = _fit(nodes, 6, save_at=[], report_at=[], **common)
    restored = [(e["step"], e["source"], e["digest"]) for e in events if e["event"] == "restored"]
    assert restored == [(3, "ray", train_loop.reference_digest(3))] * 2, events
    _check_end(events, 6)
