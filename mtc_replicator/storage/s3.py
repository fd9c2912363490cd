"""``s3://bucket/prefix`` on boto3, for AWS S3 and any S3-compatible server. I/O module.

Credentials, region and endpoint come from boto3's standard chain only (``AWS_*``
variables, ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, config files, instance roles).

Integrity: every object carries its crc32c as metadata (``x-amz-meta-crc32c``), set before
the upload starts, and every request body is sent with ``Content-MD5`` and
``x-amz-checksum-crc32c`` so the server refuses damaged bytes; the MD5 ETag it answers is
compared too (single-part objects and parts, unless KMS or customer-key encryption makes
the ETag something else). Downloads are checked against the metadata crc32c and S3's own
full-object checksum when it has one.

Pacing: a file put with a ``Meter`` hands botocore each body as a ``PacedReader``, which
botocore reads in 128 KiB blocks as it writes them to the socket, so the wire follows the
meter. Payload signing is off (``UNSIGNED-PAYLOAD``) even on plain-HTTP endpoints, where
botocore would otherwise read the whole body once more to hash it before sending (paying
the meter twice, then sending in one burst); the signed ``Content-MD5`` and crc32c
headers still bind the body to the request.

Files larger than ``part_size`` go up as multipart uploads (``core.uploads``), parts sent
in parallel from a bounded window (``storage.parts``): an upload holds at most
``workers + 1`` parts in memory (80 MiB with the defaults); a download streams
``chunk_size`` pieces. 16 MiB parts: within what AWS advises (8-16 MiB), and what moto
takes fastest (docs/performance.md, "Backups to S3 and GCS"). A process
that dies mid-upload leaves an invisible incomplete upload: the rank aborts its own (those
begun before its daemon started) before its next upload (``incomplete_uploads``,
``BackupStore.abort_leftover_uploads``); give the bucket an
``AbortIncompleteMultipartUpload`` lifecycle rule too, for nodes that never come back
(docs/permissions.md).

Retries are botocore's own: its ``standard`` mode unless ``AWS_RETRY_MODE`` or the AWS
config file's ``retry_mode`` names another, as many tries as ``AWS_MAX_ATTEMPTS`` (or
``max_attempts``) says, 3 by default. ``s3_errors`` hooks the client to log every retry
with the failure that caused it, and to stop retrying once a request would run past
``timeout`` seconds from its first try (``StorageTimeout``); its ``translate`` maps what is
left to our errors once. What botocore does not retry is ours: a body the server stored
damaged (``DamagedInTransit``) is sent again, and a download cut off mid-body resumes
where it stopped.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

import boto3
import botocore.exceptions as bexc
import google_crc32c
from botocore.config import Config

from mtc_replicator.core.retry import (
    DEFAULT_STORAGE_TIMEOUT,
    RetryPolicy,
    RetryState,
    call_translated,
    resend_policy,
)
from mtc_replicator.core.uploads import plan_upload
from mtc_replicator.local.fsutil import TMP_PREFIX
from mtc_replicator.local.hashing import CHUNK, file_crc32c
from mtc_replicator.local.pacer import Meter, PacedReader, SharedMeter
from mtc_replicator.storage.objectstore import (
    SIDE_BY_SIDE_MAX,
    BucketNotFound,
    ChecksumMismatch,
    DamagedInTransit,
    IncompleteUpload,
    ObjectInfo,
    ObjectNotFound,
    ObjectStoreError,
    PreconditionFailed,
    check_crc32c,
    check_key,
    is_resendable,
    is_resumable,
    split_bucket_url,
)
from mtc_replicator.storage.parts import (
    b64_crc32c,
    crc32c_b64,
    md5_digest,
    read_small_file,
    upload_parts,
    verified_chunks,
)
from mtc_replicator.storage.s3_errors import MAX_BACKOFF, RetryWatch, translate

if TYPE_CHECKING:
    from botocore.response import StreamingBody
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

log = logging.getLogger(__name__)

T = TypeVar("T")

MIN_PART_SIZE = 5 * 1024 * 1024
"""S3's smallest part (all but the last)."""
MAX_PARTS = 10_000
"""S3's most parts per upload: larger files get larger parts."""
DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_WORKERS = 4
META_CRC32C = "crc32c"
_HEX_CRC_RE = re.compile(r"[0-9a-f]{8}")

_NO_MD5_ETAG = frozenset({"aws:kms", "aws:kms:dsse"})


def _etag_is_md5(response: Mapping[str, Any]) -> bool:
    return (
        response.get("ServerSideEncryption") not in _NO_MD5_ETAG
        and "SSECustomerAlgorithm" not in response
    )


def _check_response(what: str, response: Mapping[str, Any], md5: bytes, crc: int) -> None:
    """Raise a (transient) error if the server reports other bytes than we sent."""
    etag = str(response.get("ETag", "")).strip('"')
    if _etag_is_md5(response) and etag and etag != md5.hex():
        raise DamagedInTransit(
            f"{what}: server stored other bytes (ETag {etag}, sent MD5 {md5.hex()})"
        )
    echoed = response.get("ChecksumCRC32C")
    if echoed is not None and b64_crc32c(echoed) != crc:
        raise DamagedInTransit(f"{what}: server stored other bytes (crc32c {echoed})")


class S3ObjectStore:
    """An ``ObjectStore`` on one bucket and key prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        client: S3Client | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        workers: int = DEFAULT_WORKERS,
        chunk_size: int = CHUNK,
        timeout: float = DEFAULT_STORAGE_TIMEOUT,
    ) -> None:
        """``timeout``: the most seconds one request spends with its retries."""
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"S3 parts must be at least {MIN_PART_SIZE} bytes, got {part_size}")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.bucket = bucket
        self.prefix = prefix
        self.url = url or f"s3://{bucket}/{prefix}"
        self.part_size = part_size
        self.workers = workers
        self.chunk_size = chunk_size
        self.timeout = timeout
        self.policy: RetryPolicy = resend_policy(timeout)
        # No ``retries`` here: botocore takes its mode and tries from the environment and
        # the config file, ``standard`` mode by default.
        self.client: S3Client = client or boto3.session.Session().client(
            "s3",
            config=Config(
                s3={"payload_signing_enabled": False},  # see the module doc, "Pacing"
                connect_timeout=min(10.0, timeout),
                read_timeout=min(60.0, timeout),
                max_pool_connections=max(10, 2 * workers),
            ),
        )
        self._watch = RetryWatch(self.client, timeout)
        self._bucket_checked = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3ObjectStore:
        bucket, prefix = split_bucket_url(url, "s3")
        return cls(bucket, prefix, url=url, **kwargs)

    # --- plumbing -------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` (botocore retries inside it) with its errors translated, and sent again
        when the server stored other bytes than we sent."""
        return call_translated(fn, self.policy, translate, is_resendable, what=what)

    def _ensure_bucket(self) -> None:
        """Check once that the bucket exists and we may list it, so a missing bucket is
        reported as such (a HEAD of a key cannot tell it from a missing object)."""
        if self._bucket_checked:
            return
        what = f"bucket {self.url}"
        try:
            self._call(
                what,
                lambda: self.client.list_objects_v2(
                    Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1
                ),
            )
        except BucketNotFound:
            raise BucketNotFound(f"{what} does not exist") from None
        self._bucket_checked = True  # a race only repeats the check

    # --- writes ---------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        name = self._name(key)
        self._ensure_bucket()
        self._put_object(name, data, if_absent=if_absent)

    def _put_object(
        self, name: str, data: bytes, *, if_absent: bool = False, meter: Meter | None = None
    ) -> None:
        what = f"put {self.bucket}/{name}"
        crc = google_crc32c.value(data)
        md5 = md5_digest(data)
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}

        def put() -> None:
            response = self.client.put_object(
                Bucket=self.bucket,
                Key=name,
                Body=_body(data, meter),
                ContentMD5=base64.b64encode(md5).decode(),
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc32c_b64(crc),
                Metadata={META_CRC32C: f"{crc:08x}"},
                **extra,
            )
            _check_response(what, response, md5, crc)

        self._call(what, put)

    def small_file_workers(self) -> int:
        """Small files of an item move as many at once as a large file's parts
        (``SmallFilesSideBySide``)."""
        return self.workers

    def side_by_side_limit(self) -> int:
        return min(self.part_size, SIDE_BY_SIDE_MAX)  # one PUT of at most one part

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        name = self._name(key)
        self._ensure_bucket()
        t0 = time.monotonic()
        size = os.stat(src).st_size
        plan = plan_upload(
            size, single_limit=self.part_size, part_size=self.part_size, max_parts=MAX_PARTS
        )
        if plan.single:
            data = read_small_file(src, self.part_size)
            check_crc32c(key, google_crc32c.value(data), crc32c)
            self._put_object(name, data, meter=meter)
            parts = 1
        else:
            parts = self._put_multipart(key, name, src, crc32c, plan.part_size, meter=meter)
        dt = max(time.monotonic() - t0, 1e-9)
        log.debug(
            "put %s: %d bytes in %d part(s), %.2fs (%.1f MB/s)",
            name,
            size,
            parts,
            dt,
            size / dt / 1e6,
        )

    def _put_multipart(
        self,
        key: str,
        name: str,
        src: Path,
        crc32c: int | None,
        part_size: int,
        *,
        meter: Meter | None,
    ) -> int:
        what = f"multipart put {self.bucket}/{name}"
        # The crc32c goes into metadata when the upload is created, before any byte is sent.
        expected = crc32c if crc32c is not None else file_crc32c(src)[1]
        created = self._call(
            what,
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket,
                Key=name,
                ChecksumAlgorithm="CRC32C",
                Metadata={META_CRC32C: f"{expected:08x}"},
            ),
        )
        upload_id = created["UploadId"]
        meter = None if meter is None else SharedMeter(meter)  # the parts' threads share it
        try:
            done, _, crc = upload_parts(
                src,
                part_size,
                self.workers,
                lambda number, data: self._upload_part(name, upload_id, number, data, meter),
                name="s3-put",
            )
            check_crc32c(key, crc, expected)
            parts = [part for part, _ in done]
            completed = self._call(
                what,
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                ),
            )
        except BaseException:
            with contextlib.suppress(ObjectStoreError):
                self._call(
                    f"abort {what}",
                    lambda: self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=name, UploadId=upload_id
                    ),
                )
            raise
        # A multipart ETag is the MD5 of the parts' MD5s: the server joined our parts.
        etag = str(completed.get("ETag", "")).strip('"')
        joined = hashlib.md5(b"".join(md5 for _, md5 in done), usedforsecurity=False)
        expected_etag = f"{joined.hexdigest()}-{len(done)}"
        if _etag_is_md5(completed) and etag and etag != expected_etag:
            raise ChecksumMismatch(f"{what}: server assembled ETag {etag}, not {expected_etag}")
        return len(done)

    def _upload_part(
        self, name: str, upload_id: str, number: int, data: bytes, meter: Meter | None
    ) -> tuple[CompletedPartTypeDef, bytes]:
        what = f"part {number} of {self.bucket}/{name}"
        crc = google_crc32c.value(data)
        md5 = md5_digest(data)

        def put() -> CompletedPartTypeDef:
            response = self.client.upload_part(
                Bucket=self.bucket,
                Key=name,
                UploadId=upload_id,
                PartNumber=number,
                Body=_body(data, meter),
                ContentMD5=base64.b64encode(md5).decode(),
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc32c_b64(crc),
            )
            _check_response(what, response, md5, crc)
            return {
                "PartNumber": number,
                "ETag": response["ETag"],
                "ChecksumCRC32C": crc32c_b64(crc),
            }

        return self._call(what, put), md5

    # --- reads ----------------------------------------------------------------------------

    def read_chunks(self, key: str) -> Iterator[bytes]:
        name = self._name(key)
        # No bucket check (a listing): a GET's error code tells a missing bucket from a
        # missing object, and a restoring rank's reads must not list (docs/architecture.md,
        # "Backups").
        what = f"get {self.bucket}/{name}"
        first = self._call(what, lambda: self.client.get_object(Bucket=self.bucket, Key=name))
        etag = first["ETag"]
        expected = _stored_crc32c(what, first)
        unread: list[StreamingBody] = [first["Body"]]

        def open_at(offset: int) -> Iterator[bytes]:
            try:
                if unread:
                    body = unread.pop()
                else:
                    body = self.client.get_object(
                        Bucket=self.bucket, Key=name, Range=f"bytes={offset}-", IfMatch=etag
                    )["Body"]
                with contextlib.closing(body):
                    yield from body.iter_chunks(self.chunk_size)
            except Exception as exc:
                mapped = translate(exc, what)
                if isinstance(mapped, PreconditionFailed):
                    raise ChecksumMismatch(f"{what}: object changed while downloading") from exc
                if mapped is None or mapped is exc:
                    raise
                raise mapped from exc

        yield from verified_chunks(
            open_at,
            what=what,
            size=first["ContentLength"],
            crc32c=expected,
            # A body cut off mid-stream is past botocore's retries: resume it as often.
            backoff=RetryState(
                RetryPolicy(
                    attempts=self._watch.max_attempts,
                    max_delay=MAX_BACKOFF,
                    deadline=self.timeout,
                ),
                is_resumable,
                what=what,
            ),
        )

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.read_chunks(key))

    def head(self, key: str) -> ObjectInfo | None:
        name = self._name(key)
        self._ensure_bucket()
        what = f"head {self.bucket}/{name}"
        try:
            response = self._call(
                what, lambda: self.client.head_object(Bucket=self.bucket, Key=name)
            )
        except ObjectNotFound:
            return None
        return ObjectInfo(key, response["ContentLength"], response["LastModified"].timestamp())

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self._ensure_bucket()
        what = f"list {self.url} {prefix!r}"
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        while True:
            page = self._call(what, lambda: self.client.list_objects_v2(**args))
            for obj in page.get("Contents", []):
                key = obj["Key"][len(self.prefix) :]
                if _listable(key):
                    yield ObjectInfo(key, obj["Size"], obj["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args["ContinuationToken"] = token

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        self._ensure_bucket()
        what = f"list prefixes {self.url} {prefix!r}"
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self.prefix + prefix,
            "Delimiter": "/",
        }
        while True:
            page = self._call(what, lambda: self.client.list_objects_v2(**args))
            for common in page.get("CommonPrefixes", []):
                found = common["Prefix"][len(self.prefix) :]
                if _listable(found.rstrip("/")):
                    yield found
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args["ContinuationToken"] = token

    def incomplete_uploads(self, prefix: str) -> Iterator[IncompleteUpload]:
        self._ensure_bucket()
        what = f"list multipart uploads {self.url} {prefix!r}"
        args: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
        while True:
            page = self._call(what, lambda: self.client.list_multipart_uploads(**args))
            for upload in page.get("Uploads", []):
                key = upload.get("Key", "")[len(self.prefix) :]
                initiated = upload.get("Initiated")
                if _listable(key) and "UploadId" in upload:
                    at = initiated.timestamp() if initiated is not None else 0.0
                    yield IncompleteUpload(key, upload["UploadId"], at)
            if not page.get("IsTruncated"):
                return
            args["KeyMarker"] = page.get("NextKeyMarker", "")
            args["UploadIdMarker"] = page.get("NextUploadIdMarker", "")

    def abort_upload(self, upload: IncompleteUpload) -> None:
        name = self._name(upload.key)

        def abort() -> None:
            try:
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=name, UploadId=upload.upload_id
                )
            except bexc.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise  # else: completed or aborted meanwhile

        self._call(f"abort multipart upload {self.bucket}/{name}", abort)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._ensure_bucket()
        with contextlib.suppress(ObjectNotFound):
            self._call(
                f"delete {self.bucket}/{name}",
                lambda: self.client.delete_object(Bucket=self.bucket, Key=name),
            )


def _body(data: bytes, meter: Meter | None) -> bytes | IO[bytes]:
    """A request body: paced when there is a meter (a fresh reader per attempt, so a
    retried request re-sends, and pays for, every byte)."""
    # botocore needs only read, seek and tell (and len for the Content-Length).
    return data if meter is None else cast("IO[bytes]", PacedReader(data, meter))


def _stored_crc32c(what: str, response: Mapping[str, Any]) -> int | None:
    """The crc32c the store vouches for: our metadata and S3's full-object checksum."""
    meta = response.get("Metadata", {}).get(META_CRC32C, "")
    ours = int(meta, 16) if _HEX_CRC_RE.fullmatch(meta) else None
    # A multipart object's checksum is a checksum of checksums unless it is FULL_OBJECT.
    kind = response.get("ChecksumType")
    whole = kind == "FULL_OBJECT" or (kind is None and "-" not in str(response.get("ETag", "")))
    theirs = b64_crc32c(response.get("ChecksumCRC32C")) if whole else None
    if ours is not None and theirs is not None and ours != theirs:
        raise ChecksumMismatch(f"{what}: metadata crc32c {ours:08x}, S3 says {theirs:08x}")
    return ours if ours is not None else theirs


def _listable(key: str) -> bool:
    """Keys that are ours to show: safe, and not a writer's temp object."""
    try:
        check_key(key)
    except ValueError:
        return False
    return not key.rsplit("/", 1)[-1].startswith(TMP_PREFIX)
