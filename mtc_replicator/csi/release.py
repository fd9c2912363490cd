"""Freeing the node's RAM disk when its CheckpointConfiguration is deleted.

A plugin that stops keeps the RAM disk mounted: the next plugin (a restart, an upgrade)
reuses it with its checkpoints. Only on an uninstall should the tmpfs go, and its memory
with it. The controller says which: before it deletes the DaemonSet, it sets
``RELEASE_ANNOTATION: "true"`` on the pods, which kubelet writes into the plugin's
downward-API file (``--release-file``). At SIGTERM the plugin reads that file and, when the
annotation is there and no pod volume still shows the RAM disk, unmounts it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtc_replicator.csi.errors import MountError
from mtc_replicator.csi.mounter import Mounter
from mtc_replicator.csi.mountinfo import mount_at
from mtc_replicator.csi.volumes import MAX_STACKED_MOUNTS, published_targets

log = logging.getLogger(__name__)

RELEASE_ANNOTATION = "checkpointing.mtc.dev/release-ram-disk"


def release_requested(path: Path | None) -> bool:
    """Whether the pod's annotations (a downward-API file of ``key="value"`` lines) ask for
    the RAM disk to be freed; False when there is no such file."""
    if path is None:
        return False
    try:
        text = path.read_text()
    except OSError:
        return False
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == RELEASE_ANNOTATION and value.strip() == '"true"':
            return True
    return False


def release_ram_disk(mounter: Mounter, ram_dir: Path) -> bool:
    """Unmount the RAM disk at ``ram_dir``, unless a pod volume still shows it (a training
    pod still running: its checkpoints stay until it ends and the node reboots, or by hand).
    True when it was unmounted."""
    mounts = mounter.mounts()
    ram = mount_at(mounts, str(ram_dir))
    if ram is None or ram.fs_type != "tmpfs":
        return False
    held = published_targets(mounts, ram_dir)
    if held:
        log.warning(
            "keeping the RAM disk %s although its configuration was deleted: %d pod "
            "volume(s) still show it (%s); free it by hand once they end",
            ram_dir,
            len(held),
            ", ".join(m.mount_point for m in held[:3]),
        )
        return False
    try:
        for _ in range(MAX_STACKED_MOUNTS):
            if mount_at(mounter.mounts(), str(ram_dir)) is None:
                break
            mounter.unmount(ram_dir)
    except MountError as exc:
        log.error("could not free the RAM disk %s: %s", ram_dir, exc)
        return False
    log.info("freed the RAM disk %s: its configuration was deleted", ram_dir)
    return True
