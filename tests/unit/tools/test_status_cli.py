"""``mtc status``'s JSON and words for what the daemon's ``Status`` answered: copies named
what they are, and no replication claimed for a one-node job."""

from __future__ import annotations

import pytest

from mtc_replicator._pb.mtc.v1 import node_pb2 as pb
from mtc_replicator.tools.status_cli import _job_json, print_status


def _body(job: pb.JobStatus) -> dict[str, object]:
    return {"address": "10.0.0.7:7070", "version": "0.1.0", "jobs": [_job_json(job)]}


def test_a_finished_jobs_copies_are_held_copies_not_peer_copies(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job that no longer runs here: the node cannot tell its own rank's copies from its
    peers', so they are not called peer copies."""
    done = pb.JobStatus(job="old", active=False, committed_backup_step=5)
    done.peer_copies.append(pb.HeldCopies(rank=0, steps=[4, 5]))
    got = _job_json(done)
    assert got["held_copies"] == [{"rank": 0, "steps": [4, 5]}]
    assert (got["peer_copies"], got["local_steps"]) == (None, [])
    print_status(_body(done), now=0.0)
    assert "copies of rank 0: 4, 5" in capsys.readouterr().out


def test_a_running_jobs_copies_of_other_ranks_are_peer_copies() -> None:
    running = pb.JobStatus(job="j", active=True, rank=1, nodes=4, last_replicated=7)
    running.local_steps.extend([7])
    running.peer_copies.append(pb.HeldCopies(rank=0, steps=[7]))
    got = _job_json(running)
    assert (got["peer_copies"], got["held_copies"]) == ([{"rank": 0, "steps": [7]}], None)


def test_a_one_node_job_reads_not_replicated(capsys: pytest.CaptureFixture[str]) -> None:
    one = pb.JobStatus(job="j", active=True, rank=0, nodes=1, last_backed_up=3)
    print_status(_body(one), now=0.0)
    out = capsys.readouterr().out
    assert "  not replicated (one node), last backed up 3" in out
    assert "last replicated" not in out
    four = pb.JobStatus(job="j", active=True, rank=0, nodes=4, off_node_copies=1)
    print_status(_body(four), now=0.0)
    assert "  last replicated -, last backed up -" in capsys.readouterr().out


def test_a_multi_node_job_with_no_copy_off_its_node_is_said_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    alone = pb.JobStatus(job="j", active=True, rank=0, nodes=4, off_node_copies=0)
    print_status(_body(alone), now=0.0)
    out = capsys.readouterr().out
    assert "NOT REPLICATED" in out
    assert "peers-per-node: 0" in out
    assert "last replicated" not in out
    assert _job_json(alone)["off_node_copies"] == 0
