"""The owner file the CSI plugin writes, and who may claim or join a job (core.ownership)."""

from __future__ import annotations

import json

import pytest

from mtc_replicator.core.ownership import (
    UNOWNED,
    BadOwner,
    Owner,
    check_owner,
    may_claim,
    may_join,
    parse_owner,
)


def owner_json(**changes: object) -> dict[str, object]:
    body: dict[str, object] = {
        "namespace": "team-a",
        "pod": "trainer-0",
        "pod_uid": "0f5e3a9c-1d2b-4c3d-9e8f-7a6b5c4d3e2f",
        "service_account": "default",
        "published_at": 1700000000.5,
    }
    body.update(changes)
    return body


def test_a_good_owner_file_parses() -> None:
    owner = parse_owner(json.dumps(owner_json()).encode())
    assert owner == Owner(
        "team-a", "trainer-0", "0f5e3a9c-1d2b-4c3d-9e8f-7a6b5c4d3e2f", "default", 1700000000.5
    )


BAD: dict[str, bytes] = {
    "not json": b"{",
    "a list": b"[]",
    "empty": b"",
    "oversize": json.dumps(owner_json(pad="x" * 5000)).encode(),
    "no pod": json.dumps({k: v for k, v in owner_json().items() if k != "pod"}).encode(),
    "empty namespace": json.dumps(owner_json(namespace="")).encode(),
    "upper-case namespace": json.dumps(owner_json(namespace="Team-A")).encode(),
    "namespace with a slash": json.dumps(owner_json(namespace="a/b")).encode(),
    "namespace too long": json.dumps(owner_json(namespace="a" * 64)).encode(),
    "namespace not a string": json.dumps(owner_json(namespace=1)).encode(),
    "pod with a space": json.dumps(owner_json(pod="a b")).encode(),
    "uid not hex": json.dumps(owner_json(pod_uid="zz")).encode(),
    "service account empty": json.dumps(owner_json(service_account="")).encode(),
    "time NaN": json.dumps(owner_json(published_at=float("nan"))).encode(),
    "time a bool": json.dumps(owner_json(published_at=True)).encode(),
    "time negative": json.dumps(owner_json(published_at=-1)).encode(),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_owner_file_is_refused_with_its_reason(case: str) -> None:
    with pytest.raises(BadOwner):
        parse_owner(BAD[case])


def test_owner_fields_are_namespaces_or_unowned() -> None:
    assert check_owner("team-a") == "team-a"
    assert check_owner(UNOWNED) == UNOWNED
    for bad in ("-a", "a-", "A", "a.b", None, 3):
        with pytest.raises(BadOwner):
            check_owner(bad)


@pytest.mark.parametrize(
    ("entry", "claimant", "allowed"),
    [
        (None, "team-a", True),  # no entry: the first incarnation creates it
        (None, UNOWNED, True),
        ("team-a", "team-a", True),  # rank 0 moved to another node
        ("team-a", "team-b", False),  # the takeover
        ("team-a", UNOWNED, False),  # a daemon without --owner-file takes no owned job
        (UNOWNED, "team-a", True),  # the upgrade: an old entry gets its owner
        (UNOWNED, UNOWNED, True),
    ],
)
def test_who_may_claim_a_registry_entry(entry: str | None, claimant: str, allowed: bool) -> None:
    assert may_claim(entry, claimant) is allowed


def test_only_the_jobs_owner_may_join() -> None:
    assert may_join("team-a", "team-a")
    assert may_join(UNOWNED, UNOWNED)
    assert not may_join("team-a", "team-b")
    assert not may_join("team-a", UNOWNED)
    assert not may_join(UNOWNED, "team-a")
