"""Who sees what on a node, against the real plugin process and real mounts (root only).

A pod's volume is the RAM disk's CHECKPOINT_DIR subdirectory, never the RAM disk itself (the
daemon's store and ``owner.json`` live beside it). One namespace owns that directory at a time:
another namespace's publish waits while a target is published, and once the directory is free
it is emptied before the new owner's pod sees it. Every test plants data the attacker must
not reach or destroy and checks it afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.mounter import SystemMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at
from mtc_replicator.csi.plugin import EXIT_STARTUP_FAILED
from tests.csi.conftest import CsiClient, StartPlugin, publish_request, requires_root

pytestmark = requires_root

TIMEOUT = 10.0
Mode = pb.VolumeCapability.AccessMode
OWNER_KEYS = {"namespace", "pod", "pod_uid", "service_account", "published_at"}


def mounted(path: Path) -> MountInfo | None:
    return mount_at(SystemMounter().mounts(), str(path))


def publish(client: CsiClient, target: Path, namespace: str, pod: str = "trainer-0") -> None:
    """What kubelet sends for an inline ephemeral volume with podInfoOnMount: true."""
    client.node.NodePublishVolume(
        publish_request(
            target,
            volume_id=f"csi-{pod}",
            pod=pod,
            namespace=namespace,
            uid=f"uid-{namespace}-{pod}",
            service_account=f"{namespace}-sa",
        ),
        timeout=TIMEOUT,
    )


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def unpublish(client: CsiClient, target: Path) -> None:
    client.node.NodeUnpublishVolume(
        pb.NodeUnpublishVolumeRequest(volume_id="csi-x", target_path=str(target)), timeout=TIMEOUT
    )


def pod_target(sandbox: Path, name: str) -> Path:
    """Kubelet's volume directory for a pod; the plugin makes ``mount`` inside it."""
    path = sandbox / "pods" / name / "kubernetes.io~csi" / "ckpt"
    path.mkdir(parents=True)
    return path / "mount"


def plant_store(ram: Path) -> Path:
    """A committed item in the daemon's store, beside CHECKPOINT_DIR (the daemon's layout)."""
    item = ram / "store" / "items" / "job-a" / "100" / "0-0"
    item.mkdir(parents=True)
    (item / "data").write_bytes(b"committed")
    return item / "data"


def owner(ram: Path) -> dict[str, object]:
    loaded = json.loads((ram / "owner.json").read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_a_pod_sees_checkpoint_dir_only(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    ram = plugin.ram_dir
    committed = plant_store(ram)
    target = pod_target(sandbox, "a0")
    publish(connect(plugin.socket_path), target, "team-a")

    bind = mounted(target)
    assert bind is not None
    assert bind.root == "/checkpoint", "the pod's volume is CHECKPOINT_DIR, not the RAM disk"
    assert sorted(os.listdir(target)) == []
    (target / "replicator.yaml").write_text("job-name: a\n")
    assert (ram / "checkpoint" / "replicator.yaml").read_text() == "job-name: a\n"
    for hidden in ("store", "owner.json", "checkpoint"):
        assert not (target / hidden).exists(), f"{hidden} is visible to the pod"
    assert committed.read_bytes() == b"committed"
    mode = stat.S_IMODE((ram / "checkpoint").lstat().st_mode)
    assert mode == 0o2770
    assert (ram / "checkpoint").lstat().st_uid == os.geteuid()


def test_another_namespace_waits_and_then_sees_an_empty_dir(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    ram, client = plugin.ram_dir, connect(plugin.socket_path)
    committed = plant_store(ram)
    outside = sandbox / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the pod's")

    first = pod_target(sandbox, "a0")
    publish(client, first, "team-a")
    (first / "7").mkdir()
    (first / "7" / "state").write_bytes(b"a's weights")
    (first / "jax-init-info.txt").write_text("0\n10.0.0.1:1234\n")
    (first / ".mtc" / "views").mkdir(parents=True)
    (first / ".mtc" / "views" / "x").write_text("a view")
    (first / "escape").symlink_to(outside)

    second = pod_target(sandbox, "b0")
    error = refused(lambda: publish(client, second, "team-b"))
    assert error.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert "another namespace" in error.details()  # type: ignore[attr-defined]
    assert "team-a" not in error.details(), "one tenant never learns another's name"  # type: ignore[attr-defined]
    assert mounted(second) is None
    assert (first / "7" / "state").read_bytes() == b"a's weights"
    assert owner(ram)["namespace"] == "team-a"

    unpublish(client, first)
    publish(client, second, "team-b")
    assert sorted(os.listdir(second)) == [], "the new owner sees nothing of the old one"
    assert owner(ram)["namespace"] == "team-b"
    assert committed.read_bytes() == b"committed", "the store is not the pod's to clear"
    assert (outside / "keep").read_text() == "not the pod's", "symlinks are removed, not followed"
    assert stat.S_IMODE((ram / "checkpoint").lstat().st_mode) == 0o2770


def test_the_same_namespace_keeps_its_files_across_a_plugin_restart(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    first_plugin = start_plugin()
    ram = first_plugin.ram_dir
    target = pod_target(sandbox, "a0")
    client = connect(first_plugin.socket_path)
    publish(client, target, "team-a", pod="trainer-0")
    (target / "5").mkdir()
    (target / "5" / "state").write_bytes(b"step 5")
    (target / "jax-init-info.txt").write_text("0\n10.0.0.1:1234\n")
    unpublish(client, target)

    first_plugin.kill()
    plugin = start_plugin()
    client = connect(plugin.socket_path)
    again = pod_target(sandbox, "a1")
    publish(client, again, "team-a", pod="trainer-1")
    assert (again / "5" / "state").read_bytes() == b"step 5"
    # Another pod: the previous pod's rank is not its own (test_rank_files.py).
    assert not (again / "jax-init-info.txt").exists()
    assert owner(ram)["pod"] == "trainer-1"

    # The restarted plugin knows the published target from the mount table, the owner from
    # owner.json: another namespace still waits.
    other = pod_target(sandbox, "b0")
    error = refused(lambda: publish(client, other, "team-b"))
    assert error.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert (again / "5" / "state").read_bytes() == b"step 5"


def test_owner_json_records_the_publishing_pod(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    ram = plugin.ram_dir
    before = time.time()
    target = pod_target(sandbox, "a0")
    publish(connect(plugin.socket_path), target, "team-a", pod="trainer-3")
    record = owner(ram)
    assert set(record) == OWNER_KEYS
    assert record["namespace"] == "team-a"
    assert record["pod"] == "trainer-3"
    assert record["pod_uid"] == "uid-team-a-trainer-3"
    assert record["service_account"] == "team-a-sa"
    published_at = record["published_at"]
    assert isinstance(published_at, float | int)
    assert before - 1 <= published_at <= time.time() + 1
    info = (ram / "owner.json").lstat()
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o644
    assert not (target / "owner.json").exists()
    assert [p.name for p in ram.iterdir() if p.name.startswith(".owner")] == [], "no temp left"


def test_a_symlinked_checkpoint_dir_is_refused(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    ram = plugin.ram_dir
    secret = sandbox / "secret"
    secret.mkdir()
    (secret / "key").write_text("host secret")
    shutil.rmtree(ram / "checkpoint", ignore_errors=True)
    (ram / "checkpoint").symlink_to(secret)

    target = pod_target(sandbox, "a0")
    error = refused(lambda: publish(connect(plugin.socket_path), target, "team-a"))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "symlink" in error.details()  # type: ignore[attr-defined]
    assert mounted(target) is None
    assert (secret / "key").read_text() == "host secret"

    # A plugin that starts with the symlink in place refuses to start.
    plugin.stop()
    assert start_plugin(wait=False).run_to_exit() == EXIT_STARTUP_FAILED
    assert (secret / "key").read_text() == "host secret"
