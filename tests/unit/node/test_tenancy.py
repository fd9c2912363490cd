"""``node.tenancy``: which job directories a node serves, found as the daemon finds them (real
directories, descriptors), and the rules one directory's handshake meets beside the others."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtc_replicator.core.contract import JOB_DIRS, JobConfig, parse_config
from mtc_replicator.local.watcher import DirectoryWatcher
from mtc_replicator.node import tenancy
from mtc_replicator.node.tenancy import Tenancy


@dataclass
class FakeIncarnation:
    config: JobConfig
    id: str


@dataclass
class FakeSupervisor:
    """What the tenancy reads of a supervisor: its incarnation and its next check."""

    path: Path
    incarnation: FakeIncarnation | None = None
    ended: list[bool] = field(default_factory=list)

    def next_check_in(self) -> float:
        return 1.0

    async def end_incarnation(self) -> None:
        self.ended.append(True)
        self.incarnation = None


def _config(job: str) -> JobConfig:
    return parse_config(
        f"job-name: {job}\nframework: orbax\nnode-rank: 0\nnodes: 1\nbackup-interval-minutes: 30\n"
    )


def _tenancy(root: Path) -> tuple[Tenancy, dict[str, FakeSupervisor]]:
    made: dict[str, FakeSupervisor] = {}
    t = Tenancy(root, lambda config: None)

    def make(name: str, path: Path, beside: Any) -> Any:
        made[name] = FakeSupervisor(path)
        return made[name]

    t.root = FakeSupervisor(root)  # type: ignore[assignment]
    t.__dict__["_make"] = make
    return t, made


def _scan(t: Tenancy) -> list[str]:
    return [d.name for d in t.scan(t.__dict__["_make"], lambda job_dir: lambda *_: None)]


def test_only_real_directories_named_as_jobs_are_served(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    jobs = root / JOB_DIRS
    jobs.mkdir(parents=True)
    t, made = _tenancy(root)
    (jobs / "trial-1").mkdir()
    (jobs / ".hidden").mkdir()
    (jobs / "a..b").mkdir()
    (jobs / "link").symlink_to(outside)
    (jobs / "file").write_text("x")
    assert _scan(t) == ["trial-1"]
    # The supervisor works through a descriptor of the directory, not its name.
    assert str(made["trial-1"].path).startswith("/proc/self/fd/")
    (made["trial-1"].path / "probe").write_text("y")
    assert (jobs / "trial-1" / "probe").read_text() == "y"
    # Swapped for a link after it was found: the descriptor still reaches the directory.
    os.rename(jobs / "trial-1", tmp_path / "moved")
    (jobs / "trial-1").symlink_to(outside)
    (made["trial-1"].path / "after").write_text("z")
    assert sorted(os.listdir(outside)) == []
    assert (tmp_path / "moved" / "after").read_text() == "z"
    t.close()


def test_a_jobs_link_is_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "trial-1").mkdir(parents=True)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / JOB_DIRS).symlink_to(outside)
    t, _ = _tenancy(root)
    assert _scan(t) == []


def test_a_directory_gone_is_forgotten_once_it_runs_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / JOB_DIRS / "a").mkdir(parents=True)
    (root / JOB_DIRS / "b").mkdir()
    t, made = _tenancy(root)
    assert _scan(t) == ["a", "b"]
    made["b"].incarnation = FakeIncarnation(_config("b"), "inc-b")
    os.rmdir(root / JOB_DIRS / "a")
    os.rmdir(root / JOB_DIRS / "b")
    assert _scan(t) == []
    assert sorted(t.dirs) == ["b"]  # still runs: kept until it ends
    assert t.running_jobs() == {"b"}


def test_the_rules_beside_other_directories(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    (root / JOB_DIRS / "a").mkdir(parents=True)
    (root / JOB_DIRS / "b").mkdir()
    t, made = _tenancy(root)
    _scan(t)
    made["b"].incarnation = FakeIncarnation(_config("b"), "inc-b")
    beside_a = t.beside("a")
    misnamed = beside_a.refusal(_config("c"))
    assert misnamed is not None
    assert "serves the job it is named after" in misnamed[0]
    assert beside_a.refusal(_config("a")) is None
    assert set(beside_a.views()) == {"inc-b"}
    assert set(beside_a.jobs()) == {"b"}
    # The root may not run a job that runs in a job directory.
    twice = t.beside(None).refusal(_config("b"))
    assert twice is not None
    assert "already runs on this node, in jobs/b/" in twice[0]
    assert t.incarnation_of("b") is made["b"].incarnation


def test_at_most_so_many_directories_are_served(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(tenancy, "MAX_JOB_DIRS", 2)
    root = tmp_path / "ckpt"
    for name in ("a", "b", "c"):
        (root / JOB_DIRS / name).mkdir(parents=True)
    t, _ = _tenancy(root)
    assert _scan(t) == ["a", "b"]
    assert _scan(t) == []


def _watched(t: Tenancy, seen: list[str | None]) -> list[tenancy.JobDir]:
    def on_event(job_dir: tenancy.JobDir) -> Any:
        return lambda name, *_: seen.append(name)

    return t.scan(t.__dict__["_make"], on_event)


def test_the_watch_goes_through_the_descriptor(tmp_path: Path) -> None:
    # A pod swaps its job directory for a link to elsewhere between the scan and the
    # watch: the watch is on the directory the daemon serves, and what happens at the
    # link's target wakes nothing.
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    (root / JOB_DIRS / "trial-1").mkdir(parents=True)
    t, _ = _tenancy(root)
    seen: list[str | None] = []
    loop = asyncio.new_event_loop()
    try:
        (job_dir,) = _watched(t, seen)
        os.rename(root / JOB_DIRS / "trial-1", tmp_path / "moved")
        (root / JOB_DIRS / "trial-1").symlink_to(outside)
        assert job_dir.watch(loop)
        (outside / "replicator.yaml").write_text("job-name: x\n")
        (tmp_path / "moved" / "a.save").write_bytes(b"1")
        loop.run_until_complete(asyncio.sleep(0.3))
        assert "a.save" in seen
        assert "replicator.yaml" not in seen
    finally:
        t.close()
        loop.close()


def test_a_watch_that_cannot_be_made_leaves_the_directory_served(
    tmp_path: Path, monkeypatch: Any, caplog: Any
) -> None:
    # The kernel refuses the watch (inotify instances or watches run out): rescans serve
    # the directory, the daemon goes on.
    def refused(self: Any, loop: Any) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(DirectoryWatcher, "start", refused)
    root = tmp_path / "ckpt"
    (root / JOB_DIRS / "trial-1").mkdir(parents=True)
    t, _ = _tenancy(root)
    loop = asyncio.new_event_loop()
    try:
        (job_dir,) = _watched(t, [])
        assert not job_dir.watch(loop)
        assert "no file events from jobs/trial-1" in caplog.text
        assert sorted(t.dirs) == ["trial-1"]
    finally:
        t.close()
        loop.close()


def test_a_directory_removed_and_made_again_is_served_anew(tmp_path: Path) -> None:
    # rm -rf jobs/a && mkdir jobs/a between two scans: the name is there at both, but the
    # descriptor kept of the first directory reaches nothing the pod writes, so the scan
    # serves (and watches) the new one.
    root = tmp_path / "ckpt"
    jobs = root / JOB_DIRS
    (jobs / "a").mkdir(parents=True)
    t, made = _tenancy(root)
    seen: list[str | None] = []
    loop = asyncio.new_event_loop()
    try:
        (first,) = _watched(t, seen)
        assert first.watch(loop)
        os.rmdir(jobs / "a")
        (jobs / "a").mkdir()
        (again,) = _watched(t, seen)
        assert again is not first
        assert again.watch(loop)
        (jobs / "a" / "replicator.yaml").write_text("job-name: a\n")
        assert (t.dirs["a"].path / "replicator.yaml").exists()
        assert made["a"].path == again.path
        (jobs / "a" / "a-s1-n0-w0.save").write_bytes(b"x")
        loop.run_until_complete(asyncio.sleep(0.3))
        assert "a-s1-n0-w0.save" in seen
    finally:
        t.close()
        loop.close()


def test_a_directory_removed_while_its_job_runs_is_an_orphan_until_the_job_ends(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    jobs = root / JOB_DIRS
    (jobs / "a").mkdir(parents=True)
    (jobs / "b").mkdir()
    t, made = _tenancy(root)
    assert _scan(t) == ["a", "b"]
    for name in ("a", "b"):
        made[name].incarnation = FakeIncarnation(_config(name), f"inc-{name}")
    assert t.orphans() == []
    os.rmdir(jobs / "a")
    (jobs / "a").mkdir()
    assert [name for name, _ in t.orphans()] == ["a"]
    assert _scan(t) == []  # the new one waits while the job runs in the removed one
    made["a"].incarnation = None  # the daemon ended it (a drain, as at a job's end)
    first = made["a"]
    assert _scan(t) == ["a"]
    assert made["a"] is not first
    assert t.orphans() == []
    assert t.running_jobs() == {"b"}


def test_a_listing_of_jobs_that_fails_ends_no_job_and_forgets_no_directory(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # Descriptors run out for a moment: jobs/ cannot be listed, which says nothing of the
    # directories served, so none passes for gone (its job would be ended) or is forgotten.
    root = tmp_path / "ckpt"
    (root / JOB_DIRS / "a").mkdir(parents=True)
    (root / JOB_DIRS / "b").mkdir()
    t, made = _tenancy(root)
    assert _scan(t) == ["a", "b"]
    made["a"].incarnation = FakeIncarnation(_config("a"), "inc-a")
    real_open = os.open

    def no_descriptors(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(JOB_DIRS):
            raise OSError(24, "Too many open files")
        return real_open(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(tenancy.os, "open", no_descriptors)
        assert t.orphans() == []
        assert _scan(t) == []
        assert sorted(t.dirs) == ["a", "b"]
    os.rmdir(root / JOB_DIRS / "b")
    assert _scan(t) == []
    assert sorted(t.dirs) == ["a"]  # listed again: b is gone and ran nothing
