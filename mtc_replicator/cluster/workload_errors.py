"""What a rank tells its workload when something goes wrong but the job goes on. I/O: the
``replicator.errors`` file in CHECKPOINT_DIR.

One sink for the agent, its membership and its restore round: a log line with job, rank
and step, a count by kind (``mtc_errors_total``), and a line in ``replicator.errors``,
which the training job's client shows. Here, below both its users, so the round reports
by calling down, never back up into the agent.
"""

from __future__ import annotations

import time
from pathlib import Path

from mtc_replicator.core.contract import ERRORS_FILE, JobConfig
from mtc_replicator.local import fsutil
from mtc_replicator.obs.logs import JobLog
from mtc_replicator.obs.metrics import NO_METRICS, ErrorKind, Metrics


class WorkloadErrors:
    """Non-fatal problems of one incarnation, told to its workload."""

    def __init__(
        self, checkpoint_dir: Path, config: JobConfig, log: JobLog, metrics: Metrics = NO_METRICS
    ) -> None:
        self.path = checkpoint_dir / ERRORS_FILE
        self.config = config
        self.log = log
        self.metrics = metrics

    def report(
        self, message: str, step: int | None = None, kind: ErrorKind = ErrorKind.OTHER
    ) -> None:
        """Log ``message``, count it as ``kind`` and append it to ``replicator.errors``;
        a file that cannot be written is logged, never raised."""
        self.log.warning(message, step=step)
        self.metrics.error(kind)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{stamp} job={self.config.job_name} rank={self.config.node_rank}: {message}"
        try:
            fsutil.append_line(self.path, line)
        except OSError as exc:
            self.log.error("cannot write %s: %s", ERRORS_FILE, exc)
