"""``node.repeats``: the same restore served again only once the last marker was taken, and
a second save of a taken item refused (a ``.save`` file here; ``<N>/`` against a real
daemon in ``tests/integration/test_multiprocess_node.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from mtc_replicator.cluster.rounds import RoundOutcome
from mtc_replicator.core.contract import Framework, JobConfig, marker_name, save_file_name
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.repeats import Repeats
from mtc_replicator.obs.metrics import ErrorKind
from tests.unit.node.test_checkpoint_dir import ITEM, store_with_item

CONFIG = JobConfig(job_name="job", framework=Framework.PYTORCH, node_rank=1, nodes=2)

Reported = list[tuple[str, int | None, ErrorKind]]


def repeats(ckpt: Path, store: LocalStore, reported: Reported) -> Repeats:
    where = SimpleNamespace(checkpoint_dir=ckpt, store=store, closed_files={"x.save"})
    return Repeats(where, CONFIG, "inc1", lambda *line: reported.append(line))


def test_the_restore_is_served_again_only_after_the_last_marker_was_taken(
    tmp_path: Path,
) -> None:
    ckpt, store = store_with_item(tmp_path)
    r = repeats(ckpt, store, [])
    marker = ckpt / marker_name("job", 20, 1, 0)
    r.serve_again()
    assert not r.serve_once(), "no restore published yet"
    r.outcome = RoundOutcome(20, "local", {}, {}, "127.0.0.1:1")
    os.symlink(store.expose(ITEM, "inc1"), marker)  # the first process has not taken it
    assert not r.serve_once()
    target = os.readlink(marker)
    os.rename(marker, ckpt / "20")
    assert r.serve_once()
    assert os.readlink(marker) == target
    r.pending = 0
    marker.unlink()
    assert not r.serve_once(), "nobody else waits"


def test_a_second_save_of_a_taken_item_is_removed_and_said(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    reported: Reported = []
    r = repeats(ckpt, store, reported)
    item = ItemId("job", 30, 1, 2)
    name = save_file_name("job", 30, 1, 2)
    (ckpt / name).write_bytes(b"first")
    assert not r.refuse(item, name), "the first save is taken"
    r.took(item, True)
    (ckpt / name).write_bytes(b"second")
    assert r.refuse(item, name)
    assert not (ckpt / name).exists()
    ((message, step, kind),) = reported
    assert (step, kind) == (30, ErrorKind.INGEST)
    assert f"step 30 of job job rank 1 worker 2 was saved again ({name})" in message
    assert not r.refuse(ItemId("job", 30, 1, 3), save_file_name("job", 30, 1, 3))


def test_the_outcome_is_known_before_a_marker_can_be_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workload that takes its markers and writes the same ``replicator.yaml`` at once is a
    restart: the daemon must already know its markers are out (the supervisor judges a
    repeat by it), or the restart is taken for a repeat of the start (a job of several nodes
    then waits forever for its rank 0: it happened in the scale benchmark)."""
    ckpt, store = store_with_item(tmp_path)
    r = repeats(ckpt, store, [])
    outcome = RoundOutcome(20, "local", {}, {}, "127.0.0.1:1")
    seen: list[RoundOutcome | None] = []

    def publish(*args: object) -> None:
        seen.append(r.outcome)
        raise OSError("disk full")

    monkeypatch.setattr("mtc_replicator.node.repeats.publish_markers", publish)
    with pytest.raises(OSError, match="disk full"):
        r.publish(outcome)
    assert seen == [outcome]
    assert r.outcome is None, "not published after all"
