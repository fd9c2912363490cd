"""How one file goes up to an object store: in one request or in parallel parts. Pure.

The backends (``storage.s3``, ``storage.gcs``) ask ``plan_upload`` and act on the answer, so
the thresholds are decided, and tested, in one place. Why the limits are what they are is
measured in docs/performance.md ("Backups to S3 and GCS").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UploadPlan:
    """One file's upload: a single request carrying the whole file, or ``parts`` parts."""

    single: bool
    parts: int
    part_size: int
    """Bytes per part, all but the last (the file's size for a single request)."""


def plan_upload(size: int, *, single_limit: int, part_size: int, max_parts: int) -> UploadPlan:
    """A file of ``size`` bytes: one request up to ``single_limit``, else parts of at least
    ``part_size``, larger where ``max_parts`` parts would not hold the file."""
    if size < 0 or single_limit < 0 or part_size < 1 or max_parts < 1:
        raise ValueError(
            f"bad upload plan: size {size}, single_limit {single_limit}, "
            f"part_size {part_size}, max_parts {max_parts}"
        )
    if size <= single_limit:
        return UploadPlan(True, 1, size)
    each = max(part_size, -(-size // max_parts))
    return UploadPlan(False, -(-size // each), each)
