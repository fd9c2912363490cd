"""The peer wire's conventions, both ends' (pure: no sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator.core.manifest import FileEntry, ItemId, ItemKind, Manifest
from mtc_replicator.transport.datachannel import TOKEN_BYTES
from mtc_replicator.transport.peerwire import (
    DATA_CHANNEL_KEY,
    GO_AHEAD,
    MAX_MESSAGE_BYTES,
    SERVER_OPTIONS,
    channel_offer,
    check_streams,
    chunks_of,
    fill_chunk,
    item_id,
    item_ref,
    offer_text,
    push_offer,
)
from mtc_replicator.transport.transfer import MAX_CHUNK, TransferError


def test_an_item_goes_to_the_wire_and_back_unchanged() -> None:
    item = ItemId("job-1", 40, 3, 1)
    assert item_id(item_ref(item)) == item


@pytest.mark.parametrize("job", ["../etc", "a/b", "", ".hidden", "a..b", "x" * 300])
def test_a_hostile_job_name_on_the_wire_is_refused(job: str) -> None:
    with pytest.raises(TransferError, match="unsafe job name"):
        item_id(pb.ItemRef(job=job, step=1, rank=0, worker=0))


def test_no_offer_is_none_and_a_good_one_is_read() -> None:
    token = bytes(range(TOKEN_BYTES))
    assert channel_offer(0, b"") is None
    assert channel_offer(7071, token) == (7071, (token,))
    other = bytes(reversed(token))
    assert channel_offer(7071, token, [other]) == (7071, (token, other))


@pytest.mark.parametrize(
    ("port", "token"), [(0, b"x" * TOKEN_BYTES), (65536, b"x" * TOKEN_BYTES), (7071, b"short")]
)
def test_a_malformed_offer_is_refused(port: int, token: bytes) -> None:
    with pytest.raises(TransferError, match="malformed"):
        channel_offer(port, token)


def test_an_offer_with_a_malformed_further_token_is_refused() -> None:
    good = bytes(range(TOKEN_BYTES))
    with pytest.raises(TransferError, match=r"malformed.*16/5-byte"):
        channel_offer(7071, good, [b"short"])
    with pytest.raises(TransferError, match="malformed"):
        channel_offer(0, b"", [good])  # no first token, no port


def _manifest(*sizes: int) -> Manifest:
    files = tuple(FileEntry(f"f{n}", size, 0, "0" * 64) for n, size in enumerate(sizes))
    return Manifest(ItemId("job", 1, 0, 0), ItemKind.DIR, files)


def test_no_more_connections_than_asked_for_or_the_files_can_fill() -> None:
    tokens = tuple(bytes([n]) * TOKEN_BYTES for n in range(4))
    check_streams((7071, tokens[:2]), _manifest(5, 5, 5), asked=2)
    with pytest.raises(TransferError, match="3 data connections offered, at most 2"):
        check_streams((7071, tokens[:3]), _manifest(5, 5, 5), asked=2)
    # Two files carry bytes: a third connection would have nothing to carry.
    with pytest.raises(TransferError, match="3 data connections offered, at most 2"):
        check_streams((7071, tokens[:3]), _manifest(5, 0, 5), asked=4)


def test_a_push_offer_is_read_from_the_go_ahead_metadata() -> None:
    token = bytes(range(TOKEN_BYTES))
    metadata = (GO_AHEAD, (DATA_CHANNEL_KEY, f"7071 {token.hex()}"))
    assert push_offer(metadata) == (7071, (token,))
    assert push_offer((GO_AHEAD,)) is None
    other = bytes(reversed(token))
    several = (GO_AHEAD, (DATA_CHANNEL_KEY, offer_text(7071, [token, other])))
    assert push_offer(several) == (7071, (token, other))


@pytest.mark.parametrize(
    "value",
    ["7071", "port abcd", "7071 zz", "7071 " + "ab" * 3, "7071 " + "ab" * 16 + " " + "ab" * 3],
)
def test_a_malformed_push_offer_is_refused(value: str) -> None:
    with pytest.raises(TransferError, match="malformed"):
        push_offer((GO_AHEAD, (DATA_CHANNEL_KEY, value)))


def test_a_filled_chunk_is_read_back_as_the_receiver_takes_it() -> None:
    message = pb.PushItemRequest()
    fill_chunk(message.chunk, 2, 4096, b"bytes", 1234)

    async def one() -> AsyncIterator[pb.PushItemRequest]:
        yield message

    async def read() -> list[tuple[int, int, bytes, int]]:
        return [c async for c in chunks_of(one())]

    assert asyncio.run(read()) == [(2, 4096, b"bytes", 1234)]


def test_only_chunks_may_follow_a_header() -> None:
    async def header_again() -> AsyncIterator[pb.PushItemRequest]:
        yield pb.PushItemRequest(header=pb.PushHeader())

    async def read() -> None:
        async for _ in chunks_of(header_again()):
            pass

    with pytest.raises(TransferError, match="only chunks"):
        asyncio.run(read())


def test_a_message_holds_the_largest_chunk() -> None:
    assert MAX_MESSAGE_BYTES > MAX_CHUNK
    assert ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES) in SERVER_OPTIONS
