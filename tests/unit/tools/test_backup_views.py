"""``tools.backup_views``: the JSON and text every ``mtc backups`` command shows of a step,
a verdict and a table."""

from __future__ import annotations

import json
import math

import pytest

from mtc_replicator.core.attestation import Attested
from mtc_replicator.core.signed import Seal
from mtc_replicator.storage.backup_audit import Problem, ProblemKind, StepListing, StepVerdict
from mtc_replicator.tools import backup_views


def _partial(newest_object_at: float) -> StepListing:
    return StepListing(
        job="j", step=7, objects=3, bytes=2048, newest_object_at=newest_object_at,
        manifests=2, commit=None,
    )  # fmt: skip


def test_a_step_without_commit_is_dated_by_its_newest_object() -> None:
    body = backup_views.step_json(_partial(1000.0), now=1000.0 + 7200)
    assert body["state"] == "partial"
    assert body["age_seconds"] == 7200
    assert body["committed_at"] is None
    assert body["items"] == 2
    assert body["signature"] is None


@pytest.mark.parametrize("at", [math.nan, math.inf, -math.inf])
def test_a_non_finite_age_is_null_in_json(at: float) -> None:
    """JSON has no NaN or Infinity; a hostile COMMIT's time can be either."""
    body = backup_views.step_json(_partial(at), now=1000.0)
    assert body["age_seconds"] is None
    json.dumps(body["age_seconds"], allow_nan=False)


def test_a_verdict_names_each_problem() -> None:
    bad = Problem(ProblemKind.SIZE_MISMATCH, "3 bytes, expected 4", item="0-0", key="j/7/x")
    verdict = StepVerdict("j", 7, 1, 2, 7, (bad,), unexpected=("j/7/extra",))
    body = backup_views.verdict_json(verdict)
    assert body["status"] == "CORRUPT"
    assert body["problems"] == [
        {"kind": "size_mismatch", "item": "0-0", "key": "j/7/x", "detail": "3 bytes, expected 4"}
    ]
    assert body["unexpected_objects"] == ["j/7/extra"]
    assert backup_views.verdict_json(StepVerdict("j", 8, 1, 2, 7, ()))["status"] == "OK"


def test_print_verdict_says_where(capsys: pytest.CaptureFixture[str]) -> None:
    bad = Problem(ProblemKind.MISSING_OBJECT, "gone", item="0-0", key="j/7/x")
    backup_views.print_verdict(StepVerdict("j", 7, 1, 2, 7, (bad,)))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "job j step 7: CORRUPT (1 item, 2 objects, 7 B)"
    assert out[1] == "  missing object: item 0-0 j/7/x: gone"


def test_table_pads_every_column_but_the_last(capsys: pytest.CaptureFixture[str]) -> None:
    backup_views.table(["A", "BB", "C"], [["long", "x", "ragged tail"], ["y", "zzz", ""]])
    assert capsys.readouterr().out.splitlines() == [
        "  A     BB   C",
        "  long  x    ragged tail",
        "  y     zzz",
    ]


def test_fail_writes_to_stderr_and_returns_the_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert backup_views.fail("no such job", 2) == 2
    assert capsys.readouterr().err == "mtc backups: error: no such job\n"


def test_a_verdict_says_whether_and_against_which_ca_signatures_were_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    good = StepVerdict(
        "j", 7, 2, 2, 7, (), seal=Seal.VERIFIED, attested=(Attested.VERIFIED, Attested.VERIFIED)
    )
    backup_views.print_verdict(good, "ca.crt (CN=ours)")
    assert capsys.readouterr().out.splitlines()[1] == (
        "  signatures: checked against the CA ca.crt (CN=ours): COMMIT verified, "
        "2 manifests verified"
    )
    backup_views.print_verdict(StepVerdict("j", 7, 1, 1, 7, (), seal=Seal.UNCHECKED))
    assert "signatures: not checked (no --tls-ca)" in capsys.readouterr().out
    refused = Problem(ProblemKind.UNTRUSTED_COMMIT, "not signed", key="j/7/COMMIT")
    body = backup_views.verdict_json(StepVerdict("j", 7, 0, 0, 0, (refused,)), "ca.crt")
    assert body["signatures"] == {
        "checked": True, "ca": "ca.crt", "commit": "refused", "manifests": {}
    }  # fmt: skip
