"""``core.bucketcheck``: what a probe's outcome means for readiness and for jobs. The real
stores are probed in ``tests/integration/test_bucket_check.py``."""

from __future__ import annotations

from mtc_replicator.core.bucketcheck import (
    MAX_RETRY_SECONDS,
    RECHECK_REFUSED_SECONDS,
    BucketCheck,
    Verdict,
)


def test_unchecked_is_not_ready_and_refuses_nothing() -> None:
    check = BucketCheck("s3://b/p", "backup")
    assert check.readiness() == "backup s3://b/p: not checked yet"
    assert check.refusal() is None


def test_a_refusal_is_told_to_jobs_and_checked_again_rarely() -> None:
    check = BucketCheck("s3://b/p", "backup")
    assert check.record("no usable AWS credentials", transient=False) == RECHECK_REFUSED_SECONDS
    assert check.verdict is Verdict.REFUSED
    assert check.refusal() == (
        "the backup location s3://b/p cannot be used: no usable AWS credentials"
    )
    readiness = check.readiness()
    assert readiness is not None
    assert "refused: no usable AWS credentials" in readiness


def test_an_outage_backs_off_up_to_a_cap_and_refuses_no_job() -> None:
    check = BucketCheck("gs://b", "registry")
    waits = [check.record("reset", transient=True) for _ in range(20)]
    assert all(w is not None and 0 < w <= MAX_RETRY_SECONDS for w in waits)
    assert waits[-1] is not None
    assert waits[-1] >= MAX_RETRY_SECONDS / 2
    assert check.refusal() is None
    assert check.readiness() == "registry gs://b unreachable, retrying: reset"


def test_usable_again_clears_everything() -> None:
    check = BucketCheck("s3://b/p", "backup")
    check.record("denied", transient=False)
    assert check.record(None, transient=False) is None
    assert (check.readiness(), check.refusal(), check.verdict) == (None, None, Verdict.USABLE)
