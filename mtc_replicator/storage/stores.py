"""Opening the object store a URL names: ``file://``, ``s3://`` or ``gs://``. I/O module.

The one place that knows every backend; each cloud SDK is imported only when its scheme is
used, so a node that backs up to one cloud never needs the other's SDK, and the backends
never import each other.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from mtc_replicator.core.retry import DEFAULT_STORAGE_TIMEOUT
from mtc_replicator.storage.objectstore import BucketNotFound, FileObjectStore, ObjectStore


def open_object_store(
    url: str, *, create: bool = True, timeout: float = DEFAULT_STORAGE_TIMEOUT
) -> ObjectStore:
    """The backend for a URL: ``file:///abs/path`` (or a plain absolute path),
    ``s3://bucket/prefix`` or ``gs://bucket/prefix``.

    Cloud credentials and endpoints come from each SDK's standard chain (``AWS_*`` variables,
    ``AWS_ENDPOINT_URL_S3``, config files, instance roles; Application Default Credentials,
    ``STORAGE_EMULATOR_HOST``). A missing SDK is a ValueError that names the pip extra.
    Without ``create`` (the operator's CLI), a ``file://`` directory that does not exist is
    ``BucketNotFound``, as a missing bucket is, rather than made empty and listed.
    ``timeout`` bounds each request of a cloud store with its retries (``--storage-timeout``).
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URL must be file:///absolute/path, got {url!r}")
        path = Path(unquote(parsed.path))
        if not path.is_absolute():
            raise ValueError(f"backup path must be absolute, got {url!r}")
        if not create and not path.is_dir():
            raise BucketNotFound(f"{url}: no such directory")
        return FileObjectStore(path, url if parsed.scheme else path.as_uri())
    if parsed.scheme == "s3":
        try:
            from mtc_replicator.storage.s3 import S3ObjectStore
        except ImportError as exc:
            raise ValueError(
                f"s3:// storage needs boto3: pip install 'mtc-replicator[s3]' ({exc})"
            ) from None
        return S3ObjectStore.from_url(url, timeout=timeout)
    if parsed.scheme == "gs":
        try:
            from mtc_replicator.storage.gcs import GcsObjectStore
        except ImportError as exc:
            raise ValueError(
                f"gs:// storage needs google-cloud-storage: pip install 'mtc-replicator[gcs]' "
                f"({exc})"
            ) from None
        return GcsObjectStore.from_url(url, timeout=timeout)
    raise ValueError(f"unsupported storage URL {url!r}: use file://, gs:// or s3://")
