"""``node.checkpoint_dir``'s markers against what a pod may do meanwhile: several workers
whose markers share one item get one view, never rebuilt under a worker already loading
through its marker; a ``.restore`` name the pod left as a directory neither fails the job
nor stands as a second marker; a link the pod removes while retention reads the
directory's links fails nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtc_replicator.cluster.rounds import RoundOutcome
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig, marker_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local import store as store_mod
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node import checkpoint_dir
from mtc_replicator.node.checkpoint_dir import cleanup_workload_files, publish_markers
from tests.unit.node.test_checkpoint_dir import store_with_item as with_item

CONFIG = JobConfig(
    job_name="job",
    framework=Framework.PYTORCH_DISTRIBUTED,
    node_rank=0,
    nodes=1,
    peers_per_node=0,
    backup_interval=BackupInterval(minutes=None, steps=10),
    workers_per_node=4,
)
ITEM = ItemId("job", 20, 0, 0)


def store_with_item(tmp_path: Path) -> tuple[Path, LocalStore]:
    return with_item(tmp_path, ITEM, tuple(f"state/shard{i}" for i in range(5)))


def outcome(step: int | None) -> RoundOutcome:
    return RoundOutcome(step, None if step is None else "local", {}, {}, "127.0.0.1:1")


def test_a_published_marker_keeps_resolving_while_the_next_workers_markers_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers of a step directory share one item. Worker 0's process may load the moment
    its marker exists; publishing worker 1..3's markers must not tear down the view that
    worker 0's marker (or the ``<N>`` link it was renamed to) points at."""
    ckpt, store = store_with_item(tmp_path)
    w0 = ckpt / marker_name("job", 20, 0, 0)
    seen: list[str] = []
    real_remove = store_mod.fsutil.remove_tree

    def remove_tree(path: Path) -> None:
        real_remove(path)
        # What a client of worker 0 reads now, between two markers of the same publish.
        if not os.path.lexists(w0):
            return
        if not w0.exists():
            seen.append("dangling")
        elif sorted(os.listdir(w0 / "state")) != [f"shard{i}" for i in range(5)]:
            seen.append("gone")

    monkeypatch.setattr(store_mod.fsutil, "remove_tree", remove_tree)
    publish_markers(ckpt, store, CONFIG, "inc", outcome(20))
    assert seen == []
    for w in range(4):
        assert sorted(os.listdir(ckpt / marker_name("job", 20, 0, w) / "state")) == [
            f"shard{i}" for i in range(5)
        ]


def test_a_reader_that_opened_worker_0s_view_still_sees_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client of worker 0 that opened its step through its marker (a directory
    descriptor, as a loader walking the tree holds) as soon as the marker appeared, while
    the other workers' markers were still being made."""
    ckpt, store = store_with_item(tmp_path)
    fds: list[int] = []
    real_symlink = os.symlink

    def symlink(target: str, name: Path) -> None:
        real_symlink(target, name)
        if not fds:
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY))

    monkeypatch.setattr(checkpoint_dir.os, "symlink", symlink)
    try:
        publish_markers(ckpt, store, CONFIG, "inc", outcome(20))
        assert sorted(os.listdir(f"/proc/self/fd/{fds[0]}/state")) == [
            f"shard{i}" for i in range(5)
        ]
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("step", [None, 20])
def test_a_restore_name_the_pod_left_as_a_directory_does_not_fail_the_job(
    tmp_path: Path, step: int | None
) -> None:
    """``*.restore`` names are the daemon's (PROTOCOL.md step 3 and 7: exactly one marker
    per worker, no other ``*.restore`` name). A directory there must not make every
    handshake of the job fail (replicator.failed: IsADirectoryError) nor survive as a
    second marker that Orbax would take for the highest step."""
    ckpt, store = store_with_item(tmp_path)
    one = JobConfig(**{**CONFIG.__dict__, "workers_per_node": 1})
    same = ckpt / marker_name("job", step or 0, 0, 0)
    same.mkdir()
    (same / "junk").write_bytes(b"j")
    other = ckpt / marker_name("job", 99, 0, 0)
    other.mkdir()
    cleanup_workload_files(ckpt, store)
    publish_markers(ckpt, store, one, "inc", outcome(step))
    restores = sorted(n for n in os.listdir(ckpt) if n.endswith(".restore"))
    assert restores == [marker_name("job", step or 0, 0, 0)]
    assert same.is_symlink() if step else (same.is_file() and not same.is_symlink())
    assert store.get(ITEM) is not None


@pytest.mark.parametrize("how", ["removed", "made_a_dir"])
def test_a_link_the_pod_removes_during_retention_does_not_fail_the_incarnation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Orbax deletes its old ``<N>`` link (its own retention) right after a save, the very
    moment the daemon's retention runs for the step it just took. A name that goes (or
    changes kind) between the listing and ``readlink`` must be skipped: an exception here
    fails the incarnation, and ``replicator.failed`` kills the training job."""
    ckpt, store = store_with_item(tmp_path)
    one = JobConfig(**{**CONFIG.__dict__, "workers_per_node": 1})
    publish_markers(ckpt, store, one, "inc", outcome(20))
    marker = ckpt / marker_name("job", 20, 0, 0)
    os.rename(marker, ckpt / "20")  # what Orbax makes of the marker
    os.symlink("elsewhere", ckpt / "old")  # a pod's own link, gone before it is read
    real_readlink = os.readlink

    def readlink(path: str | Path) -> str:
        if Path(path).name == "old":
            os.unlink(path)
            if how == "made_a_dir":
                os.mkdir(path)
        return real_readlink(path)

    monkeypatch.setattr(checkpoint_dir.os, "readlink", readlink)
    checkpoint_dir.unlink_links_to(ckpt, store, {ITEM})
    assert not os.path.lexists(ckpt / "20")
