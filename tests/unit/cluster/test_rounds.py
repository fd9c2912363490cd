"""``cluster.rounds``: how a participant obtains one item from the sources its plan gives."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from mtc_replicator.cluster.messages import FailedFetch
from mtc_replicator.cluster.rounds import JobRank, RoundContext, RoundParticipant
from mtc_replicator.cluster.sources import PEER_RETRY_SECONDS, ItemSources
from mtc_replicator.core.contract import BackupInterval, Framework, JobConfig
from mtc_replicator.core.manifest import ItemId, ItemKind, Manifest
from mtc_replicator.core.policy import Source
from mtc_replicator.core.restore_plan import Fetch
from mtc_replicator.local.store import LocalStore
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import MemoryObjectStore, ObjectStoreError
from mtc_replicator.transport.peer_client import PeerUnavailable

ITEM = ItemId("job", 10, 2, 0)
DIGEST = "ab" * 32


class RestartingPeer:
    """A holder that refuses connections ``down`` times (its daemon restarting), then
    serves; records each call."""

    def __init__(self, down: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.down, self.code, self.calls = down, code, 0

    async def pull_item(
        self, address: str, item: ItemId, store: Any, digest: str, *, vet: Any = None
    ) -> Manifest:
        self.calls += 1
        if self.calls <= self.down:
            raise PeerUnavailable(address, f"pull of {item}: connection refused", self.code)
        return Manifest(item, ItemKind.DIR, ())


def participant(
    tmp_path: Path, peer: RestartingPeer, peer_retry: float | None = None
) -> RoundParticipant:
    store = LocalStore(tmp_path / "checkpoint")
    (tmp_path / "checkpoint").mkdir()
    store.open()

    class BucketDown(MemoryObjectStore):
        def get_bytes(self, key: str) -> bytes:
            raise ObjectStoreError("the bucket is down too")

    config = JobConfig(
        job_name="job",
        framework=Framework.ORBAX,
        node_rank=2,
        nodes=4,
        peers_per_node=1,
        backup_interval=BackupInterval(minutes=None, steps=10),
    )
    sources = ItemSources(
        store,
        2,
        peers=peer,  # type: ignore[arg-type]
        backups=BackupStore(BucketDown()),
        peer_retry=PEER_RETRY_SECONDS if peer_retry is None else peer_retry,
    )
    return RoundParticipant(
        RoundContext(
            JobRank(
                config=config,
                incarnation_id="b2",
                store=store,
                finder=None,  # type: ignore[arg-type]
                advertise="127.0.0.1:7002",
            ),
            sources,
            error=lambda message, step: None,
        )
    )


def obtain(p: RoundParticipant, fetches: list[Fetch]) -> tuple[bool, list[FailedFetch]]:
    failures: list[FailedFetch] = []
    ok = asyncio.run(p._obtain_one(ITEM, fetches, {0: "127.0.0.1:7000"}, failures))
    return ok, failures


PEER = Fetch(Source.PEER, ITEM, 0, DIGEST)
BACKUP = Fetch(Source.BACKUP, ITEM, None, DIGEST)


def test_the_only_holder_restarting_is_waited_for(tmp_path: Path) -> None:
    # make chaos, seed 67: giving up at once rolled the job back to an older step.
    peer = RestartingPeer(down=2)
    ok, failures = obtain(participant(tmp_path, peer), [PEER])
    assert (ok, failures, peer.calls) == (True, [], 3)


def test_with_another_source_left_an_unreachable_holder_is_not_waited_for(
    tmp_path: Path,
) -> None:
    peer = RestartingPeer(down=1)
    ok, failures = obtain(participant(tmp_path, peer), [PEER, BACKUP])
    assert peer.calls == 1  # straight on to the backup (down too, in this test)
    assert not ok
    assert [f.fetch.source for f in failures] == [Source.PEER, Source.BACKUP]


@pytest.mark.parametrize(
    ("down", "code"),
    [(100, grpc.StatusCode.UNAVAILABLE), (1, grpc.StatusCode.RESOURCE_EXHAUSTED)],
    ids=["gone-for-good", "full-not-restarting"],
)
def test_a_holder_gone_for_good_or_full_is_given_up(
    tmp_path: Path, down: int, code: grpc.StatusCode
) -> None:
    peer = RestartingPeer(down=down, code=code)
    ok, failures = obtain(participant(tmp_path, peer, peer_retry=1.0), [PEER])
    assert not ok
    assert len(failures) == 1
    assert not failures[0].corrupt
    assert peer.calls <= 4  # waits of 0.25-0.5 s, 0.5-1 s within one second, then no more
