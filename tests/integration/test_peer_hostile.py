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

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    config_text,
    expected_markers,
    item_dir,
    make_step,
    marker_names,
    payload,
    ram_disk,
    read_text,
    running_daemon,
    sha256_tree,
    store_root,
    stored_steps,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
Code = grpc.StatusCode
STEP = 5
BIG = os.urandom(300 * 1024 + 7)
SMALL = b"hello"


NODES = 3
VICTIM = 1
"""The attacked daemon serves rank 1 of a 3-node job with one peer per node: rank 0 pushes
to it (every attack below names rank 0's items), rank 2 does not, rank 3 is no rank."""


@dataclass
class Victim:
    job: str
    ckpt: Path
    outside: Path
    """A directory outside CHECKPOINT_DIR that attacks try to reach."""
    daemon: DaemonProcess
    stub: peer_pb2_grpc.PeerStub
    others: dict[int, tuple[Path, DaemonProcess]]
    """The job's other ranks, real daemons: CHECKPOINT_DIR and daemon."""


def job_config(job: str, rank: int, nodes: int = NODES) -> str:
    return config_text(job, rank=rank, nodes=nodes, peers_per_node=1)


def wait_released(job: str, ckpt: Path, rank: int, step: int, daemon: DaemonProcess) -> None:
    """The rank's restore round released (its markers of ``step``), its agent in steady state."""
    want = expected_markers(job, step, rank=rank)
    wait_until(lambda: marker_names(ckpt) == want, f"rank {rank}'s markers {want}", daemon=daemon)
    state = store_root(ckpt) / "incarnation.json"
    wait_until(
        lambda: json.loads(read_text(state) or "{}").get("phase") == "steady",
        f"rank {rank}'s incarnation in steady state",
        daemon=daemon,
    )


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    root = tmp_path_factory.mktemp("hostile")
    job = f"hostile-{uuid.uuid4().hex[:6]}"
    outside = root / "outside"
    outside.mkdir()
    registry = root / "registry"
    registry.mkdir()
    with contextlib.ExitStack() as stack:
        ckpts = {r: stack.enter_context(ram_disk(root / f"ckpt{r}", "64m")) for r in range(NODES)}
        daemons = {
            r: stack.enter_context(running_daemon(d, extra=("--registry", registry.as_uri())))
            for r, d in ckpts.items()
        }
        for r in range(NODES):
            write_yaml_atomic(ckpts[r], job_config(job, r))
        # Nothing saved: an empty round. From here on the victim's tree changes only if an
        # attack gets in (its peers save nothing, so nothing is pushed to it).
        for r in range(NODES):
            wait_released(job, ckpts[r], r, 0, daemons[r])
        channel = stack.enter_context(grpc.insecure_channel(daemons[VICTIM].address))
        yield Victim(
            job,
            ckpts[VICTIM],
            outside,
            daemons[VICTIM],
            peer_pb2_grpc.PeerStub(channel),
            {r: (ckpts[r], daemons[r]) for r in range(NODES) if r != VICTIM},
        )


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
    data_streams: int = 0,
) -> pb.PushItemRequest:
    raw = canonical(body or content(job)) if raw is None else raw
    item = ref or {"job": job, "step": STEP, "rank": 0, "worker": 0}
    return pb.PushItemRequest(
        header=pb.PushHeader(
            item=pb.ItemRef(**item),
            manifest=raw,
            manifest_digest=hashlib.sha256(raw).hexdigest() if digest is None else digest,
            data_channel=data_channel,
            data_streams=data_streams,
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
    # Names the filesystem cannot take: once answered INTERNAL from deep in the writer.
    "name-over-NAME_MAX": (
        with_body(dirs=[], files=[["n" * 256, 5, f"{crc(SMALL):08x}"]]),
        Code.INVALID_ARGUMENT,
        "over 255 bytes",
    ),
    "path-over-PATH_MAX-in-bytes": (
        with_body(
            dirs=["/".join(["\u00e9" * 100] * n) for n in range(1, 21)],
            files=[["/".join(["\u00e9" * 100] * 21), 5, f"{crc(SMALL):08x}"]],
        ),
        Code.INVALID_ARGUMENT,
        "path length",
    ),
    "a-lone-surrogate-in-a-name": (
        with_body(dirs=[], files=[["x\ud800", 5, f"{crc(SMALL):08x}"]]),
        Code.INVALID_ARGUMENT,
        "not a file name",
    ),
    "deeper-than-the-limit": (
        with_body(
            dirs=["/".join(["d"] * n) for n in range(1, 65)],
            files=[["/".join(["d"] * 64 + ["f"]), 5, f"{crc(SMALL):08x}"]],
        ),
        Code.INVALID_ARGUMENT,
        "deeper than",
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
        for guess in (flip(token, 0), flip(token, len(token) - 1), b"\x00" * len(token)):
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


def test_a_pusher_gets_no_more_connections_than_the_receiver_allows(victim: Victim) -> None:
    """A push asking for a thousand data connections is offered the receiver's own bound
    (its ``--data-streams``), and never more than the item's files could fill (two here):
    a pusher cannot make a node hold more connections or threads than it allows."""
    before = snapshot(victim.ckpt)
    allowed = int(victim.daemon.log().rsplit("data-streams=", 1)[1].split()[0])
    gate = threading.Event()
    ref = {"job": victim.job, "step": DC_STEP, "rank": 0, "worker": 0}

    def requests() -> Iterator[pb.PushItemRequest]:
        body = content(victim.job, step=DC_STEP)
        yield header(body, job=victim.job, ref=ref, data_channel=True, data_streams=1000)
        gate.wait(20)

    call = victim.stub.PushItem.future(requests(), timeout=20)
    try:
        offer = dict(call.initial_metadata())["mtc-data-channel"]
    finally:
        gate.set()
        call.cancel()
    assert isinstance(offer, str)
    assert len(offer.split()) - 1 == min(allowed, 2), offer
    assert_unharmed(victim, before)


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


# --- who may push what: the layout, the step bound, committed copies ----------------------------


def item_push(
    job: str,
    *,
    rank: int = 0,
    step: int = STEP,
    worker: int = 0,
    big: bytes = BIG,
    data_channel: bool = False,
) -> list[pb.PushItemRequest]:
    """A well-formed push of one item (bytes ``SMALL`` and ``big``), whatever item it names."""
    files = [
        ["meta", len(SMALL), f"{crc(SMALL):08x}"],
        ["state/big.bin", len(big), f"{crc(big):08x}"],
    ]
    body = content(job, step=step, rank=rank, worker=worker, files=files)
    ref = {"job": job, "step": step, "rank": rank, "worker": worker}
    half = len(big) // 2
    chunks = [chunk(0, 0, SMALL), chunk(1, 0, big[:half]), chunk(1, half, big[half:])]
    return [header(body, job=job, ref=ref, data_channel=data_channel), *chunks]


FAR_FUTURE = 10**15

LAYOUT_ATTACKS: dict[str, tuple[dict[str, int], Code, str]] = {
    # A stray own item would pass for the trainer's save, and retention would then drop the
    # real ones in its favour.
    "the-receivers-own-rank": ({"rank": VICTIM}, Code.PERMISSION_DENIED, "own rank"),
    "a-rank-that-pushes-elsewhere": ({"rank": 2}, Code.PERMISSION_DENIED, "does not replicate"),
    "a-rank-past-the-job": ({"rank": NODES}, Code.INVALID_ARGUMENT, "is not in job"),
    "the-largest-rank": ({"rank": 2**32 - 1}, Code.INVALID_ARGUMENT, "is not in job"),
    "a-worker-without-an-item": ({"worker": 1}, Code.INVALID_ARGUMENT, "has no item"),
    "a-step-far-in-the-future": ({"step": FAR_FUTURE}, Code.FAILED_PRECONDITION, "steps ahead"),
}


@pytest.mark.parametrize("name", list(LAYOUT_ATTACKS))
def test_a_push_the_layout_does_not_send_here_is_refused(victim: Victim, name: str) -> None:
    which, code, detail = LAYOUT_ATTACKS[name]
    before = snapshot(victim.ckpt)
    with pytest.raises(grpc.RpcError) as refused:
        victim.stub.PushItem(iter(item_push(victim.job, **which)), timeout=10)
    assert refused.value.code() == code, refused.value.details()
    assert detail in refused.value.details()
    assert_unharmed(victim, before)


def test_a_refused_push_gets_no_data_channel_token(victim: Victim) -> None:
    """The refusal comes in the gRPC handler, before a token is issued for the data channel."""
    before = snapshot(victim.ckpt)
    gate = threading.Event()

    def requests() -> Iterator[pb.PushItemRequest]:
        yield item_push(victim.job, rank=VICTIM, data_channel=True)[0]
        gate.wait(20)

    call = victim.stub.PushItem.future(requests(), timeout=20)
    try:
        offered = dict(call.initial_metadata() or ())
        with pytest.raises(grpc.RpcError) as refused:
            call.result(timeout=5)
    finally:
        gate.set()
        call.cancel()
    assert "mtc-data-channel" not in offered
    assert refused.value.code() == Code.PERMISSION_DENIED, refused.value.details()
    assert_unharmed(victim, before)


def test_a_push_never_replaces_a_committed_copy(victim: Victim) -> None:
    """Same item, other bytes: ALREADY_EXISTS, not "held" (the pusher must not count the step
    as replicated here), and the committed copy stays byte for byte."""
    step = STEP + 2
    first = victim.stub.PushItem(iter(item_push(victim.job, step=step)), timeout=10)
    assert first.bytes_received == len(SMALL) + len(BIG)
    before = snapshot(victim.ckpt)
    with pytest.raises(grpc.RpcError) as refused:
        victim.stub.PushItem(iter(item_push(victim.job, step=step, big=flip(BIG, 7))), timeout=10)
    assert refused.value.code() == Code.ALREADY_EXISTS, refused.value.details()
    assert "never replaced" in refused.value.details()
    assert_unharmed(victim, before)
    data = item_dir(victim.ckpt, victim.job, step) / "data"
    assert (data / "state" / "big.bin").read_bytes() == BIG
    again = victim.stub.PushItem(iter(item_push(victim.job, step=step)), timeout=10)
    assert again.already_had


def test_a_far_future_push_never_costs_a_real_copy(victim: Victim) -> None:
    """Retention keeps each rank's newest copy: a copy of step 10**15, once taken, made it
    delete the rank's real copies. Refused now; after the victim's next save (its retention
    runs, then it replicates) the real copy is still there. Last in the module: the victim
    holds a step of its own from here on."""
    real = STEP + 3
    victim.stub.PushItem(iter(item_push(victim.job, step=real)), timeout=10)
    copy = item_dir(victim.ckpt, victim.job, real)
    kept = sha256_tree(copy)
    with pytest.raises(grpc.RpcError) as refused:
        victim.stub.PushItem(iter(item_push(victim.job, step=FAR_FUTURE)), timeout=10)
    assert refused.value.code() == Code.FAILED_PRECONDITION, refused.value.details()
    own = real + 1
    make_step(victim.ckpt, own, payload(own, seed="victim"))
    target_ckpt, target = victim.others[2]
    wait_until(
        lambda: own in stored_steps(target_ckpt, victim.job, rank=VICTIM),
        f"the victim's step {own} replicated to rank 2",
        daemon=target,
    )
    assert sha256_tree(copy) == kept
    assert not item_dir(victim.ckpt, victim.job, FAR_FUTURE).exists()


def test_copies_of_ranks_that_left_are_collected_after_the_next_round(tmp_path: Path) -> None:
    """A 3-node job shrinks to 2: rank 0 held rank 2's copy, which no round of the new job
    can use. It used to stay until the RAM disk was full; now it goes once the new job's
    restore round is released, and every item the new job restored from stays."""
    job = f"resize-{uuid.uuid4().hex[:6]}"
    registry = tmp_path / "registry"
    registry.mkdir()
    step = 10
    with contextlib.ExitStack() as stack:
        ckpts = [stack.enter_context(ram_disk(tmp_path / f"n{r}", "64m")) for r in range(NODES)]
        daemons = [
            stack.enter_context(running_daemon(d, extra=("--registry", registry.as_uri())))
            for d in ckpts
        ]
        for r in range(NODES):
            write_yaml_atomic(ckpts[r], job_config(job, r))
        for r in range(NODES):
            wait_released(job, ckpts[r], r, 0, daemons[r])
            os.unlink(ckpts[r] / expected_markers(job, 0, rank=r)[0])
            make_step(ckpts[r], step, payload(step, seed=f"rank{r}"))
        wait_until(
            lambda: step in stored_steps(ckpts[0], job, rank=2),
            "rank 2's copy at rank 0",
            daemon=daemons[0],
        )
        wait_until(
            lambda: step in stored_steps(ckpts[1], job, rank=0),
            "rank 0's copy at rank 1",
            daemon=daemons[1],
        )
        daemons[2].stop()  # rank 2's node leaves the job
        for r in range(2):
            write_yaml_atomic(ckpts[r], job_config(job, r, nodes=2))
        for r in range(2):
            wait_released(job, ckpts[r], r, step, daemons[r])
        wait_until(
            lambda: step not in stored_steps(ckpts[0], job, rank=2),
            "rank 0 collected its copy of rank 2, which left the job",
            daemon=daemons[0],
        )
        assert step in stored_steps(ckpts[0], job, rank=0)
        assert step in stored_steps(ckpts[1], job, rank=1)
        assert step in stored_steps(ckpts[1], job, rank=0)  # rank 0 still pushes to rank 1
