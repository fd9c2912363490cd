"""The registry on every backend that needs no server (file and memory), one test class."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from mtc_replicator.cluster.registry import (
    BlockedName,
    MalformedEntry,
    OwnedByAnother,
    Registry,
    RegistryEntry,
    check_address,
    entry_key,
    inspect,
    new_coordinator_id,
    open_registry,
    release,
)
from mtc_replicator.storage.objectstore import FileObjectStore, MemoryObjectStore, ObjectStore
from mtc_replicator.tools import cli

BACKENDS: dict[str, Callable[[Path], ObjectStore]] = {
    "file": lambda tmp: FileObjectStore(tmp / "registry"),
    "memory": lambda tmp: MemoryObjectStore(),
}


@pytest.fixture(params=sorted(BACKENDS))
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return BACKENDS[request.param](tmp_path)


@pytest.fixture
def registry(objects: ObjectStore) -> Registry:
    return Registry(objects)


def entry(
    job: str = "job", port: int = 7000, cid: str = "a" * 32, at: float = 1.5, owner: str = ""
) -> RegistryEntry:
    return RegistryEntry(job, f"10.0.0.1:{port}", cid, at, owner)


def good_json(**changes: object) -> dict[str, object]:
    body: dict[str, object] = {
        "version": 1,
        "job": "job",
        "address": "node-0.mtc.svc:7000",
        "coordinator_id": "c0ffee",
        "registered_at": 12.0,
    }
    body.update(changes)
    return body


MALFORMED: dict[str, bytes] = {
    "not json": b"{not json",
    "not utf-8": b"\xff\xfe\x00",
    "a list": b"[1, 2]",
    "empty": b"",
    "oversize": json.dumps(good_json(pad="x" * 40000)).encode(),
    "no version": json.dumps({k: v for k, v in good_json().items() if k != "version"}).encode(),
    "version 2": json.dumps(good_json(version=2)).encode(),
    "version true": json.dumps(good_json(version=True)).encode(),
    "missing address": json.dumps(
        {k: v for k, v in good_json().items() if k != "address"}
    ).encode(),
    "another job": json.dumps(good_json(job="other")).encode(),
    "unsafe job": json.dumps(good_json(job="../job")).encode(),
    "job not a string": json.dumps(good_json(job=["job"])).encode(),
    "address without port": json.dumps(good_json(address="node-0")).encode(),
    "port 0": json.dumps(good_json(address="node-0:0")).encode(),
    "port too big": json.dumps(good_json(address="node-0:65536")).encode(),
    "port with sign": json.dumps(good_json(address="node-0:+80")).encode(),
    "space in host": json.dumps(good_json(address="node 0:80")).encode(),
    "slash in host": json.dumps(good_json(address="a/b:80")).encode(),
    "bare ipv6": json.dumps(good_json(address="::1:80")).encode(),
    "bad ipv6": json.dumps(good_json(address="[::g]:80")).encode(),
    "address not a string": json.dumps(good_json(address=7000)).encode(),
    "empty id": json.dumps(good_json(coordinator_id="")).encode(),
    "id with slash": json.dumps(good_json(coordinator_id="a/b")).encode(),
    "id not a string": json.dumps(good_json(coordinator_id=12)).encode(),
    "time NaN": json.dumps(good_json(registered_at=float("nan"))).encode(),
    "time Infinity": b'{"version": 1, "job": "job", "address": "a:1", '
    b'"coordinator_id": "c", "registered_at": Infinity}',
    "time huge": b'{"version": 1, "job": "job", "address": "a:1", '
    b'"coordinator_id": "c", "registered_at": 1e999}',
    "time negative": json.dumps(good_json(registered_at=-1)).encode(),
    "time a string": json.dumps(good_json(registered_at="12")).encode(),
    "time a bool": json.dumps(good_json(registered_at=True)).encode(),
    "owner not a namespace": json.dumps(good_json(owner="Team_A")).encode(),
    "owner not a string": json.dumps(good_json(owner=["a"])).encode(),
}


class TestRegistry:
    def test_lookup_of_an_unknown_job_is_none(self, registry: Registry) -> None:
        assert registry.lookup("job") is None

    def test_register_then_lookup(self, registry: Registry, objects: ObjectStore) -> None:
        registry.register(entry())
        assert registry.lookup("job") == entry()
        assert registry.lookup("other") is None
        # One small object per job, below a prefix no job's backups can use.
        assert [o.key for o in objects.list("")] == ["_registry/job.json"]

    def test_a_newer_registration_overwrites(self, registry: Registry) -> None:
        registry.register(entry(port=7000, cid="old"))
        registry.register(entry(port=7001, cid="new", at=2.0))
        assert registry.lookup("job") == entry(port=7001, cid="new", at=2.0)

    def test_jobs_are_independent(self, registry: Registry) -> None:
        registry.claim(entry("a", cid="ca", owner="team-a"))
        registry.claim(entry("b", cid="cb", owner="team-b"))
        assert registry.lookup("a") == entry("a", cid="ca", owner="team-a")
        assert registry.lookup("b") == entry("b", cid="cb", owner="team-b")

    def test_the_first_claim_creates_and_records_the_owner(
        self, registry: Registry, objects: ObjectStore
    ) -> None:
        registry.claim(entry(owner="team-a"))
        assert registry.lookup("job") == entry(owner="team-a")
        assert json.loads(objects.get_bytes(entry_key("job")))["owner"] == "team-a"

    def test_the_same_owner_moves_the_coordinator(self, registry: Registry) -> None:
        registry.claim(entry(cid="old", owner="team-a"))
        registry.claim(entry(port=7001, cid="new", at=2.0, owner="team-a"))
        assert registry.lookup("job") == entry(port=7001, cid="new", at=2.0, owner="team-a")

    @pytest.mark.parametrize("claimant", ["team-b", ""])
    def test_another_owner_is_refused_and_the_entry_kept(
        self, registry: Registry, claimant: str
    ) -> None:
        registry.claim(entry(cid="victim", owner="team-a"))
        with pytest.raises(OwnedByAnother, match="another owner"):
            registry.claim(entry(port=7001, cid="thief", owner=claimant))
        assert registry.lookup("job") == entry(cid="victim", owner="team-a")

    def test_an_unowned_entry_is_claimed_by_the_first_owner(
        self, registry: Registry, objects: ObjectStore
    ) -> None:
        # An entry of a daemon before owners existed: no "owner" key at all.
        objects.put_bytes(entry_key("job"), json.dumps(good_json()).encode())
        registry.claim(entry(owner="team-a"))
        assert registry.lookup("job") == entry(owner="team-a")
        with pytest.raises(OwnedByAnother):
            registry.claim(entry(owner="team-b"))

    def test_unowned_daemons_share_unowned_entries(self, registry: Registry) -> None:
        registry.claim(entry(cid="one"))
        registry.claim(entry(cid="two"))
        assert registry.lookup("job") == entry(cid="two")

    def test_ipv6_and_dns_addresses(self, registry: Registry) -> None:
        for address in ("[::1]:50051", "[fe80::1%eth0]:1", "mtc-0.mtc.default.svc:65535"):
            registry.register(RegistryEntry("job", address, "id", 0.0))
            found = registry.lookup("job")
            assert found is not None
            assert found.address == address

    @pytest.mark.parametrize("case", sorted(MALFORMED))
    def test_malformed_entry_is_absent_and_logged(
        self,
        registry: Registry,
        objects: ObjectStore,
        case: str,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        objects.put_bytes(entry_key("job"), MALFORMED[case])
        with caplog.at_level(logging.WARNING, logger="mtc_replicator.cluster.registry"):
            assert registry.lookup("job") is None
        assert "ignoring registry entry _registry/job.json of job=job" in caplog.text
        # A malformed entry may be the owner's own, overwritten: nobody claims over it...
        with pytest.raises(BlockedName, match="no rank 0 registers over it") as refused:
            registry.claim(entry(owner="team-a"))
        assert "mtc registry release" in refused.value.remedy
        assert objects.get_bytes(entry_key("job")) == MALFORMED[case]
        # ...until an operator releases the name, having seen what is there.
        state = inspect(registry, "job")
        assert state.blocked
        assert state.problem
        assert release(registry, state)
        registry.claim(entry(owner="team-a"))
        assert registry.lookup("job") == entry(owner="team-a")

    def test_well_formed_reference_entry_parses(
        self, registry: Registry, objects: ObjectStore
    ) -> None:
        # The counterpart of MALFORMED: the same body, unbroken, is accepted.
        objects.put_bytes(entry_key("job"), json.dumps(good_json()).encode())
        assert registry.lookup("job") == RegistryEntry("job", "node-0.mtc.svc:7000", "c0ffee", 12.0)

    def test_concurrent_registrations_never_tear(self, registry: Registry) -> None:
        """Two coordinators register in a loop while a reader looks up: always a whole entry."""
        writers = [entry(port=7000 + n, cid=f"{'ab'[n]}" * 40, at=float(n)) for n in range(2)]
        registry.register(writers[0])
        seen: list[RegistryEntry | None] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def write(e: RegistryEntry) -> None:
            try:
                for _ in range(100):
                    registry.register(e)
            except BaseException as exc:  # surfaced below, not lost in the thread
                errors.append(exc)

        def read() -> None:
            try:
                while not stop.is_set():
                    seen.append(registry.lookup("job"))
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read)
        threads = [threading.Thread(target=write, args=(e,)) for e in writers]
        reader.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        stop.set()
        reader.join(timeout=30)
        assert not errors
        assert not any(t.is_alive() for t in [*threads, reader])
        assert seen
        assert all(s in writers for s in seen)  # never None, never a mix of the two
        assert registry.lookup("job") in writers


def test_entries_are_validated_when_built() -> None:
    with pytest.raises(MalformedEntry, match="job name"):
        RegistryEntry("-job", "a:1", "id", 0.0)
    with pytest.raises(MalformedEntry, match="port"):
        RegistryEntry("job", "a", "id", 0.0)
    with pytest.raises(MalformedEntry, match="coordinator id"):
        RegistryEntry("job", "a:1", "", 0.0)
    with pytest.raises(MalformedEntry, match="registration time"):
        RegistryEntry("job", "a:1", "id", float("inf"))
    with pytest.raises(MalformedEntry, match="owner"):
        RegistryEntry("job", "a:1", "id", 0.0, "-team")
    with pytest.raises(MalformedEntry, match="job name"):
        Registry(MemoryObjectStore()).lookup("../x")
    assert check_address("127.0.0.1:1") == "127.0.0.1:1"
    with pytest.raises(MalformedEntry):
        check_address("-host:80")
    with pytest.raises(MalformedEntry):
        check_address("host.:80")
    ids = {new_coordinator_id() for _ in range(100)}
    assert len(ids) == 100
    for cid in ids:
        assert RegistryEntry("job", "a:1", cid, 0.0).coordinator_id == cid


def test_open_registry_shares_a_directory(tmp_path: Path) -> None:
    url = (tmp_path / "shared").as_uri()
    open_registry(url).register(entry())
    # Another daemon opening the same URL sees the entry.
    assert open_registry(url).lookup("job") == entry()
    assert open_registry(url).url == url
    with pytest.raises(ValueError, match="unsupported"):
        open_registry("ftp://host/x")


def test_mtc_registry_releases_only_what_blocks_a_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = tmp_path.as_uri()
    objects = FileObjectStore(tmp_path)
    objects.put_bytes(entry_key("job"), b"junk")
    assert cli.main(["registry", "show", url, "--job", "job"]) == 0
    assert "blocked" in capsys.readouterr().out
    assert cli.main(["registry", "release", url, "--job", "job", "--yes"]) == 0
    assert "released" in capsys.readouterr().out
    assert open_registry(url).lookup("job") is None
    assert cli.main(["registry", "release", url, "--job", "job", "--yes"]) == 0
    assert "its name is free" in capsys.readouterr().out
    # A valid entry: a running job may hold the name; released only with --force.
    open_registry(url).claim(RegistryEntry("job", "10.0.0.1:7070", "c0ffee", 12.0, "team-a"))
    assert cli.main(["registry", "release", url, "--job", "job", "--yes"]) == 1
    assert "--force" in capsys.readouterr().err
    assert open_registry(url).lookup("job") is not None
    assert cli.main(["registry", "release", url, "--job", "job", "--yes", "--force"]) == 0
    assert open_registry(url).lookup("job") is None
