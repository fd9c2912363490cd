"""The RAM disk freed when its configuration is deleted (the pod's annotation says so), kept
on every other stop and while a pod volume still shows it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.plugin import PluginOptions, parse_args, run
from mtc_replicator.csi.ramdisk import ensure_ram_disk
from mtc_replicator.csi.release import RELEASE_ANNOTATION, release_ram_disk, release_requested
from mtc_replicator.csi.volumes import NodeVolumes

TIMEOUT = 30


def _annotations(tmp_path: Path, value: str) -> Path:
    # As kubelet writes metadata.annotations into a downward-API file.
    path = tmp_path / "podinfo" / "annotations"
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        f'kubectl.kubernetes.io/default-container="replicator"\n{RELEASE_ANNOTATION}="{value}"\n'
    )
    return path


def test_release_is_requested_only_by_the_annotation_set_to_true(tmp_path: Path) -> None:
    assert release_requested(_annotations(tmp_path, "true"))
    assert not release_requested(_annotations(tmp_path, "false"))
    assert not release_requested(tmp_path / "missing")
    assert not release_requested(None)


def test_a_released_ram_disk_is_unmounted_unless_a_pod_volume_shows_it(tmp_path: Path) -> None:
    mounter = MemoryMounter()
    ram = tmp_path / "ram"
    ensure_ram_disk(mounter, ram, 2**20)
    volumes = NodeVolumes(mounter, ram)
    volumes.checkpoint.prepare()
    target = tmp_path / "pod" / "mount"
    target.parent.mkdir()
    target.mkdir()
    mounter.bind(volumes.checkpoint.path, target)  # a training pod still running
    assert release_ram_disk(mounter, ram) is False
    assert mount_at(mounter.mounts(), str(ram)) is not None
    mounter.unmount(target)  # the pod ended
    assert release_ram_disk(mounter, ram) is True
    assert mount_at(mounter.mounts(), str(ram)) is None
    assert release_ram_disk(mounter, ram) is False  # nothing left to free


@pytest.mark.parametrize(("value", "kept"), [("true", False), ("false", True)])
def test_the_plugin_frees_it_at_sigterm_only_when_told(
    tmp_path: Path, value: str, kept: bool
) -> None:
    socket_path = tmp_path / "plugin" / "csi.sock"
    socket_path.parent.mkdir()
    opts = PluginOptions(
        socket_path, "node-a", tmp_path / "ram", 2**20, release_file=_annotations(tmp_path, value)
    )
    mounter, stop = MemoryMounter(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, opts, mounter, stop)
        for _ in range(300):
            if socket_path.exists():
                break
            threading.Event().wait(0.05)
        stop.set()
        assert running.result(TIMEOUT) == 0
    assert (mount_at(mounter.mounts(), str(tmp_path / "ram")) is not None) is kept


def test_the_release_file_comes_from_the_environment() -> None:
    env = {
        "MTC_CSI_ENDPOINT": "unix:///csi/csi.sock",
        "MTC_CSI_NODE_ID": "node-a",
        "MTC_RAM_DIR": "/var/lib/mtc/ramdisk",
        "MTC_RAM_SIZE": "1Gi",
    }
    assert parse_args([], env).release_file is None
    opts = parse_args([], {**env, "MTC_CSI_RELEASE_FILE": "/etc/mtc/podinfo/annotations"})
    assert opts.release_file == Path("/etc/mtc/podinfo/annotations")
