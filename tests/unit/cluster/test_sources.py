"""``cluster.sources``: an item fetched by source into a real ``LocalStore``, verified, and
each source's failures as our own types (``CorruptItem``, ``SourceUnavailable``,
``LocalCopyGone``) and what the round makes of each; what is none (a bug) reaches the
round's caller."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mtc_replicator.cluster.messages import FailedFetch
from mtc_replicator.cluster.rounds import JobRank, RoundContext, RoundParticipant
from mtc_replicator.cluster.sources import (
    ItemSources,
    LocalCopyGone,
    NoBackupSet,
    SourceUnavailable,
)
from mtc_replicator.core.attestation import ManifestTrust, Unattested
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.manifest import LEGACY_VERSION, CorruptItem, ItemId, Manifest
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.obs.metrics import Metrics, TransferKind
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore, ObjectStoreError
from mtc_replicator.transport.peer_client import ItemBusy, ItemNotFound, PeerUnavailable

ITEM = ItemId("job", 10, 1, 0)
ADDRESSES = {0: "127.0.0.1:7000"}


class Recorded(Metrics):
    def __init__(self) -> None:
        self.transfers: list[tuple[TransferKind, int]] = []

    def transfer(self, kind: TransferKind, nbytes: int, seconds: float) -> None:
        self.transfers.append((kind, nbytes))


def make_item(path: Path, item: ItemId = ITEM) -> Manifest:
    """An item's data at ``path``: two files in a step directory."""
    (path / "state").mkdir(parents=True)
    (path / "state" / "shard").write_bytes(os.urandom(3000))
    (path / "_CHECKPOINT_METADATA").write_bytes(b'{"step": 10}')
    return build_manifest(item, path)


def commit_into(store: LocalStore, data: Path, manifest: Manifest) -> None:
    """What a pull or a download does once the bytes are verified: stage, then commit."""
    staged = store.new_staging()
    os.rename(data, staged / "data")
    store.commit_staged(staged, manifest)


class FakePeers:
    """The ``PeerClient`` methods sources use: ``pull_item`` answers from ``answers`` in
    turn (an exception is raised; ``None`` lands ``source`` in the store)."""

    def __init__(self, source: Path, manifest: Manifest, *answers: Exception | None) -> None:
        self.source, self.manifest = source, manifest
        self.answers = list(answers) or [None]
        self.calls = 0

    async def pull_item(
        self,
        address: str,
        item: ItemId,
        store: LocalStore,
        expected_digest: str | None = None,
        *,
        vet: Callable[[Manifest], object] | None = None,
    ) -> Manifest:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if answer is not None:
            raise answer
        assert expected_digest == self.manifest.digest
        if vet is not None:
            vet(self.manifest)  # as the real client does, before a byte of data
        commit_into(store, self.source, self.manifest)
        return self.manifest


class World:
    """A store on tmp_path, a second item's bytes to serve, an in-memory bucket."""

    def __init__(self, tmp_path: Path) -> None:
        (tmp_path / "checkpoint").mkdir()
        self.store = LocalStore(tmp_path / "checkpoint")
        self.store.open()
        self.source = tmp_path / "elsewhere"
        self.manifest = make_item(self.source)
        self.objects = MemoryObjectStore()
        self.backups = BackupStore(self.objects)
        self.metrics = Recorded()
        self.tmp_path = tmp_path

    def sources(self, **kw: object) -> ItemSources:
        kw.setdefault("backups", self.backups)
        return ItemSources(
            self.store,
            1,
            metrics=self.metrics,
            **kw,  # type: ignore[arg-type]
        )

    def fetch(self, sources: ItemSources, f: Fetch, *, last: bool = True) -> None:
        asyncio.run(sources.fetch(f, ADDRESSES, last=last))

    def holds_it(self) -> bool:
        held = self.store.get(ITEM)
        if held is None or held.digest != self.manifest.digest:
            return False
        self.store.verify(ITEM)
        return True

    def upload(self) -> None:
        self.backups.upload_item(self.manifest, self.source)
        assert self.backups.try_commit("job", 10, [ITEM.key]) is not None


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def local(w: World) -> Fetch:
    return Fetch(Source.LOCAL, ITEM, 1, w.manifest.digest)


def peer(w: World, *, pending: bool = False, holder: int = 0) -> Fetch:
    return Fetch(Source.PEER, ITEM, holder, w.manifest.digest, pending=pending)


def backup(w: World) -> Fetch:
    return Fetch(Source.BACKUP, ITEM, None, w.manifest.digest)


def unavailable(code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> PeerUnavailable:
    return PeerUnavailable("127.0.0.1:7000", "connection refused", code)


# --- each source lands a verified item ----------------------------------------------------


def test_a_local_copy_is_verified_in_place(world: World) -> None:
    commit_into(world.store, world.source, world.manifest)
    world.fetch(world.sources(), local(world))
    assert world.holds_it()
    assert world.metrics.transfers == [(TransferKind.RESTORE_LOCAL, world.manifest.total_bytes)]


def test_a_peer_copy_is_pulled(world: World) -> None:
    peers = FakePeers(world.source, world.manifest)
    world.fetch(world.sources(peers=peers), peer(world))
    assert world.holds_it()
    assert peers.calls == 1
    assert world.metrics.transfers == [(TransferKind.RESTORE_PEER, world.manifest.total_bytes)]


def test_a_pending_pull_waits_for_the_holder_then_lands(world: World) -> None:
    peers = FakePeers(
        world.source, world.manifest, ItemNotFound("a", "not yet"), ItemBusy("a", "x"), None
    )
    world.fetch(world.sources(peers=peers), peer(world, pending=True))
    assert world.holds_it()
    assert peers.calls == 3
    # The waits between tries are not transfer time: one transfer, counted once.
    assert world.metrics.transfers == [(TransferKind.RESTORE_PEER, world.manifest.total_bytes)]


def test_the_last_source_waits_for_a_restarting_holder(world: World) -> None:
    peers = FakePeers(world.source, world.manifest, unavailable(), None)
    world.fetch(world.sources(peers=peers, peer_retry=5.0), peer(world), last=True)
    assert world.holds_it()
    assert peers.calls == 2


def test_a_backup_copy_is_downloaded_pinned_by_digest(world: World) -> None:
    world.upload()
    world.fetch(world.sources(), backup(world))
    assert world.holds_it()
    assert world.metrics.transfers == [(TransferKind.RESTORE_BACKUP, world.manifest.total_bytes)]
    assert list(world.store.staging_root.iterdir()) == []  # the staging is gone


def test_a_copy_held_here_is_verified_whatever_the_plan_says(world: World) -> None:
    commit_into(world.store, world.source, world.manifest)
    peers = FakePeers(world.source, world.manifest, AssertionError("not pulled"))
    world.fetch(world.sources(peers=peers), peer(world))
    assert peers.calls == 0
    assert [k for k, _ in world.metrics.transfers] == [TransferKind.RESTORE_LOCAL]


# --- a corrupt copy is CorruptItem --------------------------------------------------------


def test_a_corrupt_local_copy_is_corrupt_and_deleted(world: World) -> None:
    commit_into(world.store, world.source, world.manifest)
    shard = world.store.data_path(ITEM) / "state" / "shard"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptItem):
        world.fetch(world.sources(), local(world))
    assert world.store.get(ITEM) is None


def test_a_local_copy_that_differs_from_the_plan_is_corrupt_and_deleted(world: World) -> None:
    commit_into(world.store, world.source, world.manifest)
    other = Fetch(Source.LOCAL, ITEM, 1, "f" * 64)
    with pytest.raises(CorruptItem, match="differs from the plan"):
        world.fetch(world.sources(), other)
    assert world.store.get(ITEM) is None


def test_a_corrupt_pull_is_corrupt(world: World) -> None:
    peers = FakePeers(world.source, world.manifest, CorruptItem("chunk 3: crc mismatch"))
    with pytest.raises(CorruptItem, match="crc mismatch"):
        world.fetch(world.sources(peers=peers), peer(world))


def test_a_corrupt_backup_copy_is_corrupt_and_never_lands(world: World) -> None:
    world.upload()
    key = next(o.key for o in world.objects.list("job/") if o.key.endswith("/state/shard"))
    data = bytearray(world.objects.get_bytes(key))
    data[11] ^= 0x80
    world.objects.put_bytes(key, bytes(data))
    with pytest.raises(CorruptItem):
        world.fetch(world.sources(), backup(world))
    assert world.store.get(ITEM) is None
    assert list(world.store.staging_root.iterdir()) == []


# --- a copy that is not there is not corrupt ---------------------------------------------


def test_a_local_copy_gone_is_gone_not_corrupt(world: World) -> None:
    with pytest.raises(LocalCopyGone, match="no longer in this node's store") as caught:
        world.fetch(world.sources(), local(world))
    assert not isinstance(caught.value, CorruptItem | SourceUnavailable)


def test_no_backup_set_is_an_unavailable_source_not_corrupt(world: World) -> None:
    with pytest.raises(NoBackupSet, match="no backup is set on this node") as caught:
        world.fetch(world.sources(backups=None), backup(world))
    assert isinstance(caught.value, SourceUnavailable)
    assert not isinstance(caught.value, CorruptItem)


def participant(world: World, sources: ItemSources, said: list[str]) -> RoundParticipant:
    """Rank 1's side of a round, fetching through ``sources``; its errors said to ``said``."""
    config = JobConfig(
        job_name="job",
        framework=Framework.ORBAX,
        node_rank=1,
        nodes=2,
        peers_per_node=1,
        backup_interval=BackupInterval(minutes=None, steps=10),
    )
    return RoundParticipant(
        RoundContext(
            JobRank(config, "inc", world.store, None, "127.0.0.1:7001"),  # type: ignore[arg-type]
            sources,
            error=lambda message, step: said.append(message),
        )
    )


def test_the_round_reports_a_copy_gone_as_failed_not_corrupt(world: World) -> None:
    """Its last source gone: the coordinator hears "not corrupt", and the job is not held
    from a fresh start for it (nothing of it is left anywhere to wait for)."""
    said: list[str] = []
    rank = participant(world, world.sources(), said)
    failures: list[FailedFetch] = []
    assert not asyncio.run(rank._obtain_one(ITEM, [local(world)], ADDRESSES, failures))
    assert [(f.fetch, f.corrupt) for f in failures] == [(local(world), False)]
    assert len(said) == 1
    assert "no longer in this node's store" in said[0]
    assert "corrupt" not in said[0]
    assert rank._unavailable == []


def test_the_round_reports_no_backup_set_as_unavailable(world: World) -> None:
    """A committed step the coordinator listed that this node cannot fetch: a fresh start
    must not pass for a restore (``RoundOutcome.unavailable`` blocks it)."""
    said: list[str] = []
    rank = participant(world, world.sources(backups=None), said)
    failures: list[FailedFetch] = []
    assert not asyncio.run(rank._obtain_one(ITEM, [backup(world)], ADDRESSES, failures))
    assert [(f.fetch, f.corrupt) for f in failures] == [(backup(world), False)]
    assert "corrupt" not in said[0]
    assert len(rank._unavailable) == 1
    assert "no backup is set on this node" in rank._unavailable[0]


# --- an unreachable source is SourceUnavailable -------------------------------------------


class BucketDown(MemoryObjectStore):
    def get_bytes(self, key: str) -> bytes:
        raise ObjectStoreError("503 Service Unavailable")


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda w: w.sources(peers=FakePeers(w.source, w.manifest, unavailable())), "refused"),
        (
            lambda w: w.sources(
                peers=FakePeers(w.source, w.manifest, OSError(errno.ENOSPC, "No space left"))
            ),
            "No space left",
        ),
        (lambda w: w.sources(peers=None), "no address for rank 0"),
    ],
    ids=["holder-unreachable", "disk-full", "no-peer-plane"],
)
def test_an_unusable_peer_is_unavailable(
    world: World, make: Callable[[World], ItemSources], text: str
) -> None:
    with pytest.raises(SourceUnavailable, match=text):
        world.fetch(make(world), peer(world), last=False)


def test_a_holder_without_an_address_is_unavailable(world: World) -> None:
    peers = FakePeers(world.source, world.manifest)
    with pytest.raises(SourceUnavailable, match="no address for rank 5"):
        world.fetch(world.sources(peers=peers), peer(world, holder=5))
    assert peers.calls == 0


def test_a_holder_that_never_gets_the_item_is_unavailable(world: World) -> None:
    peers = FakePeers(world.source, world.manifest, ItemNotFound("a", "no such item"))
    sources = world.sources(peers=peers, pending_grace=0.2)
    with pytest.raises(SourceUnavailable, match=r"no such item \(waited"):
        world.fetch(sources, peer(world, pending=True))


def test_a_bucket_down_is_unavailable(world: World) -> None:
    sources = world.sources(backups=BackupStore(BucketDown()))
    with pytest.raises(SourceUnavailable, match="503"):
        world.fetch(sources, backup(world))


# --- a bug is not a lost source -----------------------------------------------------------


def test_a_key_error_is_a_bug_not_an_unavailable_source(world: World) -> None:
    peers = FakePeers(world.source, world.manifest, KeyError("rank"))
    sources = world.sources(peers=peers)
    with pytest.raises(KeyError):
        world.fetch(sources, peer(world))
    said: list[str] = []
    rank = participant(world, sources, said)
    failures: list[FailedFetch] = []
    # The round does not count it as a source lost (and so fall back to an older step).
    with pytest.raises(KeyError):
        asyncio.run(rank._obtain_one(ITEM, [peer(world), backup(world)], ADDRESSES, failures))
    assert (failures, said) == ([], [])


# --- content digests --------------------------------------------------------------------------


def test_a_copy_written_before_digests_is_restored_and_said_unverifiable(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A format-1 manifest (crc32c only) in the store after an upgrade: used, not refused,
    and the log says the restore could not check it against a digest."""
    old = dataclasses.replace(
        world.manifest,
        files=tuple(dataclasses.replace(f, blake3=None) for f in world.manifest.files),
        version=LEGACY_VERSION,
    )
    commit_into(world.store, world.source, old)
    fetch = Fetch(Source.LOCAL, ITEM, 1, old.digest)
    with caplog.at_level(logging.WARNING, logger="mtc_replicator.cluster.sources"):
        world.fetch(world.sources(), fetch)
    assert world.store.get(ITEM) == old
    assert "unverifiable: written before digests" in caplog.text


def test_a_copy_with_digests_is_not_said_unverifiable(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    commit_into(world.store, world.source, world.manifest)
    with caplog.at_level(logging.WARNING, logger="mtc_replicator.cluster.sources"):
        world.fetch(world.sources(), local(world))
    assert "unverifiable" not in caplog.text


# --- attestations: whose bytes (core.attestation) ---------------------------------------------


class _AnyNode:
    """A verifier that believes every signature (the real one is tested elsewhere): here
    what matters is what ``ItemSources`` does with a refusal."""

    def verify_node(self, payload: bytes, signature: object, at: float) -> str:
        return "node-0"


STRICT = ManifestTrust(verifier=_AnyNode())
"""Takes only signed items: every item of ``World`` is unsigned."""


@pytest.mark.parametrize("source", ["peer", "backup"])
def test_an_unattested_copy_is_refused_before_its_data_moves(world: World, source: str) -> None:
    peers = FakePeers(world.source, world.manifest)
    world.upload()
    sources = world.sources(peers=peers, trust=STRICT, owner="team-a")
    with pytest.raises(Unattested, match="not signed by its producer"):
        world.fetch(sources, peer(world) if source == "peer" else backup(world))
    assert world.store.get(ITEM) is None  # nothing was committed, nothing is left
    assert world.metrics.transfers == []


def test_an_unattested_held_copy_is_refused_but_kept(world: World) -> None:
    commit_into(world.store, world.source, world.manifest)
    with pytest.raises(Unattested):
        world.fetch(world.sources(trust=STRICT), local(world))
    assert world.holds_it()  # a copy held before is never deleted for it
    assert world.metrics.transfers == []  # refused before a byte was read


def test_another_owners_copy_is_refused_even_unsigned(world: World) -> None:
    theirs = ManifestTrust().attest(world.manifest, "team-b", 1.0)
    peers = FakePeers(world.source, theirs)
    sources = world.sources(peers=peers, owner="team-a")
    with pytest.raises(Unattested, match="belongs to owner 'team-b'"):
        world.fetch(sources, peer(world))
    assert world.store.get(ITEM) is None


def test_a_refused_copy_never_costs_the_other_copy_held(world: World) -> None:
    """The store holds the item with another digest than the plan's; the planned peer copy
    is refused: the held one stays (the refusal comes before anything is committed)."""
    commit_into(world.store, world.source, world.manifest)
    legacy = dataclasses.replace(
        world.manifest,
        files=tuple(dataclasses.replace(f, blake3=None) for f in world.manifest.files),
        version=LEGACY_VERSION,
    )
    peers = FakePeers(world.source, legacy)
    fetch = Fetch(Source.PEER, ITEM, 0, legacy.digest)
    with pytest.raises(Unattested):
        world.fetch(world.sources(peers=peers, trust=STRICT), fetch)
    assert world.holds_it()
