"""Items a restore round passed over: kept aside, never deleted by the round. Pure.

A released round names the step every rank restores (None: a fresh start). This node's
items newer than it belong to a run the job did not go back to: left among the committed
items they would pass for the newest checkpoint, and retention would delete the new saves
for them. Deleting them, as the round used to, let one rank's report destroy data: a
member may report failed every source the plan gave it (an attacker holding a node
certificate, or a rank that really cannot reach its copies), the step then has no source
for that rank, and the round ends with an older step or none, on every rank.

So they are set aside (``local.store``: out of the index, never exposed, counted by no
retention, pushed and served to nobody) and come back into the next incarnation's
inventory, so a later restart restores them if they are still the newest complete step.
They are released only once a step at least as new is safe elsewhere: restorable by the
whole job, or committed in the backup; a copy of the same item committed again (the job
saved that step number anew) replaces its aside copy at once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from mtc_replicator.core.manifest import ItemId


def passed_over(items: Iterable[ItemId], step: int | None) -> list[ItemId]:
    """Of this job's items, those the released ``step`` passed over (all on a fresh start)."""
    return sorted(i for i in items if step is None or i.step > step)


def released(
    aside: Iterable[ItemId],
    *,
    restorable: int | None,
    backed_up: int | None,
    committed: Collection[ItemId] = (),
) -> list[ItemId]:
    """Aside items that may be deleted now.

    ``restorable`` is the job's restorable step as its coordinator last said (every rank
    holds it), ``backed_up`` its newest committed backup, ``committed`` this node's
    committed items (the index, not the aside ones). Nothing else releases an aside item:
    not a fresh start, not a report, not a shortage of room.
    """
    safe = max((s for s in (restorable, backed_up) if s is not None), default=None)
    return sorted(i for i in aside if (safe is not None and safe >= i.step) or i in committed)


def why_kept(items: Collection[ItemId], step: int | None) -> str:
    """The sentence a rank's ``replicator.errors`` carries about the items it set aside."""
    steps = sorted({i.step for i in items})
    restored = "a fresh start" if step is None else f"step {step}"
    return (
        f"the restore round chose {restored}; this node keeps its {len(items)} items of "
        f"steps {steps} aside (never exposed, not deleted) until a step at least as new is "
        "restorable or backed up; a later restart of the job restores them if they are "
        "still the newest complete step"
    )
