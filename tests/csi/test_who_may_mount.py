"""Who may mount, against the real plugin process and real mounts (root only).

The plugin serves only the namespaces and service accounts it is configured to allow,
refusing others with PERMISSION_DENIED before anything is created or mounted; the RAM disk
and CHECKPOINT_DIR belong to root and the configured group, closed to every other user.
Unprivileged processes (``setuid`` to a spare uid) prove who can write.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import pytest

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.mounter import SystemMounter
from mtc_replicator.csi.mountinfo import MountInfo, mount_at
from tests.csi.conftest import CsiClient, StartPlugin, publish_request, requires_root

pytestmark = requires_root

TIMEOUT = 10.0
Mode = pb.VolumeCapability.AccessMode
GROUP = 4242
"""The configured ``--fs-group``: the replicator's and the training pods' gid."""
MEMBER = (4243, GROUP)
"""A training pod's uid and gid: another uid, in the group (its fsGroup or runAsGroup)."""
STRANGER = (4244, 4244)
"""Another tenant's process on the node: neither the owner nor in the group."""
ALLOW = [
    "--allowed-namespaces",
    "ml-team, research",
    "--allowed-service-accounts",
    "shared/trainer",
]


def mounted(path: Path) -> MountInfo | None:
    return mount_at(SystemMounter().mounts(), str(path))


def request(
    target: Path, namespace: str | None, service_account: str = "default"
) -> pb.NodePublishVolumeRequest:
    """What kubelet sends for an inline ephemeral volume; ``namespace=None``: what it sends
    with podInfoOnMount off (no pod keys at all)."""
    return publish_request(
        target,
        volume_id="csi-v",
        namespace=namespace,
        uid=f"uid-{namespace}",
        service_account=service_account,
    )


def refused(client: CsiClient, req: pb.NodePublishVolumeRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        client.node.NodePublishVolume(req, timeout=TIMEOUT)
    return info.value


def unpublish(client: CsiClient, target: Path) -> None:
    client.node.NodeUnpublishVolume(
        pb.NodeUnpublishVolumeRequest(volume_id="csi-v", target_path=str(target)),
        timeout=TIMEOUT,
    )


def pod_target(sandbox: Path, name: str) -> Path:
    path = sandbox / "pods" / name / "kubernetes.io~csi" / "ckpt"
    path.mkdir(parents=True)
    return path / "mount"


def as_user(ids: tuple[int, int], cwd: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``sh -c script`` as uid/gid ``ids`` with no other groups, started in ``cwd`` (entered
    while still root: the sandbox's parents are closed to other users, the point is what
    ``cwd`` itself allows)."""
    uid, gid = ids
    return subprocess.run(
        ["/bin/sh", "-c", script],
        cwd=cwd,
        user=uid,
        group=gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def assert_untouched(target: Path) -> None:
    """Nothing created at the target, nothing mounted there."""
    assert mounted(target) is None
    assert not target.exists(), "the target was created for a refused pod"


def test_allowed_namespaces_and_service_accounts_publish_and_others_are_refused(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin(args=[*ALLOW, "--fs-group", str(GROUP)])
    client = connect(plugin.socket_path)
    assert "allowed=ml-team,research,shared/trainer" in plugin.log()
    assert "every namespace may mount" not in plugin.log()
    ram = plugin.ram_dir
    (ram / "checkpoint" / "7").mkdir()
    (ram / "checkpoint" / "7" / "state").write_bytes(b"weights")

    denied: Sequence[tuple[str, str]] = [("intruder", "default"), ("shared", "builder")]
    for namespace, account in denied:
        target = pod_target(sandbox, f"{namespace}-{account}")
        error = refused(client, request(target, namespace, account))
        assert error.code() is grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        details = error.details()  # type: ignore[attr-defined]
        assert f"namespace {namespace!r}" in details
        assert f"service account {namespace}/{account}" in details
        assert "spec.allowedNamespaces" in details
        assert "ml-team" not in details, "a refused tenant never learns who is allowed"
        assert_untouched(target)
        assert not (ram / "owner.json").exists(), "a refused pod never becomes the owner"
        assert f"refused publish for pod {namespace}/trainer-0" in plugin.log()
    assert (ram / "checkpoint" / "7" / "state").read_bytes() == b"weights"

    # A listed service account is enough, in a namespace that is not listed.
    shared = pod_target(sandbox, "shared-trainer")
    client.node.NodePublishVolume(request(shared, "shared", "trainer"), timeout=TIMEOUT)
    assert mounted(shared) is not None
    assert json.loads((ram / "owner.json").read_text())["namespace"] == "shared"
    unpublish(client, shared)

    # A listed namespace, with any service account.
    team = pod_target(sandbox, "ml-team")
    client.node.NodePublishVolume(request(team, "ml-team", "anything"), timeout=TIMEOUT)
    assert mounted(team) is not None
    (team / "replicator.yaml").write_text("job-name: a\n")
    assert (ram / "checkpoint" / "replicator.yaml").read_text() == "job-name: a\n"


def test_no_pod_info_is_refused_when_an_allow_list_is_set(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin(args=ALLOW)
    target = pod_target(sandbox, "anonymous")
    error = refused(connect(plugin.socket_path), request(target, None))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "podInfoOnMount: true" in error.details()  # type: ignore[attr-defined]
    assert_untouched(target)


def test_an_unconfigured_plugin_serves_everyone_and_says_so(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    assert "WARNING" in plugin.log()
    assert "every namespace may mount the node's checkpoints" in plugin.log()
    assert "allowed=any" in plugin.log()
    target = pod_target(sandbox, "anyone")
    connect(plugin.socket_path).node.NodePublishVolume(request(target, "anyone"), timeout=TIMEOUT)
    assert mounted(target) is not None


def test_the_ram_disk_and_the_volume_are_the_groups_alone(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin(args=[*ALLOW, "--fs-group", str(GROUP)])
    ram, checkpoint = plugin.ram_dir, plugin.ram_dir / "checkpoint"
    target = pod_target(sandbox, "ml-team")
    connect(plugin.socket_path).node.NodePublishVolume(request(target, "ml-team"), timeout=TIMEOUT)
    for path, mode in ((ram, 0o1770), (checkpoint, 0o2770), (target, 0o2770)):
        info = path.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (mode, 0, GROUP), path

    # A pod in the group writes, and what it makes stays in the group (setgid).
    wrote = as_user(MEMBER, target, "mkdir 8 && echo w > 8/state && ls")
    assert wrote.returncode == 0, wrote.stderr
    made = checkpoint / "8" / "state"
    assert made.read_text() == "w\n"
    assert (checkpoint / "8").stat().st_gid == made.stat().st_gid == GROUP
    # The daemon, in the group too, creates its store beside CHECKPOINT_DIR.
    store = as_user(MEMBER, ram, "mkdir store-test && ls")
    assert store.returncode == 0, store.stderr

    # Anyone else can neither write, nor list, nor read the owner record.
    for cwd, script in (
        (target, "echo x > planted"),
        (target, "ls"),
        (target, "cat 8/state"),
        (ram, "cat owner.json"),
        (ram, "mkdir store-2"),
    ):
        denied = as_user(STRANGER, cwd, script)
        assert denied.returncode != 0, (cwd, script, denied.stdout)
        assert "Permission denied" in denied.stderr, denied.stderr
    assert not (checkpoint / "planted").exists()
    assert not (ram / "store-2").exists()


def test_an_older_world_writable_ram_disk_is_closed_at_start(
    sandbox: Path, start_plugin: StartPlugin
) -> None:
    """What an older plugin left (a 0777 tmpfs and CHECKPOINT_DIR) gets the new modes and
    group at start, its checkpoints kept."""
    ram = sandbox / "ram"
    ram.mkdir()
    SystemMounter().mount_tmpfs(ram, 64 * 2**20, 0o777)
    (ram / "checkpoint").mkdir()
    os.chmod(ram / "checkpoint", 0o777)  # noqa: S103 (what the older plugin did)
    (ram / "checkpoint" / "5").mkdir()
    (ram / "checkpoint" / "5" / "state").write_bytes(b"kept")

    plugin = start_plugin(args=["--fs-group", str(GROUP)])
    assert "RAM disk reused" in plugin.log()
    for path, mode in ((ram, 0o1770), (ram / "checkpoint", 0o2770)):
        info = path.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (mode, 0, GROUP), path
    assert (ram / "checkpoint" / "5" / "state").read_bytes() == b"kept"
    assert as_user(STRANGER, ram / "checkpoint", "ls").returncode != 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allowed-namespaces", "Team_A"], "not a namespace name"),
        (["--allowed-service-accounts", "trainer"], "must be NAMESPACE/NAME"),
        (["--fs-group", "staff"], "numeric group id"),
        (["--fs-group", "-1"], "numeric group id"),
    ],
)
def test_bad_flags_are_usage_errors(
    sandbox: Path, start_plugin: StartPlugin, args: list[str], message: str
) -> None:
    plugin = start_plugin(wait=False, args=args)
    assert plugin.run_to_exit() == 2
    assert message in plugin.log()
    assert "Traceback" not in plugin.log()
