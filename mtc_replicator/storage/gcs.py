"""``gs://bucket/prefix`` on google-cloud-storage. I/O module.

Credentials come from the SDK's standard chain only: Application Default Credentials, or
anonymous ones (project from ``GOOGLE_CLOUD_PROJECT``) when ``STORAGE_EMULATOR_HOST`` points
at an emulator. The client is made on first use, so opening a store does no I/O.

Integrity: GCS keeps a crc32c of every object, composite ones included, and the same
polynomial as our manifests. Uploads declare it so the server refuses damaged bytes, and
the crc32c GCS reports back is compared with ours; downloads are checked against it.

Pacing: the SDK reads a whole request body before it sends it, so a file put with a
``Meter`` is paced where it is sent instead: the client's HTTP session sends every body of a
request made while the uploading thread names a meter (``_SENDING``) as a ``_PacedBody``,
one booked slice at a time.

A file up to ``part_size`` is read into memory, checked, and sent in one request. A larger
one is one resumable upload streamed from the open file, its crc32c checked before and
declared when the upload starts, so GCS refuses a file that changed meanwhile: up to
``single_limit`` (150 MiB) its one data request carries the whole file, above it the file
goes in ``part_size`` chunks one after another, so the SDK holds one chunk in memory. No
upload makes a temporary object: nothing needs delete permission, nothing is composed, and
a process that dies mid-upload leaves only an unfinished session GCS drops after a week,
never a billed object. Why not parallel composite or XML multipart uploads:
docs/performance.md ("GCS uploads without temporary objects").

Retries are google-cloud-storage's own (``google.api_core.retry.Retry``): every request
that fails with what ``translate`` calls transient is tried again, with growing jittered
waits, until ``timeout`` seconds after its first try (``StorageTimeout``); each retry is
logged with its reason. Uploads are retried whether or not they carry a precondition: the
SDK's own default retries only conditional writes, because an unconditional one repeated
could overwrite a newer object; ours put the same bytes under the same name, and the
create-only ones (``ifGenerationMatch=0``) answer a repeat that lost its answer with 412,
which callers re-read (``ObjectStore.put_bytes``). A body GCS refused as damaged is sent
again by us (``DamagedInTransit``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import google.auth.exceptions as gauth
import google_crc32c
import requests
import urllib3.exceptions
from google.api_core import exceptions as gapi
from google.api_core.retry import Retry
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from mtc_replicator.core.retry import (
    DEFAULT_STORAGE_TIMEOUT,
    RetryPolicy,
    RetryState,
    call_translated,
    resend_policy,
)
from mtc_replicator.core.uploads import plan_upload
from mtc_replicator.local.fsutil import TMP_PREFIX
from mtc_replicator.local.hashing import CHUNK, open_regular
from mtc_replicator.local.pacer import Meter
from mtc_replicator.storage.objectstore import (
    SIDE_BY_SIDE_MAX,
    BucketNotFound,
    ChecksumMismatch,
    DamagedInTransit,
    NoCredentials,
    ObjectInfo,
    ObjectNotFound,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
    StorageTimeout,
    TransientError,
    check_crc32c,
    check_key,
    is_resendable,
    is_resumable,
    split_bucket_url,
)
from mtc_replicator.storage.parts import b64_crc32c, crc32c_b64, read_small_file, verified_chunks

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PART_SIZE = 32 * 1024 * 1024
DEFAULT_SINGLE_LIMIT = 150 * 1024 * 1024
"""Files up to this size go up in one request, larger ones in ``part_size`` chunks."""
FIRST_WAIT = 1.0
MAX_WAIT = 32.0
"""The SDK's waits between tries grow from ``FIRST_WAIT`` to this (jittered)."""
RESUMABLE_ALIGN = 256 * 1024
"""A resumable upload's chunk size must be a multiple of this."""
SDK_MULTIPART_MAX = 8 * 1024 * 1024
"""The SDK sends a stream up to this size as a multipart request, which cannot declare
our crc32c: such files go up from memory, checked before they are sent."""
SMALL_PUT_WORKERS = 4
"""Small files of an item moved at once: four round trips overlap, four in memory."""
DEFAULT_RANGE = 16 * 1024 * 1024
"""Bytes per ranged GET of a download: what one stream holds in memory."""
_CORRUPT_UPLOAD = "doesn't match calculated"  # GCS's words when it refuses damaged bytes

_SENDING: ContextVar[Meter | None] = ContextVar("mtc_gcs_sending", default=None)
"""The meter that pays for the request bodies this thread sends now (None: unpaced)."""
_RESUMING: ContextVar[_ResumableSource | None] = ContextVar("mtc_gcs_resuming", default=None)
"""The file this thread streams into a resumable upload now (None: none)."""
_PERSISTED_RE = re.compile(r"bytes=0-([0-9]+)")


class _ResumableSource:
    """The file a resumable upload reads its chunks from, moved back to where GCS says it
    stopped when a chunk was persisted only in part (a 308 whose ``Range`` ends before the
    chunk did): the SDK takes the new offset from that answer but reads its next chunk
    where the file is, and refuses the mismatch (ValueError) instead of sending on."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._resume_at: int | None = None

    def persisted(self, upto: int) -> None:
        self._resume_at = upto

    def tell(self) -> int:
        at, self._resume_at = self._resume_at, None
        if at is not None and at < self._f.tell():
            self._f.seek(at)
        return self._f.tell()

    def read(self, size: int = -1) -> bytes:
        return self._f.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._resume_at = None
        return self._f.seek(offset, whence)


class _PacedAdapter(requests.adapters.BaseAdapter):
    """Sends through the session's own adapter, each request body at the pace of the
    current ``_SENDING`` meter: the bytes go to the socket only as the meter allows."""

    def __init__(self, inner: requests.adapters.BaseAdapter) -> None:
        super().__init__()
        self.inner = inner

    def send(
        self, request: requests.PreparedRequest, *args: Any, **kwargs: Any
    ) -> requests.Response:
        meter, body = _SENDING.get(), request.body
        if meter is not None and isinstance(body, bytes) and body:
            # A copy: the SDK may send the same prepared request again (its own retry).
            request = request.copy()
            request.body = _PacedBody(body, meter)  # type: ignore[assignment]  # any iterable
        response = self.inner.send(request, *args, **kwargs)
        source = _RESUMING.get()
        if source is not None and request.method == "PUT" and response.status_code == 308:
            m = _PERSISTED_RE.fullmatch(response.headers.get("Range", ""))
            if m is not None:
                source.persisted(int(m.group(1)) + 1)
        return response

    def close(self) -> None:
        self.inner.close()


class _PacedBody:
    """A request body that urllib3 sends slice by slice as the meter allows.

    An iterable rather than a file: urllib3 reads a file 16 KiB at a time, a call and a
    copy per read on our side and as many small reads on the server's; it sends each
    item of an iterable as is, here a view of one booked slice (64 KiB to 4 MiB). The
    request keeps the ``Content-Length`` of the bytes it replaces."""

    def __init__(self, data: bytes, meter: Meter) -> None:
        self._data = data
        self._meter = meter

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[memoryview]:
        return self._meter.paced(self._data)


def _pace_sends(session: requests.Session) -> None:
    """Route every adapter of ``session`` (plain, or mutual-TLS) through ``_PacedAdapter``."""
    for prefix, adapter in list(session.adapters.items()):
        if not isinstance(adapter, _PacedAdapter):
            session.mount(prefix, _PacedAdapter(adapter))


NO_GOOGLE_CREDENTIALS = (
    "no Google credentials found: Application Default Credentials tried "
    "GOOGLE_APPLICATION_CREDENTIALS (a key or workload identity federation file), gcloud's "
    "application_default_credentials.json and the GCE/GKE metadata server (Workload "
    "Identity); give the daemon one of them: bind its Kubernetes ServiceAccount to a Google "
    "service account (docs/deploy.md, Backup credentials)"
)
"""Said instead of google.auth's "default credentials were not found"."""


def translate(exc: BaseException, what: str) -> ObjectStoreError | None:
    """Our error for an SDK/transport one, or None if ``exc`` is not a storage error.

    The one place that decides what is transient: 408/429/5xx, timeouts, broken
    connections and bytes damaged in transit are; permissions and bad requests are not.
    """
    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, gapi.RetryError):  # the SDK's retries ran out of time
        cause = exc.cause
        last = translate(cause, what) if isinstance(cause, BaseException) else None
        return StorageTimeout(f"{what}: gave up at the storage timeout ({exc.message}): {last}")
    if isinstance(exc, InvalidResponse):
        status = getattr(getattr(exc, "response", None), "status_code", 0) or 0
        return _by_status(int(status), f"{what}: {_redact(exc)}", what)
    if isinstance(exc, gapi.GoogleAPICallError):
        message = _redact(exc.message)
        return _by_status(int(exc.code or 0), f"{what}: {exc.code} {message}", what)
    if isinstance(exc, DataCorruption):
        return DamagedInTransit(f"{what}: damaged in transit: {_redact(exc)}")
    if isinstance(exc, gauth.DefaultCredentialsError):
        return NoCredentials(f"{what}: {NO_GOOGLE_CREDENTIALS}")
    if isinstance(exc, gauth.RefreshError):
        return PermissionDenied(f"{what}: no usable Google credentials ({_redact(exc)})")
    if isinstance(
        exc,
        requests.ConnectionError
        | requests.Timeout
        | requests.exceptions.ChunkedEncodingError
        | gauth.TransportError
        | urllib3.exceptions.HTTPError
        | ConnectionError
        | TimeoutError,
    ):
        return TransientError(f"{what}: {type(exc).__name__}: {_redact(exc)}")
    return None


_QUERY = re.compile(r"\?[^\s'\")>]+")


def _redact(said: object) -> str:
    """``said`` (an error or its message) as text without URL query strings: a resumable
    upload's URL carries its ``upload_id``, which works as a credential for that session
    (GCS's documentation) and must not reach logs or ``replicator.errors``, which the
    training pod reads."""
    return _QUERY.sub("?<query>", str(said))


def _by_status(status: int, message: str, what: str) -> ObjectStoreError:
    if status == 404:
        return ObjectNotFound(what)
    if status == 412:
        return PreconditionFailed(message)
    if status in (401, 403):
        return PermissionDenied(message)
    if status in (408, 429) or status >= 500:
        return TransientError(message)
    if status in (400, 409) and _CORRUPT_UPLOAD in message:
        return DamagedInTransit(message)  # the upload is still in memory: resend it
    return ObjectStoreError(message)


def _sdk_retries(exc: BaseException) -> bool:
    """The SDK's retry predicate: what ``translate`` calls transient, except damaged
    bodies, which ``_call`` sends again once the SDK's request has returned."""
    mapped = translate(exc, "")
    return mapped is not None and mapped.transient and not isinstance(mapped, DamagedInTransit)


def _stream_crc32c(f: BinaryIO, block: int) -> int:
    """crc32c of an open file from its start (left at its end), read ``block`` bytes at a
    time."""
    f.seek(0)
    crc = 0
    while chunk := f.read(block):
        crc = google_crc32c.extend(crc, chunk)
    return crc


def _listable(key: str) -> bool:
    try:
        check_key(key)
    except ValueError:
        return False
    return not key.rsplit("/", 1)[-1].startswith(TMP_PREFIX)


class GcsObjectStore:
    """An ``ObjectStore`` on one bucket and object-name prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        url: str | None = None,
        client: storage.Client | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        single_limit: int = DEFAULT_SINGLE_LIMIT,
        chunk_size: int = CHUNK,
        range_size: int = DEFAULT_RANGE,
        timeout: float = DEFAULT_STORAGE_TIMEOUT,
    ) -> None:
        """``timeout``: the most seconds one request spends with its retries."""
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if part_size < 1 or chunk_size < 1 or range_size < 1:
            raise ValueError("part, chunk and range sizes must be positive")
        self.bucket_name = bucket
        self.prefix = prefix
        self.url = url or f"gs://{bucket}/{prefix}"
        self.part_size = part_size
        self.single_limit = max(single_limit, part_size)
        self.chunk_size = chunk_size
        self.range_size = max(range_size, chunk_size)
        self.storage_timeout = timeout
        self.policy: RetryPolicy = resend_policy(timeout)
        self.timeout = (min(10.0, timeout), min(60.0, timeout))
        """Per HTTP request: connect, and each read."""
        self._client = client
        self._bucket: storage.Bucket | None = None
        self._bucket_checked = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> GcsObjectStore:
        bucket, prefix = split_bucket_url(url, "gs")
        return cls(bucket, prefix, url=url, **kwargs)

    # --- plumbing -------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` (the SDK retries inside it, as ``_retry`` says) with its errors
        translated, and sent again when GCS refused the bytes as damaged."""
        return call_translated(fn, self.policy, translate, is_resendable, what=what)

    def _retry(self, what: str) -> Retry:
        """The SDK's retries of one request: transient errors until the storage timeout,
        each one logged (the SDK's own are silent)."""
        attempts = itertools.count(1)

        def failed(exc: Exception) -> None:
            log.warning(
                "retrying %s (attempt %d failed): %s", what, next(attempts), translate(exc, what)
            )

        return Retry(
            predicate=_sdk_retries,
            initial=FIRST_WAIT,
            maximum=MAX_WAIT,
            multiplier=2.0,
            timeout=self.storage_timeout,
            on_error=failed,
        )

    def _get_bucket(self) -> storage.Bucket:
        """The bucket handle, made on first use; checks once that the bucket exists."""
        with self._lock:
            if self._bucket is None:
                what = f"client for {self.url}"
                self._client = self._client or self._call(what, storage.Client)
                _pace_sends(self._client._http)
                self._bucket = self._client.bucket(self.bucket_name)
            bucket = self._bucket
        if not self._bucket_checked:
            what = f"bucket {self.url}"
            try:
                self._call(what, lambda: self._first_page(bucket, self.prefix, 1, None))
            except ObjectNotFound:
                raise BucketNotFound(f"{what} does not exist") from None
            self._bucket_checked = True
        return bucket

    def _first_page(
        self, bucket: storage.Bucket, prefix: str, size: int | None, token: str | None
    ) -> tuple[list[storage.Blob], str | None]:
        blobs = bucket.client.list_blobs(
            bucket,
            prefix=prefix,
            page_size=size,
            max_results=size,
            page_token=token,
            retry=self._retry(f"list {self.url} {prefix!r}"),
            timeout=self.timeout,
        )
        page = next(blobs.pages, None)
        return (list(page) if page is not None else []), blobs.next_page_token

    def _upload(
        self,
        blob: storage.Blob,
        data: bytes,
        *,
        if_absent: bool = False,
        meter: Meter | None = None,
    ) -> None:
        """One object from memory, sent with its crc32c and checked against GCS's."""
        what = f"put {self.bucket_name}/{blob.name}"
        crc = google_crc32c.value(data)

        def put() -> None:
            sending = _SENDING.set(meter)
            try:
                blob.upload_from_string(
                    data,
                    content_type="application/octet-stream",
                    checksum="crc32c",
                    crc32c_checksum_value=crc32c_b64(crc),
                    if_generation_match=0 if if_absent else None,
                    retry=self._retry(what),  # see the module doc: safe for our writes
                    timeout=self.timeout,
                )
            finally:
                _SENDING.reset(sending)
            stored = b64_crc32c(blob.crc32c)
            if stored != crc:
                raise DamagedInTransit(f"{what}: GCS stored crc32c {blob.crc32c}, sent {crc:08x}")

        self._call(what, put)

    # --- writes ---------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        name = self._name(key)
        self._upload(self._get_bucket().blob(name), data, if_absent=if_absent)

    def small_file_workers(self) -> int:
        """Small files of an item move this many at once (``SmallFilesSideBySide``)."""
        return SMALL_PUT_WORKERS

    def side_by_side_limit(self) -> int:
        return min(max(self.part_size, SDK_MULTIPART_MAX), SIDE_BY_SIDE_MAX)  # one request

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        name = self._name(key)
        bucket = self._get_bucket()
        t0 = time.monotonic()
        size = os.stat(src).st_size
        # One object, however large: only the chunk size depends on the size.
        plan = plan_upload(
            size, single_limit=self.single_limit, part_size=self.part_size, max_parts=size + 1
        )
        if size <= max(self.part_size, SDK_MULTIPART_MAX):
            data = read_small_file(src, size)
            check_crc32c(key, google_crc32c.value(data), crc32c)
            self._upload(bucket.blob(name), data, meter=meter)
            parts = 1
        else:
            parts = self._put_streamed(
                bucket, key, name, src, crc32c, chunk=plan.part_size, meter=meter
            )
        dt = max(time.monotonic() - t0, 1e-9)
        log.debug(
            "put %s: %d bytes in %d part(s), %.2fs (%.1f MB/s)",
            name,
            size,
            parts,
            dt,
            size / dt / 1e6,
        )

    def _put_streamed(
        self,
        bucket: storage.Bucket,
        key: str,
        name: str,
        src: Path,
        crc32c: int | None,
        *,
        chunk: int,
        meter: Meter | None,
    ) -> int:
        """One resumable upload from the open file, in data requests of ``chunk`` bytes
        (rounded up as GCS requires) sent one after another; returns their number.

        Before each attempt the open file's crc32c is taken and checked against ``crc32c``;
        the upload declares it, so GCS refuses bytes that changed after the check, and the
        stored object's crc32c is compared with it again. The object exists only once the
        last chunk is in: there is nothing to clean up after a failure."""
        what = f"put {self.bucket_name}/{name}"
        fd = open_regular(src)  # a FIFO swapped in by a pod is refused, never waited on
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            chunk = -(-max(min(chunk, size), 1) // RESUMABLE_ALIGN) * RESUMABLE_ALIGN
            blob = bucket.blob(name, chunk_size=chunk)

            def put() -> None:
                crc = _stream_crc32c(f, self.chunk_size)
                check_crc32c(key, crc, crc32c)
                f.seek(0)
                sending = _SENDING.set(meter)
                source = _ResumableSource(f)
                resuming = _RESUMING.set(source)
                try:
                    blob.upload_from_file(
                        source,  # read, seek and tell are all the SDK uses
                        size=size,
                        content_type="application/octet-stream",
                        checksum="crc32c",
                        crc32c_checksum_value=crc32c_b64(crc),
                        retry=self._retry(what),  # each chunk's request
                        timeout=self.timeout,
                    )
                finally:
                    _RESUMING.reset(resuming)
                    _SENDING.reset(sending)
                if b64_crc32c(blob.crc32c) != crc:
                    raise DamagedInTransit(
                        f"{what}: GCS stored crc32c {blob.crc32c}, sent {crc:08x}"
                    )

            self._call(what, put)
        return -(-size // chunk)

    # --- reads ----------------------------------------------------------------------------

    def read_chunks(self, key: str) -> Iterator[bytes]:
        name = self._name(key)
        bucket = self._get_bucket()
        what = f"get {self.bucket_name}/{name}"
        blob = self._call(
            what, lambda: bucket.get_blob(name, retry=self._retry(what), timeout=self.timeout)
        )
        if blob is None:
            raise ObjectNotFound(what)
        size = int(blob.size or 0)
        generation = blob.generation

        def open_at(offset: int) -> Iterator[bytes]:
            while offset < size:
                end = min(offset + self.range_size, size) - 1
                try:
                    # The blob carries its generation: every range reads that version.
                    data = blob.download_as_bytes(
                        start=offset,
                        end=end,
                        raw_download=True,
                        checksum=None,  # a range has no checksum; the whole is checked
                        if_generation_match=generation,
                        retry=self._retry(what),
                        timeout=self.timeout,
                    )
                except Exception as exc:
                    mapped = translate(exc, what)
                    if isinstance(mapped, PreconditionFailed | ObjectNotFound):
                        raise ChecksumMismatch(f"{what}: object changed while downloading") from exc
                    if mapped is None or mapped is exc:
                        raise
                    raise mapped from exc
                if not data:
                    return  # shorter than its metadata said: verified_chunks reports it
                offset += len(data)
                for i in range(0, len(data), self.chunk_size):
                    yield data[i : i + self.chunk_size]

        yield from verified_chunks(
            open_at,
            what=what,
            size=size,
            crc32c=b64_crc32c(blob.crc32c),
            # A range cut off mid-body (past the SDK's retries) resumes where it stopped.
            backoff=RetryState(self.policy, is_resumable, what=what),
        )

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.read_chunks(key))

    def head(self, key: str) -> ObjectInfo | None:
        name = self._name(key)
        bucket = self._get_bucket()
        what = f"head {self.bucket_name}/{name}"
        blob = self._call(
            what, lambda: bucket.get_blob(name, retry=self._retry(what), timeout=self.timeout)
        )
        if blob is None:
            return None
        return ObjectInfo(
            key, int(blob.size or 0), blob.updated.timestamp() if blob.updated else 0.0
        )

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        bucket = self._get_bucket()
        what = f"list {self.url} {prefix!r}"
        token: str | None = None
        while True:
            page = functools.partial(self._first_page, bucket, self.prefix + prefix, None, token)
            blobs, token = self._call(what, page)
            for blob in blobs:
                key = blob.name[len(self.prefix) :]
                if _listable(key):
                    mtime = blob.updated.timestamp() if blob.updated else 0.0
                    yield ObjectInfo(key, int(blob.size or 0), mtime)
            if not token:
                return

    def list_prefixes(self, prefix: str) -> Iterator[str]:
        bucket = self._get_bucket()
        what = f"list prefixes {self.url} {prefix!r}"
        token: str | None = None
        while True:

            def page(token: str | None = token) -> tuple[list[str], str | None]:
                blobs = bucket.client.list_blobs(
                    bucket,
                    prefix=self.prefix + prefix,
                    delimiter="/",
                    page_token=token,
                    retry=self._retry(what),
                    timeout=self.timeout,
                )
                first = next(blobs.pages, None)
                found = sorted(first.prefixes) if first is not None else []
                return found, blobs.next_page_token

            names, token = self._call(what, page)
            for name in names:
                found = name[len(self.prefix) :]
                if _listable(found.rstrip("/")):
                    yield found
            if not token:
                return

    def delete(self, key: str) -> None:
        name = self._name(key)
        blob = self._get_bucket().blob(name)
        what = f"delete {self.bucket_name}/{name}"
        with contextlib.suppress(ObjectNotFound):
            self._call(what, lambda: blob.delete(retry=self._retry(what), timeout=self.timeout))
