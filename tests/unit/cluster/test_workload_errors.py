"""``cluster.workload_errors``: a problem is logged, counted by kind, and one line of
``replicator.errors``; a file that cannot be written never fails the caller."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from mtc_replicator.cluster.workload_errors import WorkloadErrors
from mtc_replicator.core.contract import ERRORS_FILE, BackupInterval, Framework, JobConfig
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import ErrorKind, Metrics

CONFIG = JobConfig(
    job_name="job",
    framework=Framework.ORBAX,
    node_rank=3,
    nodes=4,
    peers_per_node=1,
    backup_interval=BackupInterval(minutes=None, steps=10),
)


class Counted(Metrics):
    def __init__(self) -> None:
        self.kinds: list[ErrorKind] = []

    def error(self, kind: ErrorKind) -> None:
        self.kinds.append(kind)


def errors_of(path: Path, metrics: Metrics) -> WorkloadErrors:
    return WorkloadErrors(path, CONFIG, JobLog(logging.getLogger(__name__), "job", 3), metrics)


def test_a_problem_is_one_line_counted_by_kind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Counted()
    errors = errors_of(tmp_path, metrics)
    with caplog.at_level(logging.WARNING, logger=__name__):
        errors.report("the bucket is down", 20, ErrorKind.RESTORE)
        errors.report("something else")
    lines = (tmp_path / ERRORS_FILE).read_text().splitlines()
    assert len(lines) == 2
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
    assert re.fullmatch(rf"{stamp} job=job rank=3: the bucket is down", lines[0])
    assert lines[1].endswith("job=job rank=3: something else")
    assert metrics.kinds == [ErrorKind.RESTORE, ErrorKind.OTHER]
    assert [r.getMessage() for r in caplog.records] == ["the bucket is down", "something else"]
    assert caplog.records[0].step == 20  # type: ignore[attr-defined]


def test_an_unwritable_errors_file_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gone = tmp_path / "no-such-dir"
    with caplog.at_level(logging.ERROR, logger=__name__):
        errors_of(gone, Counted()).report("lost")
    assert f"cannot write {ERRORS_FILE}" in caplog.text
