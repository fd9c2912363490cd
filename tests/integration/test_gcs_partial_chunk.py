"""GCS may persist fewer bytes of a resumable upload's chunk than were sent, and says so
with a 308 whose ``Range`` ends before the chunk did; the client must send on from there
(https://cloud.google.com/storage/docs/performing-resumable-uploads#resume-upload). A
proxy in front of the emulator forwards only the first half of one chunk, so the emulator
answers exactly such a 308."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest

from mtc_replicator.storage.gcs import GcsObjectStore
from tests.storage_servers import (
    Bucket,
    FaultProxy,
    Request,
    Rule,
    fault_proxy,
    gcs_create_only,
)

MiB = 1024 * 1024
CHUNK = MiB


def persist_half_of_first_chunk(state: dict[str, int]) -> Rule:
    def rule(req: Request, _: FaultProxy) -> None:
        if state["done"] or req.method != "PUT" or "upload_id" not in req.query:
            return
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", req.header("Content-Range") or "")
        if m is None or int(m.group(1)) != 0:
            return
        state["done"] = 1
        keep = CHUNK // 2
        req.body = req.body[:keep]
        req.headers = [
            (k, f"bytes 0-{keep - 1}/*" if k.lower() == "content-range" else v)
            for k, v in req.headers
            if k.lower() != "content-length"
        ]
        return

    return rule


@pytest.fixture
def proxy(gcs_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    with fault_proxy(gcs_bucket.endpoint, [gcs_create_only]) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        yield proxy


def test_a_chunk_persisted_in_part_is_sent_on_from_where_gcs_stopped(
    gcs_bucket: Bucket, proxy: FaultProxy, tmp_path: Path
) -> None:
    state = {"done": 0}
    proxy.rules[:0] = [persist_half_of_first_chunk(state)]
    store = GcsObjectStore.from_url(
        gcs_bucket.url, part_size=CHUNK, single_limit=CHUNK, timeout=20.0
    )
    data = os.urandom(9 * MiB + 123)  # above SDK_MULTIPART_MAX: a chunked resumable upload
    (tmp_path / "f").write_bytes(data)
    store.put_file("job/1/f", tmp_path / "f", crc32c=google_crc32c.value(data))
    assert state["done"]
    assert store.get_bytes("job/1/f") == data
