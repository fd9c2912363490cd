"""A training pod attacks its daemon through the files it shares with it (issue 16).

The pod sees CHECKPOINT_DIR and nothing else of the node; these tests do what such a pod
can: read and plant files under ``.mtc/``, keep a descriptor of its step directory after
handing it over, and replace the contract's files with symlinks and FIFOs. Every attack
must fail with a clear error, and the committed items of the job the daemon serves must
come through it untouched (their digests listed and their bytes pulled over gRPC).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import grpc
import pytest

from mtc_replicator._pb.mtc.v1 import peer_pb2 as pb
from mtc_replicator._pb.mtc.v1 import peer_pb2_grpc
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.transport import datachannel
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAILED,
    config_text,
    make_step,
    payload,
    read_text,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

pytestmark = pytest.mark.integration
STEP = 3
SECRET = b"the daemon's secret, outside CHECKPOINT_DIR"


@contextlib.contextmanager
def peer_stub(daemon: DaemonProcess) -> Iterator[peer_pb2_grpc.PeerStub]:
    with grpc.insecure_channel(daemon.address) as channel:
        yield peer_pb2_grpc.PeerStub(channel)


def committed(stub: peer_pb2_grpc.PeerStub, job: str) -> dict[int, str]:
    """Step -> manifest digest of rank 0's committed items, as the daemon lists them."""
    listed = stub.ListItems(pb.ListItemsRequest(job=job), timeout=10).items
    return {i.item.step: i.manifest_digest for i in listed if i.item.rank == 0}


def pull(stub: peer_pb2_grpc.PeerStub, job: str, step: int) -> dict[str, bytes]:
    """An item's files as PullItem serves them in gRPC chunks, by path."""
    ref = pb.ItemRef(job=job, step=step, rank=0, worker=0)
    responses = iter(stub.PullItem(pb.PullItemRequest(item=ref), timeout=10))
    files = json.loads(next(responses).header.manifest)["files"]
    out = {path: bytearray(size) for path, size, *_ in files}
    for r in responses:
        path = files[r.chunk.file_index][0]
        out[path][r.chunk.offset : r.chunk.offset + len(r.chunk.data)] = r.chunk.data
    return {k: bytes(v) for k, v in out.items()}


def pull_over_channel(stub: peer_pb2_grpc.PeerStub, address: str, job: str, step: int) -> bytes:
    """Every byte the data channel sends for an item (whatever the verdict after)."""
    ref = pb.ItemRef(job=job, step=step, rank=0, worker=0)
    call = stub.PullItem(pb.PullItemRequest(item=ref, data_channel=True), timeout=10)
    header = next(iter(call)).header
    conn = datachannel.connect(address, header.data_port, header.data_token, 5.0)
    got = bytearray()
    with contextlib.closing(conn), contextlib.suppress(OSError):
        while chunk := conn.recv(1 << 16):
            got += chunk
    with contextlib.suppress(grpc.RpcError):
        list(call)
    return bytes(got)


def start_job(ckpt: Path, job: str, daemon: DaemonProcess) -> dict[str, bytes]:
    """A job with step STEP committed; the step's files."""
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    files = payload(STEP, seed=job)
    make_step(ckpt, STEP, files)
    with peer_stub(daemon) as stub:
        wait_until(lambda: STEP in committed(stub, job), f"step {STEP} committed", daemon=daemon)
    return files


def assert_untouched(
    daemon: DaemonProcess, job: str, files: Mapping[str, bytes], digests: Mapping[int, str]
) -> None:
    """The job's committed items are listed as before and serve the bytes it saved."""
    with peer_stub(daemon) as stub:
        assert committed(stub, job) == digests
        assert pull(stub, job, STEP) == files


def every_path(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [Path(dirpath) / n for n in dirnames + filenames]
    return out


# --- the store is not in the pod's volume ------------------------------------------------------


def test_the_store_is_not_reachable_from_checkpoint_dir(ckpt: Path, job: str, start_daemon) -> None:
    daemon = start_daemon()
    files = start_job(ckpt, job, daemon)
    with peer_stub(daemon) as stub:
        digests = committed(stub, job)
    # A later job on the node: the pod of that job must not see the first job's items.
    other = f"{job}-next"
    write_yaml_atomic(ckpt, config_text(other))
    wait_markers(ckpt, other, 0, daemon)
    seen = every_path(ckpt)
    assert not [p for p in seen if p.name == "MANIFEST.json"], seen
    assert not [p for p in seen if job in p.relative_to(ckpt).parts and other not in str(p)]
    saved = set(files.values()) - {b""}
    leaked = [p for p in seen if p.is_file() and not p.is_symlink() and p.read_bytes() in saved]
    assert leaked == []
    assert_untouched(daemon, job, files, digests)


def _plant_item(root: Path, job: str, step: int, files: Mapping[str, bytes]) -> None:
    """An item in the old in-CHECKPOINT_DIR layout, with a manifest that matches it."""
    item_dir = root / "items" / job / str(step) / "0-0"
    for rel, data in files.items():
        (item_dir / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
        (item_dir / "data" / rel).write_bytes(data)
    manifest = build_manifest(ItemId(job, step, 0, 0), item_dir / "data")
    (item_dir / "MANIFEST.json").write_bytes(manifest.to_json())


def test_items_planted_under_checkpoint_dir_are_never_committed(
    ckpt: Path, job: str, start_daemon
) -> None:
    victim = f"{job}-victim"
    forged = payload(7, seed="forged")
    # Before the daemon starts (an old daemon's layout, or a pod's work) ...
    _plant_item(ckpt / ".mtc", victim, 7, forged)
    daemon = start_daemon()
    files = start_job(ckpt, job, daemon)
    with peer_stub(daemon) as stub:
        digests = committed(stub, job)
    # ... and while it runs: data "taken but not yet hashed" for the victim's next run.
    planted = ckpt / ".mtc" / "ingest" / victim / "9" / "0-0" / "data"
    for rel, data in payload(9, seed="forged").items():
        (planted / rel).parent.mkdir(parents=True, exist_ok=True)
        (planted / rel).write_bytes(data)
    write_yaml_atomic(ckpt, config_text(victim))
    # The victim's job starts fresh: nothing it did not save is restored or kept.
    wait_markers(ckpt, victim, 0, daemon)
    with peer_stub(daemon) as stub:
        time.sleep(1.0)  # a few rescans: a planted ingest would be committed by now
        assert committed(stub, victim) == {}
    daemon.stop()
    daemon = start_daemon()
    with peer_stub(daemon) as stub:
        assert committed(stub, victim) == {}
    assert_untouched(daemon, job, files, digests)


def test_a_symlink_swapped_into_a_committed_item_is_not_followed(
    ckpt: Path, job: str, tmp_path: Path, start_daemon
) -> None:
    daemon = start_daemon()
    files = start_job(ckpt, job, daemon)
    # The pod keeps a descriptor of its next step's directory while handing it over ...
    step = STEP + 1
    mine = payload(step, seed=job)
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-x"
    for rel, data in mine.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rename(tmp, ckpt / str(step))
        with peer_stub(daemon) as stub:
            wait_until(lambda: step in committed(stub, job), f"step {step}", daemon=daemon)
            digests = committed(stub, job)
        # ... and, once it is committed, swaps a directory inside it for a symlink to files
        # of the daemon's that have the same names and sizes.
        outside = tmp_path / "outside"
        outside.mkdir()
        for rel, data in mine.items():
            if rel.startswith("state/"):
                secret = (SECRET * (len(data) // len(SECRET) + 1))[: len(data)]
                (outside / rel.removeprefix("state/")).write_bytes(secret)
        os.rename("state", "state.old", src_dir_fd=held, dst_dir_fd=held)
        os.symlink(outside, "state", dir_fd=held)
    finally:
        os.close(held)
    with peer_stub(daemon) as stub:
        served = b""
        with contextlib.suppress(grpc.RpcError):
            served = b"".join(pull(stub, job, step).values())
        assert SECRET[:16] not in served
        assert SECRET[:16] not in pull_over_channel(stub, daemon.address, job, step)
    assert_untouched(daemon, job, files, digests)


# --- the contract's files ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_the_errors_file_is_never_followed(
    ckpt: Path, job: str, tmp_path: Path, start_daemon, kind: str
) -> None:
    daemon = start_daemon()
    files = start_job(ckpt, job, daemon)
    with peer_stub(daemon) as stub:
        digests = committed(stub, job)
    victim = tmp_path / "victim.txt"
    victim.write_text("the daemon's file\n")
    if kind == "symlink":
        (ckpt / ERRORS).symlink_to(victim)
    else:
        os.mkfifo(ckpt / ERRORS)
    # A step the daemon must refuse (it holds a symlink): an error line is due.
    bad = ckpt / f"{STEP + 1}.orbax-checkpoint-tmp-x"
    bad.mkdir()
    (bad / "link").symlink_to("/etc/hostname")
    os.rename(bad, ckpt / str(STEP + 1))
    wait_until(lambda: "cannot keep" in daemon.log(), "the refused step", daemon=daemon)
    wait_until(
        lambda: (ckpt / ERRORS).is_file() and not (ckpt / ERRORS).is_symlink(),
        f"{ERRORS} a regular file again",
        daemon=daemon,
    )
    assert "cannot keep" in read_text(ckpt / ERRORS)
    assert victim.read_text() == "the daemon's file\n"
    assert_untouched(daemon, job, files, digests)


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_handshake_that_is_not_a_regular_file_is_refused(
    ckpt: Path, job: str, tmp_path: Path, start_daemon, kind: str
) -> None:
    daemon = start_daemon()
    files = start_job(ckpt, job, daemon)
    with peer_stub(daemon) as stub:
        digests = committed(stub, job)
    other = f"{job}-other"
    if kind == "symlink":
        target = tmp_path / "outside.yaml"
        target.write_text(config_text(other))
        (ckpt / CONFIG).symlink_to(target)
    else:
        os.mkfifo(ckpt / CONFIG)
    failed = ckpt / FAILED
    wait_until(failed.exists, FAILED, daemon=daemon)
    text = read_text(failed)
    assert "not a regular file" in text, text
    assert ("symlink" if kind == "symlink" else "FIFO") in text, text
    assert not os.path.lexists(ckpt / CONFIG)
    assert not [p for p in ckpt.iterdir() if p.name.startswith(other)]
    if kind == "symlink":
        assert target.read_text() == config_text(other)
    assert_untouched(daemon, job, files, digests)
    # A FIFO planted again must not hold the daemon up: SIGTERM is answered at once.
    os.mkfifo(ckpt / CONFIG)
    time.sleep(0.5)
    t0 = time.monotonic()
    assert daemon.stop(timeout=10) == 0
    assert time.monotonic() - t0 < 8


def test_sigterm_is_answered_while_a_fifo_handshake_waits(
    ckpt: Path, job: str, start_daemon
) -> None:
    daemon = start_daemon()
    os.mkfifo(ckpt / CONFIG)
    time.sleep(1.0)  # the daemon has looked at it by now
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    t0 = time.monotonic()
    assert daemon.proc.wait(10) == 0  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 8


# --- where the store may be --------------------------------------------------------------------


def test_a_store_inside_checkpoint_dir_stops_the_daemon(ckpt: Path) -> None:
    daemon = DaemonProcess(ckpt, extra_args=("--store-dir", str(ckpt / "store")))
    with pytest.raises(RuntimeError, match="exited with 2"):
        daemon.start()
    assert "inside CHECKPOINT_DIR" in daemon.log()
    assert not (ckpt / "store").exists()


def test_the_store_dir_comes_from_the_flag_or_the_environment(ckpt: Path, job: str) -> None:
    store = ckpt.parent / "store"
    with DaemonProcess(ckpt, env={"MTC_STORE_DIR": str(store)}) as daemon:
        assert f"store-dir={store} " in daemon.log()
        files = start_job(ckpt, job, daemon)
        assert (
            store / "items" / job / str(STEP) / "0-0" / "data" / "_CHECKPOINT_METADATA"
        ).is_file()
        with peer_stub(daemon) as stub:
            assert pull(stub, job, STEP) == files
