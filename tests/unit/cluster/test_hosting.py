"""The coordinators a daemon hosts (``cluster.hosting``): kept or replaced, and who is woken."""

from __future__ import annotations

import itertools

from mtc_replicator.cluster.hosting import CoordinatorHost
from mtc_replicator.cluster.messages import Identity, cluster_view_json
from mtc_replicator.core.contract import Framework, JobConfig

JOB = "train"
CONFIG = JobConfig(JOB, Framework.ORBAX, 0, 4, peers_per_node=1)
VIEW = cluster_view_json(CONFIG)


def host() -> CoordinatorHost:
    ids = itertools.count()
    return CoordinatorHost(new_id=lambda: f"c{next(ids)}")


def test_a_new_rank0_incarnation_with_the_same_keys_keeps_the_coordinator() -> None:
    h = host()
    first = h.host(CONFIG, VIEW, rank0_incarnation="a", owner="team-a")
    again = h.host(CONFIG, VIEW, rank0_incarnation="b", owner="team-a")
    assert again is first
    assert first.rank0_incarnation == "b"
    assert h.coordinator_id(JOB) == "c0"
    hosted = h.get(JOB)
    assert hosted is not None
    assert hosted.identity == Identity(JOB, "c0")


def test_other_keys_or_another_owner_replace_it_and_wake_its_long_polls() -> None:
    h = host()
    h.host(CONFIG, VIEW, owner="team-a")
    old = h.get(JOB)
    assert old is not None
    waiting = old.changed(2)
    h.host(CONFIG, VIEW, owner="team-b")
    assert waiting.is_set()
    assert h.coordinator_id(JOB) == "c1"
    h.host(CONFIG, VIEW + " ", owner="team-b")
    assert h.coordinator_id(JOB) == "c2"


def test_a_rank_is_woken_alone_or_with_every_rank() -> None:
    h = host()
    h.host(CONFIG, VIEW)
    hosted = h.get(JOB)
    assert hosted is not None
    one, two = hosted.changed(1), hosted.changed(2)
    hosted.notify(1)
    assert one.is_set()
    assert not two.is_set()
    assert hosted.changed(1) is not one  # a set event is dropped; the next poll gets a new one
    hosted.notify()
    assert two.is_set()


def test_dropping_wakes_every_long_poll_and_forgets_the_job() -> None:
    h = host()
    h.host(CONFIG, VIEW)
    h.host(JobConfig("other", Framework.ORBAX, 0, 1), "{}")
    hosted = h.get(JOB)
    assert hosted is not None
    waiting = hosted.changed(0)
    assert h.jobs() == ["other", JOB]
    h.close()
    assert waiting.is_set()
    assert h.jobs() == []
    assert h.coordinator_id(JOB) is None
