"""Rank 0's daemon killed right after a release (the record written, the answers not
yet delivered). The restarted coordinator serves the released round again to rank 0; a
rank that had not heard of the release yet is still restoring with the released
incarnation, and must be answered with the round's step too, not refused for ever."""

from __future__ import annotations

from mtc_replicator.core.coordination import JobCoordinator, Phase
from mtc_replicator.core.policy import Source
from tests.unit.core.test_coordination import VIEW, config, everyone_joins, join, own, release


def test_a_rank_that_had_not_heard_of_the_release_gets_it_from_the_resumed_round() -> None:
    c = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    everyone_joins(c, "a", steps=(3, 5))
    release(c, "a")
    record = c.released_record()
    assert record is not None

    again = JobCoordinator(config(), VIEW, rank0_incarnation="a0")
    again.resume_released(record)
    # Rank 2's long poll died with the daemon before it heard RELEASED: its agent joins again
    # with the same incarnation, still restoring (it reports no progress before markers).
    again.join(join(2, "a2", own(2, 3, 5)), {})
    status = again.status(2, "a2")
    assert status.phase is Phase.RELEASED, status.message
    assert status.step == 5
    assert [(i.step, i.rank, f[0].source) for i, f in status.assignments.items()] == [
        (5, 2, Source.LOCAL)
    ]
    # Rank 0 comes back too: both are served the same step.
    again.join(join(0, "a0", own(0, 3, 5)), {})
    assert again.status(0, "a0").step == 5
    assert again.status(2, "a2").phase is Phase.RELEASED
    # A stray incarnation of another rank is still not admitted.
    assert again.status(1, "zz").phase is None
    assert again.released_record() == record
