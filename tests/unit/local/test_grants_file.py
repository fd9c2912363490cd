"""``local.grants_file``: the grants a node was handed, kept on its RAM disk, and what they
let it serve with and without ``--require-rank-grant``."""

from __future__ import annotations

from pathlib import Path

from mtc_replicator.core.contract import JobConfig, parse_config
from mtc_replicator.core.grant import Grant
from mtc_replicator.local.grants_file import GrantsFile


def _config(rank: int, nodes: int = 2, job: str = "job") -> JobConfig:
    return parse_config(
        f"job-name: {job}\nframework: orbax\nnode-rank: {rank}\nnodes: {nodes}\n"
        "peers-per-node: 1\nbackup-interval-minutes: 30\n"
    )


def test_a_grant_is_kept_across_a_restart_and_an_unreadable_one_is_ignored(
    tmp_path: Path,
) -> None:
    grants = GrantsFile.opened(tmp_path)
    grants.save(Grant("job", "a1", ("n0", "n1")))
    (tmp_path / "grants" / "bad.json").write_text("{")
    again = GrantsFile.opened(tmp_path)
    assert again.holders("job", 2, 1, "n1") == {0: "n0", 1: "n1"}
    assert again.holders("job", 2, 0, "n1") is None  # another run: this node is rank 1
    assert set(again.grants) == {"job"}


def test_without_requiring_grants_an_ungranted_job_is_served_as_before(tmp_path: Path) -> None:
    grants = GrantsFile.opened(tmp_path)
    assert grants.missing(_config(0), "n0") is None
    assert grants.readers("job", _config(0), "n0") is None  # anyone of the CA
    grants.save(Grant("job", "a1", ("n0", "n1")))
    assert grants.readers("job", _config(0), "n0") == {"n0", "n1"}
    assert grants.readers("job", None, "n0") is None  # not serving it: a later run's nodes


def test_requiring_grants_refuses_a_job_without_one_and_reads_follow_the_newest(
    tmp_path: Path,
) -> None:
    grants = GrantsFile.opened(tmp_path, required=True)
    refused = grants.missing(_config(1), "n1")
    assert refused is not None
    why, remedy = refused
    assert "--require-rank-grant" in why
    assert "(none)" in why
    assert "mtc_replicator.client.rank" in remedy
    assert grants.readers("job", None, "n1") == frozenset()  # nobody
    grants.save(Grant("job", "a1", ("n0", "n1")))
    assert grants.missing(_config(1), "n1") is None
    wrong = grants.missing(_config(0), "n1")  # the pod says rank 0: the grant says rank 1
    assert wrong is not None
    assert "assignment 'a1' for 2 ranks" in wrong[0]
    assert grants.missing(_config(1, nodes=3), "n1") is not None  # resized since
    assert grants.readers("job", None, "n1") == {"n0", "n1"}  # whatever this node serves
    assert grants.readers("job", _config(0, job="other"), "n1") == {"n0", "n1"}
