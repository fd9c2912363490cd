"""Hostile pushes against a real daemon, from a raw gRPC client (the generated stub).

Every attack must be refused with the right status code, and afterwards nothing outside the
staging area may have changed (the whole CHECKPOINT_DIR tree is compared, byte for byte),
the staging area must be empty and the daemon must still serve. One daemon takes all the
attacks in turn, as a node would; a valid push at the end proves it still works.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from replicator._pb.mtc.v1 import peer_pb2 as pb
from replicator._pb.mtc.v1 import peer_pb2_grpc
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    config_text,
    item_dir,
    ram_disk,
    read_text,
    running_daemon,
    store_root,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
Code = grpc.StatusCode
STEP = 5
BIG = os.urandom(300 * 1024 + 7)
SMALL = b"hello"


@dataclass
class Victim:
    job: str
    ckpt: Path
    outside: Path
    """A directory outside CHECKPOINT_DIR that attacks try to reach."""
    daemon: DaemonProcess
    stub: peer_pb2_grpc.PeerStub


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    root = tmp_path_factory.mktemp("hostile")
    job = f"hostile-{uuid.uuid4().hex[:6]}"
    outside = root / "outside"
    outside.mkdir()
    with contextlib.ExitStack() as stack:
        ckpt = stack.enter_context(ram_disk(root / "ckpt", "64m"))
        daemon = stack.enter_context(running_daemon(ckpt))
        write_yaml_atomic(ckpt, config_text(job, nodes=1))
        wait_markers(ckpt, job, 0, daemon)
        # The handshake's last write: from here on the tree changes only if an attack gets in.
        state = store_root(ckpt) / "incarnation.json"
        wait_until(
            lambda: json.loads(read_text(state) or "{}").get("phase") == "steady",
            "the incarnation in steady state",
            daemon=daemon,
        )
        channel = stack.enter_context(grpc.insecure_channel(daemon.address))
        yield Victim(job, ckpt, outside, daemon, peer_pb2_grpc.PeerStub(channel))


# --- building (hostile) requests -----------------------------------------------------------------


def crc(data: bytes) -> int:
    return int(google_crc32c.value(data))


def content(job: str, **over: Any) -> dict[str, Any]:
    """A valid item's manifest content (as ``Manifest._content`` lays it out)."""
    body: dict[str, Any] = {
        "version": 1,
        "job": job,
        "step": STEP,
        "rank": 0,
        "worker": 0,
        "kind": "dir",
        "dirs": ["state"],
        "files": [
            ["meta", len(SMALL), f"{crc(SMALL):08x}"],
            ["state/big.bin", len(BIG), f"{crc(BIG):08x}"],
        ],
    }
    body.update(over)
    return body


def canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def header(
    body: dict[str, Any] | None = None,
    *,
    job: str,
    raw: bytes | None = None,
    digest: str | None = None,
    ref: dict[str, Any] | None = None,
    data_channel: bool = False,
) -> pb.PushItemRequest:
    raw = canonical(body or content(job)) if raw is None else raw
    item = ref or {"job": job, "step": STEP, "rank": 0, "worker": 0}
    return pb.PushItemRequest(
        header=pb.PushHeader(
            item=pb.ItemRef(**item),
            manifest=raw,
            manifest_digest=hashlib.sha256(raw).hexdigest() if digest is None else digest,
            data_channel=data_channel,
        )
    )


def chunk(index: int, offset: int, data: bytes, checksum: int | None = None) -> pb.PushItemRequest:
    return pb.PushItemRequest(
        chunk=pb.Chunk(
            file_index=index,
            offset=offset,
            data=data,
            crc32c=crc(data) if checksum is None else checksum,
        )
    )


def good_chunks() -> list[pb.PushItemRequest]:
    half = len(BIG) // 2
    return [chunk(0, 0, SMALL), chunk(1, 0, BIG[:half]), chunk(1, half, BIG[half:])]


Attack = Callable[[str], list[pb.PushItemRequest]]


def with_body(**over: Any) -> Attack:
    return lambda job: [header(content(job, **over), job=job), *good_chunks()]


def with_chunks(make: Callable[[], list[pb.PushItemRequest]]) -> Attack:
    return lambda job: [header(job=job), *make()]


ATTACKS: dict[str, tuple[Attack, Code, str]] = {
    "absolute-path": (
        with_body(files=[["/etc/passwd", 5, f"{crc(SMALL):08x}"]]),
        Code.INVALID_ARGUMENT,
        "unsafe path",
    ),
    "dot-dot": (
        with_body(files=[["state/../../escape", 5, f"{crc(SMALL):08x}"]]),
        Code.INVALID_ARGUMENT,
        "unsafe path",
    ),
    "backslash": (
        with_body(dirs=[], files=[["..\\escape", 5, f"{crc(SMALL):08x}"]]),
        Code.INVALID_ARGUMENT,
        "unsafe path",
    ),
    # A name used as a file and as the directory of another: the only way a manifest can
    # alias one path through another (there is no way to declare a symlink at all).
    "path-through-a-file": (
        with_body(
            dirs=[],
            files=[["meta", 5, f"{crc(SMALL):08x}"], ["meta/inner", 5, f"{crc(SMALL):08x}"]],
        ),
        Code.INVALID_ARGUMENT,
        "parent directory",
    ),
    "parent-not-listed": (
        with_body(dirs=[], files=[["state/big.bin", len(BIG), f"{crc(BIG):08x}"]]),
        Code.INVALID_ARGUMENT,
        "parent directory",
    ),
    "too-large-for-this-node": (
        with_body(files=[["meta", 1 << 40, f"{crc(SMALL):08x}"]], dirs=[]),
        Code.RESOURCE_EXHAUSTED,
        "do not fit",
    ),
    "size-over-the-protocol-limit": (
        with_body(files=[["meta", 1 << 50, f"{crc(SMALL):08x}"]], dirs=[]),
        Code.INVALID_ARGUMENT,
        "bad size",
    ),
    "another-job": (
        lambda job: [
            header(content("someone-elses-job"), job="someone-elses-job"),
            *good_chunks(),
        ],
        Code.FAILED_PRECONDITION,
        "someone-elses-job",
    ),
    "unsafe-job-name": (
        lambda job: [
            header(job=job, ref={"job": "../etc", "step": STEP, "rank": 0, "worker": 0}),
            *good_chunks(),
        ],
        Code.INVALID_ARGUMENT,
        "unsafe job name",
    ),
    "digest-mismatch": (
        lambda job: [header(job=job, digest="ab" * 32), *good_chunks()],
        Code.DATA_LOSS,
        "sha256",
    ),
    "malformed-digest": (
        lambda job: [header(job=job, digest="not-hex"), *good_chunks()],
        Code.INVALID_ARGUMENT,
        "digest",
    ),
    "manifest-names-another-item": (
        lambda job: [header(content(job, step=STEP + 1), job=job), *good_chunks()],
        Code.INVALID_ARGUMENT,
        "the header names",
    ),
    "non-canonical-manifest": (
        lambda job: [header(job=job, raw=json.dumps(content(job), indent=1).encode())],
        Code.INVALID_ARGUMENT,
        "canonical",
    ),
    "not-json": (
        lambda job: [header(job=job, raw=b"{not json")],
        Code.INVALID_ARGUMENT,
        "not JSON",
    ),
    "empty-stream": (lambda job: [], Code.INVALID_ARGUMENT, "header"),
    "chunk-before-header": (
        lambda job: [*good_chunks(), header(job=job)],
        Code.INVALID_ARGUMENT,
        "header",
    ),
    "second-header": (
        lambda job: [header(job=job), header(job=job), *good_chunks()],
        Code.INVALID_ARGUMENT,
        "only chunks",
    ),
    "chunk-crc-wrong": (
        with_chunks(lambda: [chunk(0, 0, SMALL, crc(SMALL) ^ 1), *good_chunks()[1:]]),
        Code.DATA_LOSS,
        "fails its crc32c",
    ),
    "chunk-past-the-file-size": (
        with_chunks(lambda: [*good_chunks(), chunk(1, len(BIG), b"more")]),
        Code.INVALID_ARGUMENT,
        "the manifest says",
    ),
    "more-data-than-declared": (
        with_chunks(lambda: [chunk(0, 0, SMALL + b"!!"), *good_chunks()[1:]]),
        Code.INVALID_ARGUMENT,
        "the manifest says 5",
    ),
    "offsets-with-a-gap": (
        with_chunks(lambda: [chunk(0, 0, SMALL), chunk(1, 0, BIG[:1000]), chunk(1, 2000, BIG)]),
        Code.INVALID_ARGUMENT,
        "expected 1000",
    ),
    "file-index-out-of-range": (
        with_chunks(lambda: [chunk(2, 0, SMALL), *good_chunks()]),
        Code.INVALID_ARGUMENT,
        "out of range",
    ),
    "file-index-goes-back": (
        with_chunks(lambda: [chunk(0, 0, SMALL), chunk(1, 0, BIG), chunk(0, 5, b"x")]),
        Code.INVALID_ARGUMENT,
        "after a later file",
    ),
    "chunk-over-4-MiB": (
        with_chunks(lambda: [chunk(0, 0, bytes((4 << 20) + 1))]),
        Code.INVALID_ARGUMENT,
        "chunk of",
    ),
    "truncated-stream": (
        with_chunks(lambda: good_chunks()[:2]),
        Code.DATA_LOSS,
        "received",
    ),
    "whole-file-crc-wrong": (
        lambda job: [
            header(
                content(job, files=[["meta", 5, "00000000"], *content(job)["files"][1:]]), job=job
            ),
            *good_chunks(),
        ],
        Code.DATA_LOSS,
        "00000000",
    ),
}


# --- what must hold after every attack -------------------------------------------------------


def snapshot(ckpt: Path) -> dict[str, tuple[Any, ...]]:
    """Every name below CHECKPOINT_DIR and the store with its type and content, except
    in-flight areas."""
    store = store_root(ckpt)
    skip = {store / "staging", store / "trash"}
    out: dict[str, tuple[Any, ...]] = {}
    for top, dirpath, dirnames, filenames in [
        (root, *walked) for root in (ckpt, store) for walked in os.walk(root)
    ]:
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in skip]
        for name in dirnames + filenames:
            path = here / name
            rel = f"{top.name}/{path.relative_to(top)}"
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def staging_entries(ckpt: Path) -> list[Path]:
    return list((store_root(ckpt) / "staging").iterdir())


def assert_unharmed(v: Victim, before: dict[str, tuple[Any, ...]]) -> None:
    wait_until(lambda: staging_entries(v.ckpt) == [], "staging emptied", daemon=v.daemon)
    assert snapshot(v.ckpt) == before
    assert list(v.outside.iterdir()) == []
    assert v.daemon.running
    with grpc.insecure_channel(v.daemon.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="mtc.v1.Peer"), timeout=5
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("name", list(ATTACKS))
def test_a_hostile_push_is_refused_and_changes_nothing(victim: Victim, name: str) -> None:
    attack, code, detail = ATTACKS[name]
    before = snapshot(victim.ckpt)
    with pytest.raises(grpc.RpcError) as refused:
        victim.stub.PushItem(iter(attack(victim.job)), timeout=10)
    assert refused.value.code() == code, refused.value.details()
    assert detail in refused.value.details()
    assert_unharmed(victim, before)


@pytest.mark.parametrize("planted", ["dangling-file-link", "directory-swapped-for-a-link"])
def test_symlinks_planted_in_staging_are_never_followed(victim: Victim, planted: str) -> None:
    """A local process swaps what the receiver created for links while the chunks are on
    their way: the receiver creates files with O_EXCL and reaches them through directory
    descriptors opened with O_NOFOLLOW, so it fails instead of writing outside."""
    before = snapshot(victim.ckpt)
    gate = threading.Event()

    def requests() -> Iterator[pb.PushItemRequest]:
        yield header(job=victim.job)
        gate.wait(15)
        yield from good_chunks()

    call = victim.stub.PushItem.future(requests(), timeout=20)
    try:
        state = wait_until(
            lambda: next(iter((store_root(victim.ckpt) / "staging").glob("*/data/state")), None),
            "the push's staging directory",
            daemon=victim.daemon,
        )
        if planted == "dangling-file-link":
            (state / "big.bin").symlink_to(victim.outside / "planted.bin")
        else:
            state.rmdir()
            state.symlink_to(victim.outside)
    finally:
        gate.set()
    with pytest.raises(grpc.RpcError) as refused:
        call.result()
    assert refused.value.code() == Code.INTERNAL, refused.value.details()
    assert list(victim.outside.iterdir()) == []
    assert_unharmed(victim, before)


def test_a_push_cancelled_midway_leaves_nothing(victim: Victim) -> None:
    before = snapshot(victim.ckpt)
    gate = threading.Event()

    def requests() -> Iterator[pb.PushItemRequest]:
        yield header(job=victim.job)
        yield good_chunks()[0]
        gate.wait(15)
        yield from good_chunks()[1:]

    call = victim.stub.PushItem.future(requests(), timeout=20)
    wait_until(
        lambda: list((store_root(victim.ckpt) / "staging").glob("*/data/meta")),
        "the first chunk written",
        daemon=victim.daemon,
    )
    call.cancel()
    gate.set()
    assert_unharmed(victim, before)


# --- the data channel -----------------------------------------------------------------------------

DC_STEP = STEP + 20
"""Data-channel attacks push a step of their own: never committed, so never "already held"."""
BODY = SMALL + BIG
"""What a data-channel sender writes: every file's bytes in manifest order."""


def flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


def dc_header(job: str, step: int) -> pb.PushItemRequest:
    ref = {"job": job, "step": step, "rank": 0, "worker": 0}
    return header(content(job, step=step), job=job, ref=ref, data_channel=True)


def dc_push(
    v: Victim, step: int, attack: Callable[[int, bytes], None]
) -> grpc.Future[pb.PushItemResponse]:
    """Start a push that asks for the data channel, hand the offer to ``attack``, then end
    the request stream; the call, for its verdict."""
    gate = threading.Event()

    def requests() -> Iterator[pb.PushItemRequest]:
        yield dc_header(v.job, step)
        gate.wait(20)

    call = v.stub.PushItem.future(requests(), timeout=20)
    try:
        offer = dict(call.initial_metadata())["mtc-data-channel"]
        assert isinstance(offer, str)
        port, token = offer.split()
        attack(int(port), bytes.fromhex(token))
    finally:
        gate.set()
    return call


def send_on_channel(port: int, payload: bytes) -> None:
    """Connect, write ``payload`` (token included), end the stream, wait for the close."""
    # The receiver may give up before all is sent.
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as s,
        contextlib.suppress(OSError),
    ):
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)


DC_ATTACKS: dict[str, tuple[Callable[[bytes], bytes], Code, str]] = {
    "stream-ends-early": (lambda token: token + BODY[:-100], Code.UNAVAILABLE, "closed after"),
    "more-bytes-than-the-manifest": (
        lambda token: token + BODY + b"junk",
        Code.INVALID_ARGUMENT,
        "more bytes",
    ),
    "a-flipped-byte": (lambda token: token + flip(BODY, 1000), Code.DATA_LOSS, "big.bin"),
    "only-the-token": (lambda token: token, Code.UNAVAILABLE, "closed after 0"),
}


@pytest.mark.parametrize("name", list(DC_ATTACKS))
def test_a_hostile_data_channel_sender_is_refused_and_changes_nothing(
    victim: Victim, name: str
) -> None:
    payload, code, detail = DC_ATTACKS[name]
    before = snapshot(victim.ckpt)
    call = dc_push(victim, DC_STEP, lambda port, token: send_on_channel(port, payload(token)))
    with pytest.raises(grpc.RpcError) as refused:
        call.result()
    assert refused.value.code() == code, refused.value.details()
    assert detail in refused.value.details()
    assert_unharmed(victim, before)


def test_a_wrong_or_reused_token_is_shut_out(victim: Victim) -> None:
    """Wrong tokens are closed without effect on the push they guess at; the right one
    delivers the item; the same token again is closed too."""
    step = DC_STEP + 1
    tokens: list[bytes] = []

    def attack(port: int, token: bytes) -> None:
        tokens.append(token)
        for guess in (flip(token, 0), token[:-1] + b"\x00", b"\x00" * len(token)):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(guess + BODY)
                s.settimeout(10)
                with contextlib.suppress(ConnectionResetError):
                    assert s.recv(1) == b"", "a wrong token was answered"
        send_on_channel(port, token + BODY)

    reply = dc_push(victim, step, attack).result()
    assert reply.bytes_received == len(BODY)
    data = item_dir(victim.ckpt, victim.job, step) / "data"
    assert (data / "state" / "big.bin").read_bytes() == BIG
    port = int(victim.daemon.log().rsplit("data-port=", 1)[1].split()[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(tokens[0] + BODY)
        s.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(1) == b"", "a used token was answered"


def test_a_data_channel_push_cancelled_midway_leaves_nothing(victim: Victim) -> None:
    before = snapshot(victim.ckpt)
    calls: list[grpc.Future[pb.PushItemResponse]] = []
    conn: list[socket.socket] = []

    def attack(port: int, token: bytes) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        conn.append(s)
        s.sendall(token + BODY[: len(BODY) // 2])

    calls.append(dc_push(victim, DC_STEP, attack))
    wait_until(
        lambda: list((store_root(victim.ckpt) / "staging").glob("*/data/meta")),
        "the first file written",
        daemon=victim.daemon,
    )
    calls[0].cancel()
    assert_unharmed(victim, before)
    conn[0].close()


def test_the_daemon_still_takes_a_valid_push_afterwards(victim: Victim) -> None:
    reply = victim.stub.PushItem(iter([header(job=victim.job), *good_chunks()]), timeout=10)
    assert not reply.already_had
    assert reply.bytes_received == len(SMALL) + len(BIG)
    data = item_dir(victim.ckpt, victim.job, STEP) / "data"
    assert (data / "meta").read_bytes() == SMALL
    assert (data / "state" / "big.bin").read_bytes() == BIG
    again = victim.stub.PushItem(iter([header(job=victim.job), *good_chunks()]), timeout=10)
    assert again.already_had
