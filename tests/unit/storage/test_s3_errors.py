"""``storage.s3_errors``: S3's and botocore's errors, each mapped once to ours.

Pure: the vendor exceptions are built in memory.
"""

from __future__ import annotations

import pytest

from mtc_replicator.storage.objectstore import (
    BucketNotFound,
    DamagedInTransit,
    NoCredentials,
    ObjectNotFound,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
    ResendRequested,
    TransientError,
)


def client_error(code: str, status: int, operation: str = "GetObject") -> Exception:
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": f"message of {code}"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, operation)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "status", "expected"),
    [
        ("SlowDown", 503, TransientError),
        ("503", 503, TransientError),  # a HEAD answer has no body, only the status
        ("ServiceUnavailable", 503, TransientError),
        ("InternalError", 500, TransientError),
        ("TooManyRequests", 429, TransientError),
        ("RequestTimeout", 400, TransientError),
        ("BadDigest", 400, DamagedInTransit),
        ("ConditionalRequestConflict", 409, ResendRequested),
        ("AccessDenied", 403, PermissionDenied),
        ("InvalidAccessKeyId", 403, PermissionDenied),
        ("SignatureDoesNotMatch", 403, PermissionDenied),
        ("403", 403, PermissionDenied),
        ("NoSuchBucket", 404, BucketNotFound),
        ("NoSuchKey", 404, ObjectNotFound),
        ("404", 404, ObjectNotFound),
        ("PreconditionFailed", 412, PreconditionFailed),
        ("InvalidArgument", 400, ObjectStoreError),
        ("NoSuchUpload", 404, ObjectStoreError),
    ],
)
def test_s3_errors_are_classified(code: str, status: int, expected: type[Exception]) -> None:
    pytest.importorskip("boto3")
    from mtc_replicator.storage.s3_errors import translate

    mapped = translate(client_error(code, status), "get b/k")
    assert type(mapped) is expected
    assert mapped is not None
    assert mapped.transient == issubclass(expected, TransientError)


def test_s3_transport_errors_are_transient() -> None:
    pytest.importorskip("boto3")
    import botocore.exceptions as bexc
    import urllib3.exceptions

    from mtc_replicator.storage.s3_errors import translate

    for exc in [
        bexc.EndpointConnectionError(endpoint_url="http://x"),
        bexc.ConnectTimeoutError(endpoint_url="http://x"),
        bexc.ReadTimeoutError(endpoint_url="http://x"),
        bexc.ConnectionClosedError(endpoint_url="http://x"),
        bexc.ResponseStreamingError(error="reset"),
        urllib3.exceptions.ProtocolError("reset"),
        ConnectionResetError(),
    ]:
        assert isinstance(translate(exc, "op"), TransientError), exc
    partial = bexc.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY")
    assert isinstance(translate(partial, "op"), PermissionDenied)
    assert translate(ValueError("bug"), "op") is None


def test_no_aws_credentials_at_all_say_which_sources_were_tried() -> None:
    pytest.importorskip("boto3")
    import botocore.exceptions as bexc

    from mtc_replicator.storage.s3_errors import translate

    none = translate(bexc.NoCredentialsError(), "list s3://b/p")
    assert isinstance(none, NoCredentials)
    said = str(none)
    assert said.startswith("list s3://b/p: no AWS credentials found")
    for source in ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "~/.aws/credentials"):
        assert source in said
    assert "instance metadata" in said
    assert "mtc-backup-credentials" in said
