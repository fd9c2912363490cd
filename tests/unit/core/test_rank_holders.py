"""Ranks bound to the node that joined as them (``core.rank_holders``), and the coordinator's
use of it (``core.coordination``): pure, no sockets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtc_replicator.core.coordination import (
    JobCoordinator,
    Join,
    Phase,
    ProgressAnswer,
    ReportRefused,
)
from mtc_replicator.core.identity import LEGACY
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.rank_holders import (
    MAX_HISTORY,
    RankHolders,
    Released,
    SavedHolders,
    holders_from_json,
    holders_json,
)
from mtc_replicator.core.restore_plan import NodeInventory
from mtc_replicator.local.holders_file import HoldersFile
from tests.unit.core.test_coordination import VIEW, config, own


def join(rank: int, inc: str, node: str | None) -> Join:
    inventory = NodeInventory(rank, f"127.0.0.1:{7000 + rank}", own(rank, 5))
    return Join(rank, inc, VIEW, inventory, node)


def released(nodes: int = 3) -> JobCoordinator:
    c = JobCoordinator(config(nodes), VIEW, "a0")
    for r in range(nodes):
        c.join(join(r, f"a{r}", f"node{r}"), {})
    for r in range(nodes):
        s = c.status(r, f"a{r}")
        c.report_restore(r, f"a{r}", s.round, s.plan_version, ready=True, node=f"node{r}")
    assert c.phase is Phase.RELEASED
    return c


def _report(c: JobCoordinator, rank: int, inc: str, node: str) -> ProgressAnswer | None:
    return c.report_progress(rank, inc, Progress(5), now=0.0, node=node)


def test_a_rank_is_its_first_nodes() -> None:
    h = RankHolders()
    assert h.check(1, "n1") == ""
    h.bind(1, "n1")
    h.bind(1, "n2")  # bound already: no change
    assert h.check(1, "n1") == ""
    assert "held by node 'n1', not 'n2'" in h.check(1, "n2")
    assert h.refused == 1
    assert h.check(1, None) == ""  # no known node: nothing to check


def test_a_shared_certificate_neither_is_refused_nor_holds_a_rank_against_a_named_node() -> None:
    h = RankHolders()
    h.bind(1, LEGACY)  # a daemon with the shared certificate joined as rank 1
    assert h.check(1, "n1") == ""  # restarted with its own certificate: still rank 1
    h.bind(1, "n1")
    assert h.nodes[1] == "n1"
    assert h.check(1, LEGACY) == ""  # under --tls-shared-certificate: anyone, as before
    assert "held by node 'n1'" in h.check(1, "n2")


def test_only_a_new_rank0_incarnation_frees_the_ranks() -> None:
    h = RankHolders(rank0="i1")
    h.bind(0, "n0")
    h.bind(1, "n1")
    h.rank0_joins("i1")
    assert h.nodes == {0: "n0", 1: "n1"}
    h.rank0_joins("i2")
    assert h.nodes == {0: "n0"}


def test_the_saved_holders_round_trip_and_bad_ones_are_refused() -> None:
    history = {0: {"n0": 0}, 2: {"n5": 0, LEGACY: 10, "n2": None}}
    saved = SavedHolders({0: "n0", 2: "n2"}, history, True)
    assert holders_from_json(json.loads(json.dumps(holders_json(saved))), 3) == saved
    long = "n" * 254
    for bad in (
        {},
        {"holders": []},
        {"holders": {"x": "n"}},
        {"holders": {"3": "n"}},
        {"holders": {"0": 7}},
        {"holders": {"0": long}},
        {"holders": {}, "history": []},
        {"holders": {}, "history": {"0": "n0"}},
        {"holders": {}, "history": {"0": [[f"n{i}", 0] for i in range(MAX_HISTORY + 1)]}},
        {"holders": {}, "history": {"0": [[long, 0]]}},
        {"holders": {}, "history": {"0": ["n0"]}},
        {"holders": {}, "history": {"0": [["n0", -1]]}},
        {"holders": {}, "history": {"0": [["n0", True]]}},
        {"holders": {}, "history": {"0": [["n0", "5"]]}},
        {"holders": {}, "history": {"5": [["n0", 0]]}},
        {"holders": {}, "complete": "yes"},
        [],
    ):
        with pytest.raises(ValueError, match=r"holders|bad entry|out of range|bad history|bad '"):
            holders_from_json(bad, 3)


def test_the_released_round_round_trips_and_bad_ones_are_refused() -> None:
    released = Released(4, "r0", 30, {0: "r0", 1: "r1", 2: "r2"})
    saved = SavedHolders({0: "n0"}, {}, False, released)
    assert holders_from_json(json.loads(json.dumps(holders_json(saved))), 3) == saved
    fresh = SavedHolders({}, {}, False, Released(1, "r0", None, {0: "r0", 1: "r1", 2: "r2"}))
    assert holders_from_json(json.loads(json.dumps(holders_json(fresh))), 3) == fresh
    good = holders_json(saved)["released"]
    for bad in (
        [],
        good | {"round": 0},
        good | {"round": True},
        good | {"step": -1},
        good | {"rank0": ""},
        good | {"rank0": "x" * 65},
        good | {"incarnations": {"0": "r0", "1": "r1"}},  # every rank's, or nothing
        good | {"incarnations": {"0": "r0", "1": "r1", "7": "r7"}},
        good | {"incarnations": {"0": "r0", "1": "r1", "2": 2}},
    ):
        with pytest.raises(ValueError, match=r"released|bad entry|out of range"):
            holders_from_json({"holders": {}, "released": bad}, 3)


def test_an_older_record_without_history_reads_as_incomplete() -> None:
    saved = holders_from_json({"holders": {"0": "n0", "1": "n1"}}, 3)
    assert saved == SavedHolders({0: "n0", 1: "n1"}, {}, complete=False)
    h = RankHolders()
    h.restore(saved)
    assert h.history == {0: {"n0": 0}, 1: {"n1": 0}}  # they held the ranks: since when?
    assert h.producers(1, 5) is None


def test_the_history_keeps_every_node_bound_in_order_and_survives_a_job_restart() -> None:
    h = RankHolders(rank0="i1")
    h.bind(0, "n0")
    h.bind(1, LEGACY)  # a shared certificate joined as rank 1 ...
    h.bind(1, "n1")  # ... and node 1 took it over before the round was released
    h.released(None)  # a fresh start: node 1 produces from step 0
    h.rank0_joins("i2")
    assert h.nodes == {0: "n0"}
    h.bind(1, "n7")
    h.released(5)  # the job restarted from step 5: node 7 produces from there
    h.rank0_joins("i3")
    h.bind(1, "n1")  # back on node 1: once in the history, as the newest, since step 0
    h.released(20)
    assert h.history == {0: {"n0": 0}, 1: {LEGACY: None, "n7": 5, "n1": 0}}


def test_a_node_produces_only_from_the_step_its_first_round_restored() -> None:
    h = RankHolders(rank0="i1")
    h.bind(1, "n1")
    h.planned(fresh=True)
    h.released(None)
    h.rank0_joins("i2")
    h.bind(1, "n7")  # rank 1 moves to node 7 in the round restoring step 5
    assert h.producers(1, 5) == ("n1",)  # node 7 has produced nothing yet
    h.released(5)
    assert h.producers(1, 4) == ("n1",)  # what it says of older steps is not believed
    assert h.producers(1, 5) == ("n1", "n7")  # a re-save of the restored step
    assert h.producers(1, 9) == ("n1", "n7")


def test_a_rank_adopted_in_steady_state_may_have_produced_any_step() -> None:
    h = RankHolders(complete=True)
    h.bind(1, LEGACY)
    h.released(20)
    h.bind(1, "n1", running=True)  # the same daemon, restarted with its own certificate
    assert h.producers(1, 3) == ("n1",)
    assert h.producers(1, 20) == (LEGACY, "n1")


def test_the_history_is_bounded_to_the_newest_nodes() -> None:
    h = RankHolders(rank0="i0")
    for i in range(MAX_HISTORY + 3):
        h.rank0_joins(f"i{i + 1}")
        h.bind(1, f"n{i}")
    assert list(h.history[1]) == [f"n{i}" for i in range(3, MAX_HISTORY + 3)]


def test_producers_are_known_only_after_a_plan_found_no_item_anywhere() -> None:
    h = RankHolders()
    h.bind(0, "n0")
    h.released(None)
    assert h.producers(0, 5) is None  # items may exist whose producers it never saw
    h.planned(fresh=False)
    assert h.producers(0, 5) is None
    h.planned(fresh=True)
    assert h.producers(0, 5) == ("n0",)
    assert h.producers(1, 5) == ()  # no node ever held rank 1: no copy of it counts
    assert h.saved().complete


def test_a_rank_bound_without_a_node_leaves_the_producers_unknown() -> None:
    h = RankHolders()
    h.bind(0, None)  # TLS off, or an in-process call: nobody can say who produces
    h.planned(fresh=True)
    assert h.producers(0, 5) is None
    assert not h.saved().complete


def test_restore_merges_the_history_and_takes_bindings_only_when_adopting() -> None:
    saved = SavedHolders({1: "n1"}, {1: {"n5": 0, "n1": 10, "n8": 30}}, complete=True)
    h = RankHolders()
    h.bind(1, "n8")
    h.restore(saved, bindings=False)
    assert h.nodes == {1: "n8"}
    assert h.history[1] == {"n5": 0, "n1": 10, "n8": 30}  # the record's tenures count
    h.released(40)
    assert h.history[1] == {"n5": 0, "n1": 10, "n8": 30}  # the earliest tenure stays
    assert h.producers(1, 20) == ("n5", "n1")
    adopting = RankHolders()
    adopting.restore(saved)
    assert adopting.nodes == {1: "n1"}


def test_the_holders_file_keeps_history_and_completeness(tmp_path: Path) -> None:
    records = HoldersFile(tmp_path)
    assert records.load("job", 3) is None
    saved = SavedHolders({0: "n0"}, {0: {"n0": 0}, 1: {"n1": 0, "n4": 7}}, complete=True)
    records.save("job", saved)
    assert records.load("job", 3) == saved
    (tmp_path / "rank-holders" / "job.json").write_text('{"holders": {"0": "n0"}}')
    assert records.load("job", 3) == SavedHolders({0: "n0"}, {}, complete=False)
    (tmp_path / "rank-holders" / "job.json").write_text('{"holders": {"0": "n0"}, "history": 1}')
    assert records.load("job", 3) is None  # unreadable: said in the log, nothing known


def test_the_holders_file_forgets_every_job_but_the_one_whose_rank0_runs_here(
    tmp_path: Path,
) -> None:
    """Rank 0 moved to another node: what this node recorded no longer follows the job."""
    records = HoldersFile(tmp_path)
    records.keep_only(())  # nothing recorded yet: nothing to do
    saved = SavedHolders({0: "n0"}, {0: {"n0": 0}}, complete=True)
    for job in ("a", "b", "c"):
        records.save(job, saved)
    records.keep_only({"b"})
    assert [records.load(job, 1) for job in ("a", "b", "c")] == [None, saved, None]
    records.keep_only(())
    assert records.load("b", 1) is None


def test_a_join_from_another_node_is_not_admitted_within_a_round() -> None:
    c = JobCoordinator(config(3), VIEW, "a0")
    c.join(join(1, "a1", "node1"), {})
    c.join(join(1, "x1", "node9"), {})
    assert not c.admitted(1, "x1")
    assert c.admitted(1, "a1")
    assert "held by node 'node1'" in c.refused_why


def test_an_impostor_is_not_queued_for_the_next_round() -> None:
    c = released()
    c.join(join(2, "x2", "node9"), {})  # node 2 is down; node 9 claims its rank
    assert not c.admitted(2, "x2")
    c.join(join(2, "b2", "node2"), {})  # rank 2's own new incarnation waits for rank 0
    assert c.admitted(2, "b2")


def test_a_new_round_rank0_opens_lets_a_rank_change_nodes() -> None:
    c = released()
    c.rank0_incarnation = "b0"
    c.join(join(0, "b0", "node0"), {})
    assert c.phase is Phase.WAITING
    c.join(join(2, "b2", "node7"), {})  # rank 2 rescheduled on node 7
    assert c.admitted(2, "b2")
    assert c.holders.nodes[2] == "node7"


def test_reports_from_another_node_are_refused() -> None:
    c = JobCoordinator(config(2), VIEW, "a0")
    for r in range(2):
        c.join(join(r, f"a{r}", f"node{r}"), {})
    s = c.status(1, "a1")
    with pytest.raises(ReportRefused, match="held by node 'node1'"):
        c.report_restore(1, "a1", s.round, s.plan_version, ready=True, node="node9")
    for r in range(2):
        s = c.status(r, f"a{r}")
        c.report_restore(r, f"a{r}", s.round, s.plan_version, ready=True, node=f"node{r}")
    assert _report(c, 1, "a1", "node9") is None
    assert _report(c, 1, "a1", "node1") is not None


def test_a_restarted_coordinator_adopts_only_the_saved_holders() -> None:
    c = JobCoordinator(config(2), VIEW, "a0")
    c.resume_steady()
    c.holders.restore(SavedHolders({0: "node0", 1: "node1"}))
    assert _report(c, 1, "evil", "node9") is None
    assert 1 not in c.released_incarnations
    assert _report(c, 1, "a1", "node1") is not None
    assert c.released_incarnations[1] == "a1"


def test_a_running_rank_of_a_shared_certificate_passes_to_its_nodes_name() -> None:
    """A move to per-node certificates while the job runs: rank 1's daemon restarts with
    its own certificate and resumes; its steps are produced as node 1 from then on."""
    c = JobCoordinator(config(2), VIEW, "a0")
    for r, node in enumerate(["node0", LEGACY]):
        c.join(join(r, f"a{r}", node), {})
    c.holders.planned(fresh=True)  # as if the job had started with nothing
    for r, node in enumerate(["node0", LEGACY]):
        s = c.status(r, f"a{r}")
        c.report_restore(r, f"a{r}", s.round, s.plan_version, ready=True, node=node)
    assert _report(c, 1, "a1", "node1") is not None
    assert c.holders.nodes[1] == "node1"
    assert c.holders.producers(1, 9) == (LEGACY, "node1")
    assert _report(c, 1, "a1", "node9") is None  # held by a named node now
