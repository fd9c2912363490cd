"""Every ordering of a daemon restart, a job restart and the joins: one round, at once.

A pure simulation of what the daemons do around one ``JobCoordinator``: rank 0's daemon
restarting (it re-hosts the coordinator and resumes its incarnation: steady before the job
restart, restoring after it), the old agents' adoption reports, rank 0's daemon accepting
the new ``replicator.yaml`` (it names the new incarnation), the new incarnations' early
progress reports (a step ingested before the round: older agents sent these) and every
rank's join, in every order the causality of one node allows. Whatever the order, each
new incarnation's join is admitted at its first try (after the coordinator it reached was
re-hosted, at its first try to the new one), the round that rank 0's new incarnation opens
is the one released, and the released ranks' reports are answered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.coordination import JobCoordinator, Join, Phase
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.core.progress import Progress
from mtc_replicator.core.restore_plan import NodeInventory

JOB = "job"
VIEW = '{"nodes": 3}'
NODES = 3


def _config() -> JobConfig:
    return JobConfig(
        job_name=JOB,
        framework=Framework.ORBAX,
        node_rank=0,
        nodes=NODES,
        peers_per_node=1,
        backup_interval=BackupInterval(minutes=None, steps=1),
    )


def _join(rank: int, inc: str) -> Join:
    items = {ItemId(JOB, s, rank, 0): f"{rank:02x}{s:02x}".ljust(64, "0") for s in (10, 20)}
    return Join(rank, inc, VIEW, NodeInventory(rank, f"127.0.0.1:{7000 + rank}", items))


class Simulation:
    """The coordinator on rank 0's daemon and what each node's agents send it."""

    def __init__(self) -> None:
        self.coordinator = JobCoordinator(_config(), VIEW, rank0_incarnation="a0")
        for r in range(NODES):
            self.coordinator.join(_join(r, f"a{r}"), {})
        self._release({r: f"a{r}" for r in range(NODES)})
        self.accepted = False
        """Rank 0's daemon took the new replicator.yaml (incarnation b0)."""
        self.joined: set[int] = set()
        """Ranks whose new incarnation joined the coordinator hosted now."""
        self.first_tries: list[tuple[int, bool]] = []

    def _release(self, incs: dict[int, str]) -> None:
        c = self.coordinator
        for r, inc in incs.items():
            s = c.status(r, inc)
            assert s.phase is Phase.FETCH, (r, s)
            c.report_restore(r, inc, s.round, s.plan_version, ready=True)
        assert c.phase is Phase.RELEASED

    def restart_daemon0(self) -> None:
        """SIGKILL and restart: a new coordinator, for the incarnation the daemon resumes."""
        steady = not self.accepted
        c = JobCoordinator(_config(), VIEW, rank0_incarnation="b0" if self.accepted else "a0")
        if steady:
            c.resume_steady()
        self.coordinator = c
        self.joined = set()  # joined ranks find the new coordinator id and join again

    def adoption_report(self, rank: int) -> None:
        self.coordinator.report_progress(rank, f"a{rank}", Progress(20), now=1.0)

    def accept(self) -> None:
        self.accepted = True
        self.coordinator.rank0_incarnation = "b0"

    def early_report(self, rank: int) -> None:
        self.coordinator.report_progress(rank, f"b{rank}", Progress(20), now=1.0)

    def join(self, rank: int) -> None:
        c = self.coordinator
        c.join(_join(rank, f"b{rank}"), {})
        self.first_tries.append((rank, c.admitted(rank, f"b{rank}")))
        self.joined.add(rank)

    def finish(self) -> None:
        """Ranks that joined an earlier host of the coordinator join the new one."""
        for r in range(NODES):
            if r not in self.joined:
                self.join(r)
        c = self.coordinator
        opened = c.round
        self._release({r: f"b{r}" for r in range(NODES)})
        assert c.round == opened
        assert c.released_incarnations == {r: f"b{r}" for r in range(NODES)}
        for r in range(NODES):
            answer = c.report_progress(r, f"b{r}", Progress(20), now=2)
            assert answer is not None
            assert answer.restorable_step == 20


EVENTS = ("restart", "adopt1", "adopt2", "accept", "early0", "early1", "join0", "join1", "join2")
BEFORE = (
    # (a, b): a happens before b on its node.
    ("accept", "early0"),
    ("early0", "join0"),
    ("early1", "join1"),
    ("adopt1", "early1"),
    ("adopt2", "join2"),
)


def orderings(events: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Every order of ``events`` (a list with repeats: each order once) that ``BEFORE``
    allows."""
    if not events:
        yield ()
        return
    for event in sorted(set(events)):
        if any(b == event and a in events for a, b in BEFORE):
            continue  # something that must come first has not happened yet
        rest = list(events)
        rest.remove(event)
        for tail in orderings(rest):
            yield (event, *tail)


def play(order: Sequence[str]) -> Simulation:
    sim = Simulation()
    for event in order:
        if event == "restart":
            sim.restart_daemon0()
        elif event.startswith("adopt"):
            sim.adoption_report(int(event[-1]))
        elif event == "accept":
            sim.accept()
        elif event.startswith("early"):
            sim.early_report(int(event[-1]))
        else:
            sim.join(int(event[-1]))
    sim.finish()
    return sim


@pytest.mark.parametrize("restarts", [0, 1, 2])
def test_every_ordering_restores_in_the_round_rank_0_opens(restarts: int) -> None:
    events = list(EVENTS)
    if restarts == 0:
        events.remove("restart")
    elif restarts == 2:
        events.append("restart")  # twice: before and after the job restart, in any order
    count = 0
    for order in orderings(events):
        count += 1
        try:
            sim = play(order)
        except AssertionError as exc:
            raise AssertionError(f"ordering {order}: {exc}") from None
        refused = [r for r, admitted in sim.first_tries if not admitted]
        assert not refused, f"ordering {order}: first joins of ranks {refused} refused"
    assert count >= 500


def test_the_issue_sequence_restarted_rank_0_then_a_job_restart() -> None:
    # Rank 0's daemon restarted in steady state, its old agent not heard from yet; the job
    # restarts and rank 0's new incarnation reports a step it ingested before joining.
    sim = play(("restart", "accept", "early0", "join1", "join2", "join0"))
    assert sim.first_tries == [(1, True), (2, True), (0, True)]
