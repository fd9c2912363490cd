"""The coordinator's incremental progress tallies against the definitions they replace."""

from __future__ import annotations

import random

import pytest

from mtc_replicator.core.contract import Framework, JobConfig
from mtc_replicator.core.coordination import MAX_REPORT_EVERY, report_every
from mtc_replicator.core.layout import restorable_step
from mtc_replicator.core.progress import ProgressBook


def job(nodes: int) -> JobConfig:
    return JobConfig(job_name="j", framework=Framework.ORBAX, node_rank=0, nodes=nodes)


@pytest.mark.parametrize("seed", range(40))
def test_the_tallies_answer_what_the_definitions_do_on_random_histories(seed: int) -> None:
    rng = random.Random(seed)
    nodes = rng.randint(1, 9)
    book = ProgressBook(nodes)
    replicated: dict[int, int | None] = {}
    held: dict[int, frozenset[int]] = {}
    replicating: dict[int, int] = {}
    uploaded: dict[int, int] = {}
    if rng.random() < 0.5:
        start = rng.randint(0, 5)
        book.reset(start)
        replicated = dict.fromkeys(range(nodes), start)
    tracked: tuple[int, frozenset[int]] | None = None
    for _ in range(200):
        rank = rng.randrange(nodes)
        rep = rng.choice([None, rng.randint(0, 12)])
        up = rng.choice([None, rng.randint(0, 12)])
        promise = rng.choice([None, frozenset(rng.sample(range(14), rng.randint(0, 4)))])
        push = rng.choice([None, rng.randint(0, 14)])
        book.report(rank, replicated=rep, uploaded=up, held=promise, replicating=push)
        if rep is not None:
            replicated[rank] = max(rep, replicated.get(rank) or rep)
        if up is not None:
            uploaded[rank] = max(up, uploaded.get(rank, up))
        held.pop(rank, None)
        if promise is not None:
            held[rank] = promise
        replicating.pop(rank, None)
        if push is not None:
            replicating[rank] = push
        if rng.random() < 0.1:
            tracked = (
                rng.randint(0, 12),
                frozenset(rng.sample(range(nodes), rng.randint(1, nodes))),
            )
            book.track_upload(*tracked)

        assert book.restorable() == restorable_step(job(nodes), replicated, held)
        wanted = {s for s in replicated.values() if s is not None} | set(replicating.values())
        assert book.wanted() == wanted
        if tracked is not None:
            step, ranks = tracked
            assert book.all_uploaded() == all(uploaded.get(r, -1) >= step for r in ranks)
        assert book.has_uploaded(rank, 3) == (uploaded.get(rank, -1) >= 3)


def test_a_rank_reported_twice_counts_once() -> None:
    book = ProgressBook(2)
    for _ in range(3):
        book.report(0, replicated=5, uploaded=None, held=frozenset({5}), replicating=6)
    assert book.restorable() is None  # rank 1 never reported
    book.report(1, replicated=7, uploaded=None, held=frozenset({5, 7}), replicating=None)
    assert book.restorable() == 5
    assert book.wanted() == {5, 6, 7}


def test_report_every_spreads_a_large_jobs_reports_within_bounds() -> None:
    assert report_every(1) == 1
    assert report_every(128) == 1
    assert report_every(256) == 2
    assert report_every(1024) == 8
    assert report_every(4096) == MAX_REPORT_EVERY
    assert report_every(1_000_000) == MAX_REPORT_EVERY
