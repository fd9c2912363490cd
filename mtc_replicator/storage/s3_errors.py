"""What S3 and botocore errors mean to us, decided once, and the watch on botocore's retries.

``translate`` maps a botocore, urllib3 or connection error to our ``ObjectStoreError`` types
(transient or not); ``RetryWatch`` hooks a client's events to log every retry botocore makes
silently, with the failure behind it, and to stop one that would run past the storage
timeout (``StorageTimeout``). Part of the S3 adapter (``storage.s3``): no I/O of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import botocore.exceptions as bexc
import urllib3.exceptions

from mtc_replicator.core.manifest import Cancelled
from mtc_replicator.storage.objectstore import (
    BucketNotFound,
    DamagedInTransit,
    NoCredentials,
    ObjectNotFound,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
    ResendRequested,
    StorageTimeout,
    TransientError,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_RESEND_CODES = frozenset({"ConditionalRequestConflict", "OperationAborted"})
"""A concurrent conditional write to the same key: S3 asks for a retry, botocore makes none."""
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AccountProblem",
    }
)
_DAMAGED_CODES = frozenset({"BadDigest", "XAmzContentSHA256Mismatch"})
"""The body arrived damaged; it is still in memory, so sending it again fixes it."""
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
"""What botocore's modes retry besides throttling codes and broken connections."""
NO_AWS_CREDENTIALS = (
    "no AWS credentials found: boto3 tried the environment (AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY), a web identity token (AWS_ROLE_ARN with "
    "AWS_WEB_IDENTITY_TOKEN_FILE: IRSA on EKS), the shared files (~/.aws/credentials, "
    "~/.aws/config, AWS_PROFILE), container credentials (EKS Pod Identity, ECS) and the "
    "EC2 instance metadata service; give the daemon one of them: static keys in the Secret "
    "mtc-backup-credentials, or a role through the ServiceAccount (docs/deploy.md, "
    "Backup credentials)"
)
"""Said instead of botocore's "Unable to locate credentials", which names no source."""
MAX_BACKOFF = 20.0
"""The longest wait botocore's retry modes make between two tries."""


def translate(exc: BaseException, what: str) -> ObjectStoreError | None:
    """Our error for a botocore/urllib3 one, or None if ``exc`` is not a storage error.

    The one place that decides what is transient: throttling, 5xx, timeouts and broken
    connections are; permissions, a missing bucket and bad requests are not.
    """
    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, bexc.ClientError):
        error: Mapping[str, Any] = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        message = f"{what}: {code or status} {error.get('Message', '')}".rstrip()
        if code == "NoSuchBucket":
            return BucketNotFound(message)
        if code in _NOT_FOUND_CODES:
            return ObjectNotFound(what)
        if code == "PreconditionFailed" or status == 412:
            return PreconditionFailed(message)
        if code in _DAMAGED_CODES:
            return DamagedInTransit(message)
        if code in _RESEND_CODES:
            return ResendRequested(message)
        if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
            return TransientError(message)
        if code in _DENIED_CODES or status in (401, 403):
            return PermissionDenied(message)
        return ObjectStoreError(message)
    if isinstance(exc, bexc.NoCredentialsError):
        return NoCredentials(f"{what}: {NO_AWS_CREDENTIALS}")
    if isinstance(exc, bexc.PartialCredentialsError):
        return PermissionDenied(f"{what}: no usable AWS credentials ({exc})")
    if isinstance(
        exc,
        bexc.HTTPClientError  # timeouts, closed connections, broken response streams
        | bexc.ConnectionError  # cannot connect (not the builtin ConnectionError)
        | bexc.IncompleteReadError
        | urllib3.exceptions.HTTPError
        | ConnectionError
        | TimeoutError,
    ):
        return TransientError(f"{what}: {type(exc).__name__}: {exc}")
    if isinstance(exc, bexc.BotoCoreError):
        return ObjectStoreError(f"{what}: {exc}")
    return None


_DEADLINE = "mtc_deadline"
_STARTED = "mtc_started"
_FAILURE = "mtc_last_failure"


class RetryWatch:
    """Hooks on one client's events around botocore's retries, which it keeps silent.

    ``before-call`` starts a request's clock; ``needs-retry`` (run before botocore's own
    handler decides) notes why an attempt failed, and raises ``StorageTimeout`` when the
    longest wait botocore could make next would end past the deadline; ``request-created``
    of a second or later attempt logs the retry with that reason."""

    def __init__(self, client: S3Client, timeout: float) -> None:
        self.timeout = timeout
        retries: Mapping[str, Any] = getattr(client.meta.config, "retries", None) or {}
        default = 5 if retries.get("mode") == "legacy" else 3  # botocore's own defaults
        self.max_attempts = int(retries.get("total_max_attempts") or default)
        events = client.meta.events
        events.register("before-call.s3", self.started)
        events.register_first("needs-retry.s3", self.attempt_failed)
        events.register("request-created.s3", self.retrying)

    def started(self, context: dict[str, Any], **_: Any) -> None:
        now = time.monotonic()
        context[_STARTED] = now
        context[_DEADLINE] = now + self.timeout

    def attempt_failed(
        self,
        attempts: int,
        response: tuple[Any, Mapping[str, Any]] | None,
        caught_exception: BaseException | None,
        request_dict: Mapping[str, Any],
        operation: Any,
        **_: Any,
    ) -> None:
        if isinstance(caught_exception, bexc.HTTPClientError):
            inner = caught_exception.kwargs.get("error")
            if isinstance(inner, Cancelled):
                # Our body's read stopped the send (the transfer was cancelled): botocore
                # wrapped it as a broken connection, which its modes would retry.
                raise inner
        reason = _retryable_reason(response, caught_exception)
        if reason is None:
            return  # a success, or an error no mode retries: botocore answers it
        context = request_dict["context"]
        context[_FAILURE] = reason
        what = f"{operation.name} {request_dict.get('url_path', '')}"
        log.debug("%s: attempt %d failed: %s", what, attempts, reason)
        if attempts >= self.max_attempts:
            return  # botocore gives up now with the error itself
        now = time.monotonic()
        wait = min(MAX_BACKOFF, 2.0 ** (attempts - 1))
        if now + wait > context.get(_DEADLINE, float("inf")):
            elapsed = now - context.get(_STARTED, now)
            raise StorageTimeout(
                f"{what}: gave up after {attempts} attempts in {elapsed:.1f}s, at the storage "
                f"timeout of {self.timeout:g}s: {reason}"
            )

    def retrying(self, request: Any, operation_name: str, **_: Any) -> None:
        context = getattr(request, "context", {})
        attempt = context.get("retries", {}).get("attempt", 1)
        if attempt > 1:
            log.warning(
                "retrying %s %s (attempt %d of %s): %s",
                operation_name,
                request.url.split("?")[0],
                attempt,
                self.max_attempts,
                context.get(_FAILURE, "an earlier attempt failed"),
            )


def _retryable_reason(
    response: tuple[Any, Mapping[str, Any]] | None, caught: BaseException | None
) -> str | None:
    """Why an attempt failed, if it is a failure botocore's modes may retry."""
    if caught is not None:
        return f"{type(caught).__name__}: {caught}"
    if response is None:
        return None
    http, parsed = response
    status = int(getattr(http, "status_code", 0) or 0)
    code = str(parsed.get("Error", {}).get("Code", ""))
    if status in _RETRIED_STATUS or code in _TRANSIENT_CODES:
        return f"{status} {code} {parsed.get('Error', {}).get('Message', '')}".rstrip()
    return None
