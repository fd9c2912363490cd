"""Bucket keys of backups (``core.backup_layout``): layout v2 spreads a step's items over
256 prefixes, v1 keys stay what earlier versions wrote, and the COMMIT names its layout."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from mtc_replicator.core.backup_layout import (
    LAYOUT,
    LAYOUT_V1,
    LAYOUT_V2,
    CommitRecord,
    data_key,
    item_key_of,
    item_prefix,
    manifest_item_key,
    manifest_key,
    shard,
)
from mtc_replicator.core.manifest import ItemId, ManifestError

DIGEST = "ab" * 32


@pytest.mark.parametrize(("ranks", "workers"), [(4096, 1), (1024, 4), (512, 8)])
def test_items_of_a_step_spread_evenly_over_256_prefixes(ranks: int, workers: int) -> None:
    """S3 scales request rates per partitioned prefix, GCS asks for no sequential names:
    no prefix may take much more than its share of a step's items."""
    items = [ItemId("job", 100, r, w) for r in range(ranks) for w in range(workers)]
    per_prefix = Counter(manifest_key(i).split("/")[2] for i in items)
    share = len(items) / 256
    assert len(per_prefix) == 256
    assert max(per_prefix.values()) <= 2 * share
    assert min(per_prefix.values()) >= share / 3
    # Data and manifest of an item share its prefix; neighbouring ranks do not.
    assert all(data_key(i, "x").split("/")[2] == manifest_key(i).split("/")[2] for i in items)
    neighbours = sum(shard(f"{r}-0") == shard(f"{r + 1}-0") for r in range(ranks - 1))
    assert neighbours < ranks / 64


def test_keys_of_each_layout() -> None:
    item = ItemId("job", 100, 3, 1)
    hh = shard("3-1")
    assert len(hh) == 2
    assert int(hh, 16) >= 0
    assert manifest_key(item) == f"job/100/{hh}/3-1.manifest.json"
    assert data_key(item, "a/b") == f"job/100/{hh}/3-1/a/b"
    assert data_key(item, "") == f"job/100/{hh}/3-1/data"
    assert manifest_key(item, LAYOUT_V1) == "job/100/3-1.manifest.json"
    assert data_key(item, "", LAYOUT_V1) == "job/100/3-1/data"
    assert item_prefix(item, LAYOUT_V2) == f"job/100/{hh}/3-1"
    assert LAYOUT == LAYOUT_V2
    with pytest.raises(ManifestError):
        item_prefix(item, 3)


def test_manifest_names_of_either_layout() -> None:
    hh = shard("3-1")
    assert manifest_item_key("3-1.manifest.json") == "3-1"
    assert manifest_item_key(f"{hh}/3-1.manifest.json") == "3-1"
    other = "00" if hh != "00" else "01"
    for name in (f"{other}/3-1.manifest.json", "3-1/data", "COMMIT", f"{hh}/x.manifest.json"):
        assert manifest_item_key(name) is None


def test_commit_names_its_layout_and_v1_is_the_old_bytes() -> None:
    v2 = CommitRecord("job", 7, {"0-0": DIGEST}, 1.0)
    assert json.loads(v2.to_json())["layout"] == 2
    assert CommitRecord.from_json(v2.to_json()) == v2
    v1 = CommitRecord("job", 7, {"0-0": DIGEST}, 1.0, LAYOUT_V1)
    assert (
        v1.to_json()
        == json.dumps(
            {"created": 1.0, "items": {"0-0": DIGEST}, "job": "job", "step": 7}, sort_keys=True
        ).encode()
    ), "a v1 COMMIT is byte for byte what earlier versions wrote"
    assert CommitRecord.from_json(v1.to_json()).layout == LAYOUT_V1
    assert v1.manifest_key(ItemId("job", 7, 0, 0)) == "job/7/0-0.manifest.json"


@pytest.mark.parametrize("layout", [3, 0, "2", 2.0, True, None, [2]])
def test_a_commit_of_an_unknown_layout_is_refused(layout: object) -> None:
    body = {"job": "job", "step": 7, "items": {"0-0": DIGEST}, "created": 1.0, "layout": layout}
    with pytest.raises(ManifestError, match="layout"):
        CommitRecord.from_json(json.dumps(body).encode())


@pytest.mark.parametrize("layout", [LAYOUT_V1, LAYOUT_V2])
def test_item_key_of_names_the_item_whose_data_a_key_is(layout: int) -> None:
    item = ItemId("j", 7, 3, 1)
    assert item_key_of("j", data_key(item, "state/a.bin", layout)) == "3-1"
    assert item_key_of("j", data_key(item, "", layout)) == "3-1"
    assert item_key_of("other", data_key(item, "", layout)) is None


@pytest.mark.parametrize(
    "key",
    [
        "j/7/COMMIT",
        "j/x/3-1/data",
        "j/7/00/3-1/data",
        "j/7/3-1.manifest.json",
        "j/\u0667/3-1/data",
        "j",
    ],
)
def test_item_key_of_is_none_for_anything_else(key: str) -> None:
    assert item_key_of("j", key) is None
