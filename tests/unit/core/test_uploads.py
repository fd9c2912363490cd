"""``core.uploads``: one request or parts, by size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtc_replicator.core.uploads import UploadPlan, plan_upload

MiB = 1 << 20


def test_single_request_up_to_the_limit() -> None:
    plan = plan_upload(150 * MiB, single_limit=150 * MiB, part_size=32 * MiB, max_parts=10_000)
    assert plan == UploadPlan(True, 1, 150 * MiB)
    assert plan.single
    assert plan_upload(0, single_limit=0, part_size=1, max_parts=1).single


def test_parts_above_the_limit() -> None:
    plan = plan_upload(150 * MiB + 1, single_limit=150 * MiB, part_size=32 * MiB, max_parts=10_000)
    assert plan == UploadPlan(False, 5, 32 * MiB)
    assert not plan.single


def test_parts_grow_when_the_count_would_pass_the_maximum() -> None:
    # S3: at most 10,000 parts, so a 1 TiB file needs parts larger than 16 MiB.
    plan = plan_upload(1 << 40, single_limit=16 * MiB, part_size=16 * MiB, max_parts=10_000)
    assert plan.parts <= 10_000
    assert plan.part_size == -(-(1 << 40) // 10_000)


@pytest.mark.parametrize(
    ("size", "single", "part", "most"), [(-1, 0, 1, 1), (1, -1, 1, 1), (1, 0, 0, 1), (1, 0, 1, 0)]
)
def test_bad_arguments_are_refused(size: int, single: int, part: int, most: int) -> None:
    with pytest.raises(ValueError, match="bad upload plan"):
        plan_upload(size, single_limit=single, part_size=part, max_parts=most)


@given(
    size=st.integers(0, 1 << 44),
    single=st.integers(0, 1 << 30),
    part=st.integers(1, 1 << 30),
    most=st.integers(1, 10_000),
)
def test_parts_cover_the_file_within_the_maximum(
    size: int, single: int, part: int, most: int
) -> None:
    plan = plan_upload(size, single_limit=single, part_size=part, max_parts=most)
    if plan.single:
        assert size <= single
        return
    assert size > single
    assert plan.part_size >= part
    assert plan.parts <= most
    assert (plan.parts - 1) * plan.part_size < size <= plan.parts * plan.part_size
