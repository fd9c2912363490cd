"""Pruning a job's backups: the policy's facts from a listing, and the deletions it chose.

The decision is ``core.prune.plan_prune`` (pure); this module gathers its input from a
``JobListing`` and performs what ``mtc backups prune --apply`` asked for through an
``ObjectStore``. A step is deleted COMMIT first, so a half-deleted step is never
restorable; each step is checked again just before it goes (a pin made since, an uploader
come back), since the plan may be minutes old.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from mtc_replicator.core.backup_layout import commit_key, manifest_item_key, step_prefix
from mtc_replicator.core.prune import Action, PruneFacts, StepDecision, StepState
from mtc_replicator.storage.backup_audit import JobListing
from mtc_replicator.storage.objectstore import ObjectStore
from mtc_replicator.storage.restore_pins import read_restore_pin

log = logging.getLogger(__name__)


def prune_facts(
    listing: JobListing,
    *,
    pinned: int | None = None,
    verify_requested: bool = False,
    newest_verified: int | None = None,
) -> PruneFacts:
    """The policy's input from a listing: commit times, and newest object times of the rest."""
    committed = {s.step: s.commit.created for s in listing.steps if s.commit is not None}
    invalid = [s.step for s in listing.steps if s.commit is None and s.commit_error is not None]
    partial = {
        s.step: s.newest_object_at
        for s in listing.steps
        if s.commit is None and s.commit_error is None
    }
    return PruneFacts(committed, partial, invalid, pinned, verify_requested, newest_verified)


@dataclass(frozen=True)
class Deletion:
    step: int
    objects: int
    bytes: int
    skipped: str | None = None
    """Why the step was left alone after all (it changed since the plan was made)."""


def delete_step(objects: ObjectStore, job: str, step: int) -> tuple[int, int]:
    """Delete one step: COMMIT first (it stops being restorable at once), then each item's
    manifest (the item stops existing), then the data. (objects, bytes) deleted.

    A prune that dies half-way leaves a step without COMMIT, which the next prune removes.
    """
    ckey = commit_key(job, step)
    count, size = 0, 0
    info = objects.head(ckey)
    if info is not None:
        objects.delete(ckey)
        count, size = 1, info.size
    prefix = step_prefix(job, step)
    rest = [i for i in objects.list(prefix) if i.key != ckey]
    rest.sort(key=lambda i: (manifest_item_key(i.key[len(prefix) :]) is None, i.key))
    for info in rest:
        objects.delete(info.key)
        count += 1
        size += info.size
    return count, size


def apply_prune(
    objects: ObjectStore,
    job: str,
    decisions: Iterable[StepDecision],
    *,
    min_age_seconds: float,
    now: float,
) -> list[Deletion]:
    """Delete the steps ``decisions`` marks DELETE, oldest first, re-checking each first.

    A pin made since the plan keeps its step; a step without COMMIT that got one, or got
    new objects, since it was listed is left alone: an uploader came back to it.
    """
    pin = read_restore_pin(objects, job)
    done: list[Deletion] = []
    for d in sorted(decisions, key=lambda d: d.step):
        if d.action is not Action.DELETE:
            continue
        if pin is not None and pin.step == d.step:
            done.append(Deletion(d.step, 0, 0, "a restore pin names it now"))
            continue
        if d.state is not StepState.COMMITTED:
            infos = list(objects.list(step_prefix(job, d.step)))
            if any(i.key == commit_key(job, d.step) for i in infos):
                done.append(Deletion(d.step, 0, 0, "it was committed since it was listed"))
                continue
            if any(now - i.mtime < min_age_seconds for i in infos):
                done.append(Deletion(d.step, 0, 0, "new objects arrived since it was listed"))
                continue
        count, size = delete_step(objects, job, d.step)
        log.info(
            "pruned backup job=%s step=%d objects=%d bytes=%d",
            job,
            d.step,
            count,
            size,
            extra={"job": job},
        )
        done.append(Deletion(d.step, count, size))
    return done
