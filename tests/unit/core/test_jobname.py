"""The one job-name rule (``core.jobname``): what it accepts never climbs out of a root, what
it refuses is refused by every site a name arrives at."""

from __future__ import annotations

import argparse
import json
import posixpath
import re
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.cluster import messages, registry
from mtc_replicator.core import argtypes, contract
from mtc_replicator.core.backup_layout import (
    LAYOUTS,
    CommitRecord,
    commit_key,
    data_key,
    item_prefix,
    manifest_key,
    step_prefix,
)
from mtc_replicator.core.jobname import (
    JOB_NAME_PATTERN,
    MAX_JOB_NAME_LEN,
    BadJobName,
    check_job_name,
    is_job_name,
)
from mtc_replicator.core.manifest import ItemId, ManifestError
from mtc_replicator.local.store import LocalStore, item_path, view_path
from mtc_replicator.storage import restore_pins
from mtc_replicator.transport import peerwire
from mtc_replicator.transport.transfer import TransferError

PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

JOB_NAMES = st.from_regex(JOB_NAME_PATTERN, fullmatch=True).filter(lambda j: ".." not in j)
ITEMS = st.builds(
    ItemId,
    JOB_NAMES,
    st.integers(0, 10**12),
    st.integers(0, 1 << 20),
    st.integers(0, 1023),
)
# Protobuf strings refuse lone surrogates; every other character may arrive from a peer.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)


@st.composite
def bad_names(draw: st.DrawFn) -> str:
    """A job name spoiled in one of the ways an attacker or a typo spoils one."""
    name = draw(JOB_NAMES)
    cut = draw(st.integers(0, len(name)))
    spoil = draw(st.sampled_from(["..", "/", "\0", "\n", "\\", " ", "long", "_", "."]))
    if spoil == "long":
        return name + "x" * (MAX_JOB_NAME_LEN + 1 - len(name))
    if spoil in ("_", "."):
        return spoil + name  # hidden, or where the bucket keeps its own objects
    return name[:cut] + spoil + name[cut:]


def beneath(root: str, path: str) -> bool:
    """Whether relative ``path`` names something strictly inside ``root`` and stays there
    whatever joins it: no empty, ``.`` or ``..`` segment, nothing absolute."""
    parts = path.split("/")
    return (
        not path.startswith("/")
        and "\0" not in path
        and posixpath.normpath(path) == path.rstrip("/")
        and not {"", ".", ".."} & set(parts[:-1] if path.endswith("/") else parts)
        and path.startswith(root)
        and len(path) > len(root)
    )


# --- the rule ----------------------------------------------------------------------------------


@given(JOB_NAMES)
@PROPS
def test_an_accepted_name_is_one_safe_path_segment(job: str) -> None:
    assert check_job_name(job) == job
    assert is_job_name(job)
    assert len(job) <= MAX_JOB_NAME_LEN
    assert PurePosixPath(job).parts == (job,)
    assert job[0] not in "._-"  # never ".", "..", hidden, or the bucket's own prefixes
    assert not job.startswith(("_registry", "_control"))


@given(bad_names())
@PROPS
def test_a_spoiled_name_is_refused(job: str) -> None:
    assert not is_job_name(job)
    with pytest.raises(BadJobName, match="not a job name") as caught:
        check_job_name(job)
    assert isinstance(caught.value, ValueError)
    assert caught.value.name == job


@given(TEXT)
@PROPS
def test_whatever_is_accepted_is_a_name_and_nothing_else_is(text: str) -> None:
    ok = bool(re.fullmatch(JOB_NAME_PATTERN, text)) and ".." not in text
    assert is_job_name(text) is ok
    if ok:
        assert not {"/", "\0"} & set(text)
        assert len(text) <= MAX_JOB_NAME_LEN


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a..b", "a/b", "../etc", "a\0", "a\n", "_control", "x" * 128, 7, None, b"a"],
)
def test_refused(name: object) -> None:
    assert not is_job_name(name)
    with pytest.raises(BadJobName):
        check_job_name(name)


@pytest.mark.parametrize("name", ["a", "0", "A.b_c-d", "a." + "x" * 125, "x" * 127])
def test_accepted(name: str) -> None:
    assert check_job_name(name) == name


def test_the_message_quotes_the_name_cut_short_and_says_the_rule() -> None:
    with pytest.raises(BadJobName) as caught:
        check_job_name("../" + "x" * 200)
    text = str(caught.value)
    assert text.startswith("not a job name: '../xx")
    assert "no '..'" in text
    assert len(text) < 200


# --- every path built from a name stays beneath its root ---------------------------------------


@given(ITEMS)
@PROPS
def test_store_paths_stay_beneath_their_roots(item: ItemId) -> None:
    assert beneath(f"{item.job}/", str(item_path(item)))
    store = LocalStore(Path("/ckpt"), Path("/store"))
    for path in (store.item_dir(item), store.data_path(item)):
        assert beneath(f"items/{item.job}/", str(path.relative_to(store.root)))


@given(ITEMS, st.from_regex(messages.INCARNATION_RE, fullmatch=True))
@PROPS
def test_views_stay_beneath_their_incarnation(item: ItemId, view: str) -> None:
    path = str(view_path(view, item))
    assert beneath(f"{contract.STORE_DIR}/views/{view}/{item.job}/", path)
    assert LocalStore(Path("/ckpt")).item_of_link(path) == item


@given(ITEMS, st.sampled_from(LAYOUTS), st.sampled_from(["", "a", "d/e.bin"]))
@PROPS
def test_backup_keys_of_every_layout_stay_beneath_the_job(
    item: ItemId, layout: int, path: str
) -> None:
    root = f"{item.job}/"
    for key in (
        step_prefix(item.job, item.step),
        commit_key(item.job, item.step),
        item_prefix(item, layout),
        manifest_key(item, layout),
        data_key(item, path, layout),
    ):
        assert beneath(root, key), key
        assert not key.startswith((restore_pins.CONTROL_PREFIX, registry.PREFIX))


@given(JOB_NAMES)
@PROPS
def test_registry_and_pin_keys_stay_beneath_their_prefixes(job: str) -> None:
    entry = registry.entry_key(job)
    assert beneath(registry.PREFIX, entry)
    assert entry.count("/") == registry.PREFIX.count("/")
    pin = restore_pins.pin_key(job)
    assert beneath(f"{restore_pins.CONTROL_PREFIX}{job}/", pin)


# --- every site refuses what the rule refuses --------------------------------------------------


def _commit(job: str) -> None:
    body = CommitRecord(job="j", step=1, items={}, created=1.0).body()
    CommitRecord.from_json(json.dumps({**body, "job": job}).encode())


def _store_link(job: str) -> None:
    item = LocalStore(Path("/ckpt")).item_of_link(f"{contract.STORE_DIR}/items/{job}/1/0-0/data")
    if item is None:
        raise ValueError("not an item")


SITES: dict[str, tuple[Callable[[str], object], type[Exception]]] = {
    "argtypes.job": (argtypes.job, argparse.ArgumentTypeError),
    "registry.check_job": (registry.check_job, registry.MalformedEntry),
    "registry.entry_key": (registry.entry_key, registry.MalformedEntry),
    "restore_pins.pin_key": (restore_pins.pin_key, restore_pins.MalformedPin),
    "messages.check_job": (messages.check_job, messages.BadMessage),
    "peerwire.item_id": (lambda j: peerwire.item_id(pb.ItemRef(job=j, step=1)), TransferError),
    "CommitRecord.from_json": (_commit, ManifestError),
    "LocalStore.item_of_link": (_store_link, ValueError),
}


@pytest.mark.parametrize("site", sorted(SITES))
@given(job=bad_names())
@settings(max_examples=50, deadline=None)
def test_every_site_refuses_a_spoiled_name(site: str, job: str) -> None:
    check, error = SITES[site]
    # A link target is split on "/" before the name in it is read.
    assume(site != "LocalStore.item_of_link" or "/" not in job)
    with pytest.raises(error):
        check(job)


@pytest.mark.parametrize("site", sorted(SITES))
def test_every_site_accepts_a_name(site: str) -> None:
    SITES[site][0]("job-1.a_b")
