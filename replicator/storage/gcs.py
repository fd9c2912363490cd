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

A file goes up in one request up to ``single_limit`` (150 MiB, gcloud's own threshold for
parallel composite uploads; ``core.uploads``): read into memory and checked before it is
sent up to ``part_size``, streamed from the open file above that as one resumable upload
whose one data request carries the whole file (the SDK holds it in memory as it sends),
its crc32c checked before and declared in the request, so GCS refuses a file that changed
meanwhile. Larger files are parallel composite uploads: parts go up as temporary objects
(named with ``fsutil.TMP_PREFIX``, never listed) from a bounded window, are composed 32 at
a time into the destination, then deleted. The SDK copies each part about twice on its way
out, so a composite upload holds some ``2 * (workers + 1)`` parts in memory (320 MiB with
the defaults); a download holds one ``range_size`` range. A process that dies mid-upload
leaves such parts behind: a lifecycle rule on the prefix can collect them. Why one request
below the limit: docs/performance.md ("Backups to S3 and GCS").

Retries: the SDK's own are off; ``translate`` is the one place that maps SDK errors to ours
and decides what is transient, and ``RetryPolicy`` how long to try.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import google.auth.exceptions as gauth
import google_crc32c
import requests
import urllib3.exceptions
from google.api_core import exceptions as gapi
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from replicator.core.retry import RetryPolicy, RetryState, call_translated
from replicator.core.uploads import plan_upload
from replicator.local.fsutil import TMP_PREFIX
from replicator.local.hashing import CHUNK
from replicator.local.pacer import Meter, SharedMeter
from replicator.storage.objectstore import (
    BucketNotFound,
    ChecksumMismatch,
    ObjectInfo,
    ObjectNotFound,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
    TransientError,
    check_crc32c,
    check_key,
    is_transient,
    split_bucket_url,
)
from replicator.storage.parts import (
    b64_crc32c,
    crc32c_b64,
    read_small_file,
    upload_parts,
    verified_chunks,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PART_SIZE = 32 * 1024 * 1024
DEFAULT_SINGLE_LIMIT = 150 * 1024 * 1024
"""Files up to this size go up in one request, larger ones as composite uploads."""
DEFAULT_WORKERS = 4
RESUMABLE_ALIGN = 256 * 1024
"""A resumable upload's chunk size must be a multiple of this."""
SDK_MULTIPART_MAX = 8 * 1024 * 1024
"""The SDK sends a stream up to this size as a multipart request, which cannot declare
our crc32c: such files go up from memory, checked before they are sent."""
DEFAULT_RANGE = 16 * 1024 * 1024
"""Bytes per ranged GET of a download: what one stream holds in memory."""
MAX_COMPOSE = 32
"""GCS composes at most this many sources per request."""
_CORRUPT_UPLOAD = "doesn't match calculated"  # GCS's words when it refuses damaged bytes

_SENDING: ContextVar[Meter | None] = ContextVar("mtc_gcs_sending", default=None)
"""The meter that pays for the request bodies this thread sends now (None: unpaced)."""


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
        return self.inner.send(request, *args, **kwargs)

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


def translate(exc: BaseException, what: str) -> ObjectStoreError | None:
    """Our error for an SDK/transport one, or None if ``exc`` is not a storage error.

    The one place that decides what is transient: 408/429/5xx, timeouts, broken
    connections and bytes damaged in transit are; permissions and bad requests are not.
    """
    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, InvalidResponse):
        status = getattr(getattr(exc, "response", None), "status_code", 0) or 0
        return _by_status(int(status), f"{what}: {exc}", what)
    if isinstance(exc, gapi.GoogleAPICallError):
        return _by_status(int(exc.code or 0), f"{what}: {exc.code} {exc.message}", what)
    if isinstance(exc, DataCorruption):
        return TransientError(f"{what}: damaged in transit: {exc}")
    if isinstance(exc, gauth.DefaultCredentialsError | gauth.RefreshError):
        return PermissionDenied(f"{what}: no usable Google credentials ({exc})")
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
        return TransientError(f"{what}: {type(exc).__name__}: {exc}")
    return None


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
        return TransientError(message)  # the upload is still in memory: resend it
    return ObjectStoreError(message)


def _stream_crc32c(f: BinaryIO) -> int:
    """crc32c of an open file from its start (left at its end)."""
    f.seek(0)
    crc = 0
    while chunk := f.read(CHUNK):
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
        workers: int = DEFAULT_WORKERS,
        chunk_size: int = CHUNK,
        range_size: int = DEFAULT_RANGE,
        policy: RetryPolicy | None = None,
        timeout: float = 60.0,
    ) -> None:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        if part_size < 1 or chunk_size < 1 or range_size < 1:
            raise ValueError("part, chunk and range sizes must be positive")
        self.bucket_name = bucket
        self.prefix = prefix
        self.url = url or f"gs://{bucket}/{prefix}"
        self.part_size = part_size
        self.single_limit = max(single_limit, part_size)
        self.workers = workers
        self.chunk_size = chunk_size
        self.range_size = max(range_size, chunk_size)
        self.policy = policy or RetryPolicy()
        self.timeout = (10.0, timeout)
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
        """``fn()`` with SDK errors translated and transient ones retried."""
        return call_translated(fn, self.policy, translate, is_transient, what=what)

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
            retry=None,
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
                    retry=None,
                    timeout=self.timeout,
                )
            finally:
                _SENDING.reset(sending)
            stored = b64_crc32c(blob.crc32c)
            if stored != crc:
                raise TransientError(f"{what}: GCS stored crc32c {blob.crc32c}, sent {crc:08x}")

        self._call(what, put)

    # --- writes ---------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        name = self._name(key)
        self._upload(self._get_bucket().blob(name), data, if_absent=if_absent)

    def put_file(
        self, key: str, src: Path, *, crc32c: int | None = None, meter: Meter | None = None
    ) -> None:
        name = self._name(key)
        bucket = self._get_bucket()
        t0 = time.monotonic()
        size = os.stat(src).st_size
        # Composite parts are limited only by the 32-per-compose tree, never by a count.
        plan = plan_upload(
            size, single_limit=self.single_limit, part_size=self.part_size, max_parts=size + 1
        )
        if not plan.single:
            parts = self._put_composite(bucket, key, name, src, crc32c, meter=meter)
        elif size <= max(self.part_size, SDK_MULTIPART_MAX):
            data = read_small_file(src, size)
            check_crc32c(key, google_crc32c.value(data), crc32c)
            self._upload(bucket.blob(name), data, meter=meter)
            parts = 1
        else:
            self._put_streamed(bucket, key, name, src, crc32c, meter=meter)
            parts = 1
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
        meter: Meter | None,
    ) -> None:
        """One resumable upload from the open file, its whole content in one data request.

        Before each attempt the open file's crc32c is taken and checked against ``crc32c``;
        the request declares it, so GCS refuses bytes that changed after the check, and the
        stored object's crc32c is compared with it again."""
        what = f"put {self.bucket_name}/{name}"
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            chunk = -(-max(size, 1) // RESUMABLE_ALIGN) * RESUMABLE_ALIGN
            blob = bucket.blob(name, chunk_size=chunk)

            def put() -> None:
                crc = _stream_crc32c(f)
                check_crc32c(key, crc, crc32c)
                f.seek(0)
                sending = _SENDING.set(meter)
                try:
                    blob.upload_from_file(
                        f,
                        size=size,
                        content_type="application/octet-stream",
                        checksum="crc32c",
                        crc32c_checksum_value=crc32c_b64(crc),
                        retry=None,
                        timeout=self.timeout,
                    )
                finally:
                    _SENDING.reset(sending)
                if b64_crc32c(blob.crc32c) != crc:
                    raise TransientError(f"{what}: GCS stored crc32c {blob.crc32c}, sent {crc:08x}")

            self._call(what, put)

    def _put_composite(
        self,
        bucket: storage.Bucket,
        key: str,
        name: str,
        src: Path,
        crc32c: int | None,
        *,
        meter: Meter | None,
    ) -> int:
        what = f"composite put {self.bucket_name}/{name}"
        folder, _, base = name.rpartition("/")
        stem = f"{folder}/" if folder else ""
        stem += f"{TMP_PREFIX}{uuid.uuid4().hex[:12]}-{base}"
        temps: list[storage.Blob] = []
        meter = None if meter is None else SharedMeter(meter)  # the parts' threads share it
        lock = threading.Lock()

        def temp(suffix: str) -> storage.Blob:
            blob = bucket.blob(f"{stem}.{suffix}")
            with lock:
                temps.append(blob)
            return blob

        def upload(number: int, data: bytes) -> storage.Blob:
            blob = temp(f"{number:06d}")
            self._upload(blob, data, meter=meter)
            return blob

        try:
            sources, _, crc = upload_parts(
                src, self.part_size, self.workers, upload, name="gcs-put"
            )
            check_crc32c(key, crc, crc32c)
            parts = len(sources)
            level = 0
            while len(sources) > MAX_COMPOSE:
                groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
                sources = [
                    self._compose(temp(f"c{level}-{i:06d}"), group)
                    for i, group in enumerate(groups)
                ]
                level += 1
            dest = self._compose(bucket.blob(name), sources)
            if b64_crc32c(dest.crc32c) != crc:
                raise ChecksumMismatch(f"{what}: composed crc32c {dest.crc32c}, file {crc:08x}")
        finally:
            self._delete_quietly(temps)
        return parts

    def _compose(self, dest: storage.Blob, sources: list[storage.Blob]) -> storage.Blob:
        dest.content_type = "application/octet-stream"
        self._call(
            f"compose {self.bucket_name}/{dest.name}",
            lambda: dest.compose(sources, retry=None, timeout=self.timeout),
        )
        return dest

    def _delete_quietly(self, blobs: list[storage.Blob]) -> None:
        def delete(blob: storage.Blob) -> None:
            try:
                self._call(
                    f"delete {self.bucket_name}/{blob.name}",
                    lambda: blob.delete(retry=None, timeout=self.timeout),
                )
            except ObjectNotFound:
                pass
            except ObjectStoreError as exc:
                log.warning("could not delete temporary object %s: %s", blob.name, exc)

        with ThreadPoolExecutor(self.workers, thread_name_prefix="mtc-gcs-del") as pool:
            list(pool.map(delete, blobs))

    # --- reads ----------------------------------------------------------------------------

    def read_chunks(self, key: str) -> Iterator[bytes]:
        name = self._name(key)
        bucket = self._get_bucket()
        what = f"get {self.bucket_name}/{name}"
        blob = self._call(what, lambda: bucket.get_blob(name, retry=None, timeout=self.timeout))
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
                        retry=None,
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
            backoff=RetryState(self.policy, is_transient, what=what),
        )

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.read_chunks(key))

    def head(self, key: str) -> ObjectInfo | None:
        name = self._name(key)
        bucket = self._get_bucket()
        blob = self._call(
            f"head {self.bucket_name}/{name}",
            lambda: bucket.get_blob(name, retry=None, timeout=self.timeout),
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
                    retry=None,
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
        with contextlib.suppress(ObjectNotFound):
            self._call(
                f"delete {self.bucket_name}/{name}",
                lambda: blob.delete(retry=None, timeout=self.timeout),
            )
