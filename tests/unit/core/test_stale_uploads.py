"""An upload reported by a previous incarnation must not count for the next run's
backup order once the job restarted and restored an older step."""

from __future__ import annotations

from mtc_replicator.core.contract import BackupInterval
from mtc_replicator.core.coordination import JobCoordinator, Phase
from mtc_replicator.core.progress import Progress
from tests.unit.core.test_coordination import VIEW, config, join, own


def test_a_previous_runs_upload_does_not_skip_the_next_runs_order() -> None:
    c = JobCoordinator(config(nodes=2, interval=BackupInterval(minutes=None, steps=1)), VIEW)
    c.rank0_incarnation = "a0"
    c.join(join(0, "a0", own(0, 10, 15, 20)), {})
    c.join(join(1, "a1", own(1, 10, 15, 20)), {})
    for r in range(2):
        s = c.status(r, f"a{r}")
        c.report_restore(r, f"a{r}", s.round, s.plan_version, ready=True)
    c.backup_committed(10, 1.0)
    # Step 20 is ordered; rank 1 uploads it, rank 0 is killed before it does (no COMMIT).
    c.report_progress(0, "a0", Progress(20), now=2.0)
    assert c.report_progress(1, "a1", Progress(20), now=2.0).backup_step == 20  # type: ignore[union-attr]
    c.report_progress(1, "a1", Progress(20, 20), now=3.0)
    assert c.take_commit() is None

    # The job restarts; rank 0's node lost step 20: the new run restores step 15.
    c.rank0_incarnation = "b0"
    c.join(join(0, "b0", own(0, 10, 15)), {})
    c.join(join(1, "b1", own(1, 10, 15, 20)), {})
    assert c.status(0, "b0").step == 15
    for r in range(2):
        s = c.status(r, f"b{r}")
        c.report_restore(r, f"b{r}", s.round, s.plan_version, ready=True)
    assert c.phase is Phase.RELEASED

    # Step 15 is due: both uploaders must upload it. The new incarnation of rank 1 has
    # uploaded nothing; step 20 of the dead run says nothing about step 15.
    first = c.report_progress(0, "b0", Progress(15), now=4.0)
    second = c.report_progress(1, "b1", Progress(15), now=4.0)
    assert first is not None
    assert second is not None
    assert first.backup_step == 15
    assert second.backup_step == 15, "rank 1 is never told to upload step 15"
    # Rank 0 alone uploaded it: the COMMIT must not be attempted without rank 1's items.
    c.report_progress(0, "b0", Progress(15, 15), now=5.0)
    assert c.take_commit() is None
