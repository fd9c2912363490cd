"""Which names in CHECKPOINT_DIR show the job writing a checkpoint (``policy.save_in_progress``)."""

from __future__ import annotations

import pytest

from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.policy import Entry, save_in_progress

NOW = 1000.0


def job(framework: Framework = Framework.ORBAX) -> JobConfig:
    return JobConfig(job_name="j", framework=framework, node_rank=1, nodes=2)


def d(name: str) -> Entry:
    return Entry(name, is_dir=True, is_file=False, mtime=NOW - 100)


def f(name: str, age: float = 100.0) -> Entry:
    return Entry(name, is_dir=False, is_file=True, mtime=NOW - age)


@pytest.mark.parametrize(
    "entry",
    [
        d("7.orbax-checkpoint-tmp-1700000000123456"),
        d("step=7"),
        d("step=7-unfinished"),
        f("j-s7-n1-w0.save.tmp"),
        f("j-s7-n1-w0.save", age=1.0),  # written a second ago, never closed
    ],
)
def test_a_save_being_written_is_seen(entry: Entry) -> None:
    assert save_in_progress(job(), [d("6"), entry], set(), NOW, 10.0) == entry.name


@pytest.mark.parametrize(
    ("entry", "closed"),
    [
        (d("7"), set()),  # published: done
        (f("j-s7-n1-w0.save", age=1.0), {"j-s7-n1-w0.save"}),  # closed after writing
        (f("j-s7-n1-w0.save", age=30.0), set()),  # unchanged for longer than settle
        (f("j-s7-n0-w0.save", age=1.0), set()),  # another rank's file
        (f("other-s7-n1-w0.save", age=1.0), set()),  # another job's
        (f("replicator.yaml.tmp", age=1.0), set()),  # a handshake, not a save
        (f("step=7"), set()),  # a file, not a step directory
        (d("7.restore"), set()),
    ],
)
def test_finished_or_foreign_names_are_not_a_save(entry: Entry, closed: set[str]) -> None:
    assert save_in_progress(job(), [entry], closed, NOW, 10.0) is None
