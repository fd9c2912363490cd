"""``core.bucketcheck``: what a probe's outcome means for readiness and for jobs. The real
stores are probed in ``tests/integration/test_bucket_check.py``."""

from __future__ import annotations

from mtc_replicator.core.bucketcheck import (
    MAX_RETRY_SECONDS,
    RECHECK_REFUSED_SECONDS,
    REMEDY,
    BucketCheck,
    Right,
    Verdict,
    may_heal,
    refused_reason,
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


def test_a_denied_step_names_the_permission_it_needs_on_each_store() -> None:
    denied = "put b/p/_mtc-probe/writable: AccessDenied Access Denied"
    assert refused_reason("s3://b/p", Right.WRITE, denied, denied=True) == (
        f"{denied} (this node may not write under the prefix: it needs s3:PutObject)"
    )
    gcs = refused_reason("gs://b", Right.LIST, "403 forbidden", denied=True)
    assert gcs.endswith("may not list under the prefix: it needs storage.objects.list)")
    file = refused_reason("file:///backup", Right.WRITE, "EACCES", denied=True)
    assert file.endswith("it needs write permission on the directory)")
    unknown = refused_reason("odd://b", Right.READ, "403", denied=True)
    assert unknown.endswith("it needs a permission the store did not name)")


def test_a_refusal_that_is_no_denial_is_told_as_it_is() -> None:
    missing = "bucket b does not exist"
    assert refused_reason("s3://b/p", Right.LIST, missing, denied=False) == missing


def test_no_credentials_at_all_names_no_permission() -> None:
    """Before: "no usable AWS credentials (...) (this node may not list under the prefix:
    it needs s3:ListBucket)", as if a policy were missing; no request was even made."""
    none = "list: no AWS credentials found: boto3 tried the environment (...)"
    said = refused_reason("s3://b/p", Right.LIST, none, denied=True, no_credentials=True)
    assert said == none


def test_a_denied_write_refuses_jobs_with_the_permission_and_the_remedy() -> None:
    check = BucketCheck("s3://b/p", "backup")
    reason = refused_reason("s3://b/p", Right.WRITE, "AccessDenied", denied=True)
    assert check.record(reason, transient=False) == RECHECK_REFUSED_SECONDS
    refusal = check.refusal()
    assert refusal is not None
    assert refusal.endswith("it needs s3:PutObject)")
    assert check.readiness() == f"backup s3://b/p refused: {reason}; {REMEDY}"
    assert "list, read and create objects" in REMEDY


def test_only_a_denied_write_is_a_refusal_other_write_failures_are_retried() -> None:
    assert not may_heal(Right.WRITE, transient=False, denied=True)
    assert may_heal(Right.WRITE, transient=False, denied=False)  # a full file:// disk
    assert may_heal(Right.WRITE, transient=True, denied=False)
    assert not may_heal(Right.LIST, transient=False, denied=False)  # no such bucket
    assert not may_heal(Right.READ, transient=False, denied=True)
    assert may_heal(Right.READ, transient=True, denied=False)
