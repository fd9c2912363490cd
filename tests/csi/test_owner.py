"""Who owns CHECKPOINT_DIR: the pure decision and record, then ``NodeVolumes`` acting on them
over ``MemoryMounter`` and real files (no root). The real-mount versions are in
``test_tenancy.py``."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mtc_replicator.csi.checkpoint import CheckpointDir, check_subdir_name
from mtc_replicator.csi.errors import CheckpointDirError, OwnerBusy
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.owner import (
    OWNER_KEYS,
    OwnerDecision,
    PodInfo,
    decide_owner,
    owner_record,
    recorded_namespace,
)
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.validation import Publish, Unpublish
from mtc_replicator.csi.volumes import NodeVolumes

A0 = PodInfo("team-a", "trainer-0", "uid-a0", "sa-a")
A1 = PodInfo("team-a", "trainer-1", "uid-a1", "sa-a")
B0 = PodInfo("team-b", "trainer-0", "uid-b0", "sa-b")


# --- pure ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recorded", "requested", "published", "decision"),
    [
        ("team-a", "team-a", 0, OwnerDecision.KEEP),
        ("team-a", "team-a", 3, OwnerDecision.KEEP),
        ("team-a", "team-b", 1, OwnerDecision.WAIT),
        ("team-a", "team-b", 0, OwnerDecision.TAKE_OVER),
        (None, "team-a", 0, OwnerDecision.TAKE_OVER),  # unknown: anyone's files may be there
        (None, "team-a", 1, OwnerDecision.WAIT),  # an older plugin's bind: owner unknown
    ],
)
def test_decide_owner(
    recorded: str | None, requested: str, published: int, decision: OwnerDecision
) -> None:
    assert decide_owner(recorded, requested, published) is decision


def test_the_owner_record_has_exactly_the_keys_the_daemon_reads() -> None:
    data = owner_record(A0, 1700000000.5)
    assert json.loads(data) == {
        "namespace": "team-a",
        "pod": "trainer-0",
        "pod_uid": "uid-a0",
        "service_account": "sa-a",
        "published_at": 1700000000.5,
    }
    assert tuple(json.loads(data)) == OWNER_KEYS
    assert recorded_namespace(data) == "team-a"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff",
        b"[]",
        b'"team-a"',
        b'{"namespace": "team-a"}',
        b'{"namespace": 1, "pod": "", "pod_uid": "", "service_account": "", "published_at": 0}',
        b'{"namespace": "", "pod": "", "pod_uid": "", "service_account": "", "published_at": 0}',
    ],
)
def test_anything_else_names_no_owner(data: bytes) -> None:
    assert recorded_namespace(data) is None


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "owner.json", "a\0"])
def test_the_subdir_is_one_plain_name(name: str) -> None:
    with pytest.raises(ValueError, match="one plain name"):
        check_subdir_name(name)


# --- NodeVolumes ---------------------------------------------------------------------------


@pytest.fixture
def ram(tmp_path: Path, mounter: MemoryMounter) -> Path:
    path = tmp_path / "ram"
    ensure_ram_disk(mounter, path, 2**20)
    CheckpointDir(path).prepare()
    return path


@pytest.fixture
def volumes(mounter: MemoryMounter, ram: Path) -> NodeVolumes:
    return NodeVolumes(mounter, ram, clock=lambda: 1234.5)


def publish(volumes: NodeVolumes, target: Path, pod: PodInfo) -> bool:
    return volumes.publish(Publish("v", target, readonly=False, pod=pod))


def owner(ram: Path) -> dict[str, object]:
    loaded = json.loads((ram / "owner.json").read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_another_namespace_waits_then_finds_the_directory_empty(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, tmp_path: Path
) -> None:
    checkpoint = ram / "checkpoint"
    publish(volumes, tmp_path / "a0", A0)
    (checkpoint / "3").mkdir()
    (checkpoint / "3" / "state").write_text("a")
    (checkpoint / "jax-init-info.txt").write_text("0\n10.0.0.1:1\n")
    (checkpoint / "link").symlink_to(tmp_path)
    (ram / "store").mkdir()
    (ram / "store" / "item").write_text("committed")

    with pytest.raises(OwnerBusy, match="another namespace"):
        publish(volumes, tmp_path / "b0", B0)
    assert mount_at(mounter.mounts(), str(tmp_path / "b0")) is None
    assert (checkpoint / "3" / "state").read_text() == "a"
    assert owner(ram)["namespace"] == "team-a"

    volumes.unpublish(Unpublish("v", tmp_path / "a0"))
    assert publish(volumes, tmp_path / "b0", B0) is True
    assert os.listdir(checkpoint) == []
    assert (ram / "store" / "item").read_text() == "committed"
    assert tmp_path.is_dir()
    assert owner(ram) == {
        "namespace": "team-b",
        "pod": "trainer-0",
        "pod_uid": "uid-b0",
        "service_account": "sa-b",
        "published_at": 1234.5,
    }
    assert stat.S_IMODE((ram / "owner.json").stat().st_mode) == 0o644


def test_the_same_namespace_keeps_its_files(
    volumes: NodeVolumes, ram: Path, tmp_path: Path
) -> None:
    publish(volumes, tmp_path / "a0", A0)
    (ram / "checkpoint" / "7").mkdir()
    volumes.unpublish(Unpublish("v", tmp_path / "a0"))
    publish(volumes, tmp_path / "a1", A1)
    publish(volumes, tmp_path / "a0", A0)  # two pods of one namespace at once
    assert (ram / "checkpoint" / "7").is_dir()
    assert owner(ram)["pod"] == "trainer-0"


def test_files_of_an_unknown_owner_are_cleared(
    volumes: NodeVolumes, ram: Path, tmp_path: Path
) -> None:
    (ram / "checkpoint" / "planted").write_text("who knows")
    (ram / "owner.json").symlink_to(tmp_path / "elsewhere.json")  # not ours: ignored
    (tmp_path / "elsewhere.json").write_bytes(owner_record(A0, 1.0))
    publish(volumes, tmp_path / "a0", A0)
    assert os.listdir(ram / "checkpoint") == []
    assert not (ram / "owner.json").is_symlink()
    assert (tmp_path / "elsewhere.json").read_bytes() == owner_record(A0, 1.0)


def test_an_older_plugins_bind_of_the_whole_ram_disk_makes_everyone_wait(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, tmp_path: Path
) -> None:
    (tmp_path / "legacy").mkdir()
    mounter.bind(ram, tmp_path / "legacy")
    with pytest.raises(OwnerBusy):
        publish(volumes, tmp_path / "a0", A0)
    mounter.unmount(tmp_path / "legacy")
    assert publish(volumes, tmp_path / "a0", A0) is True


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_checkpoint_dir_that_is_not_a_directory_is_refused(
    volumes: NodeVolumes, mounter: MemoryMounter, ram: Path, tmp_path: Path, kind: str
) -> None:
    (ram / "checkpoint").rmdir()
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("x")
    if kind == "symlink":
        (ram / "checkpoint").symlink_to(secret)
    else:
        (ram / "checkpoint").write_text("")
    with pytest.raises(CheckpointDirError, match="symlink" if kind == "symlink" else "cannot"):
        publish(volumes, tmp_path / "a0", A0)
    assert mount_at(mounter.mounts(), str(tmp_path / "a0")) is None
    assert not (tmp_path / "a0").exists()
    assert (secret / "key").read_text() == "x"


def test_a_missing_checkpoint_dir_is_made_again(
    volumes: NodeVolumes, ram: Path, tmp_path: Path
) -> None:
    (ram / "checkpoint").rmdir()
    publish(volumes, tmp_path / "a0", A0)
    info = (ram / "checkpoint").lstat()
    assert stat.S_ISDIR(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o2770


def test_the_ram_disk_root_is_sticky(ram: Path) -> None:
    assert stat.S_IMODE(ram.stat().st_mode) == 0o1770
