"""A training job's end, told to the node's replicator: ``finish_job``.

The contract's way to stop a job (docs/protocol.md) is an empty ``replicator.yaml``. The
daemon then drains the job's newest step as it does on SIGTERM (to its peers, and to the
backup when the bucket is older), stops serving the job and deletes the file; the job's
items stay on the node as a job that no longer runs there, which the backup lets go (or
``mtc drop`` drops). Without it a finished job stays the node's running job until another
job's handshake replaces it. Does file I/O in CHECKPOINT_DIR only; imports the standard
library and ``mtc_replicator.core.contract``.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from mtc_replicator.client.handshake import (
    DEFAULT_POLL_INTERVAL,
    DEFAULT_TIMEOUT,
    Clock,
    Sleep,
    wait_config_consumed,
)
from mtc_replicator.core import contract

log = logging.getLogger(__name__)


def finish_job(
    checkpoint_dir: str | os.PathLike[str],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
) -> list[str]:
    """Tell the node's daemon that the job is over, and wait until it drained it.

    Call it once per node, from the process that ran ``handshake`` (the node's local rank 0,
    worker 0), after the last save was published (``AsyncSaver.close()``). Writes an empty
    ``replicator.yaml`` atomically (after a pending one of this node was consumed) and
    returns once the daemon deleted it: by then it has pushed and uploaded the job's newest
    step (within its ``--drain-seconds``) and no longer serves the job. Returns the lines
    of ``replicator.errors`` it found meanwhile, each also logged at warning: a line says
    when the newest step may not be in the backup, and how to upload it (``mtc upload``).
    Each wait gets ``timeout`` seconds, then ``HandshakeTimeout``.

    A job of several nodes: call it on every node; each uploads its own items, and the last
    one's drain writes the step's ``COMMIT`` (docs/daemon.md, "Jobs that end").
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"checkpoint directory {directory} does not exist: is the replicator's volume "
            "mounted into this container?"
        )

    def consumed() -> None:
        wait_config_consumed(
            directory, timeout=timeout, poll_interval=poll_interval, clock=clock, sleep=sleep
        )

    consumed()
    tmp = directory / contract.CONFIG_TMP_FILE
    with open(tmp, "w", encoding="utf-8") as f:
        os.fsync(f.fileno())
    # Renamed in empty: the daemon acts at once (written in place, it would wait
    # --config-wait-seconds for a writer that may not have begun).
    os.replace(tmp, directory / contract.CONFIG_FILE)
    log.info("job finished: told the replicator in %s; waiting for its drain", directory)
    t0 = clock()
    consumed()
    lines = _take_errors(directory)
    log.info("the replicator drained the job in %.1fs", clock() - t0)
    return lines


def _take_errors(directory: Path) -> list[str]:
    """The lines of ``replicator.errors``, logged and removed (claimed by a rename first: the
    daemon may append meanwhile)."""
    claimed = directory / f"{contract.ERRORS_FILE}.{uuid.uuid4().hex}.tmp"
    try:
        os.rename(directory / contract.ERRORS_FILE, claimed)
    except FileNotFoundError:
        return []
    try:
        text = claimed.read_text(encoding="utf-8", errors="replace")
    finally:
        claimed.unlink(missing_ok=True)
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines:
        log.warning("replicator: %s", line)
    return lines
