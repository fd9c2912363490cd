"""What the daemon reads and writes in the workload's CHECKPOINT_DIR. I/O: that directory.

The top-level listing a rescan decides from (``core.policy``), the handshake's removal of
what earlier incarnations published, the restore's markers, and the workload's links to
items retention deletes. Never the workload's data: the store owns what it took.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Collection
from pathlib import Path

from mtc_replicator.cluster.rounds import RoundOutcome
from mtc_replicator.core.contract import (
    ERRORS_FILE,
    FAILED_FILE,
    KEEP_FILE,
    MAX_KEPT_STEPS,
    PRERESTORE_FILE,
    RESULT_FILE,
    JobConfig,
    is_client_temp_name,
    marker_name,
    parse_marker_name,
)
from mtc_replicator.core.manifest import ItemId, ItemKind
from mtc_replicator.core.policy import Entry, marker_item
from mtc_replicator.core.rank_file import RANK_FILE
from mtc_replicator.local import fsutil
from mtc_replicator.local.store import LocalStore, view_path

_RESULT_TMP = RESULT_FILE + ".tmp"
_JOB_DIR_UP = "../.."
"""From a job directory (``CHECKPOINT_DIR/jobs/<job>/``) up to CHECKPOINT_DIR, where the
views are: a marker there links through it, as the pod sees the tree."""


def _up(checkpoint_dir: Path, store: LocalStore) -> str:
    """ "" in CHECKPOINT_DIR's root; the way up from a job directory (the daemon reaches one
    through a descriptor's path, so the depth is the protocol's, not a path's)."""
    return "" if checkpoint_dir == store.checkpoint_dir else _JOB_DIR_UP


def _rooted(target: str, up: str) -> str:
    """A link target read in a directory ``up`` below CHECKPOINT_DIR, as from the root ("":
    one that does not climb exactly there, never ours)."""
    if not up:
        return target
    return target[len(up) + 1 :] if target.startswith(up + "/") else ""


def list_top(checkpoint_dir: Path) -> list[Entry]:
    """``lstat`` every top-level name (hidden ones excluded)."""
    entries = []
    with os.scandir(checkpoint_dir) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            entries.append(
                Entry(
                    e.name,
                    e.is_dir(follow_symlinks=False),
                    e.is_file(follow_symlinks=False),
                    st.st_mtime,
                )
            )
    return entries


def kept_steps(checkpoint_dir: Path) -> set[int]:
    """The steps ``replicator.keep`` asks to keep: read through no symlink, at most
    ``MAX_KEPT_STEPS`` decimal lines of a small file; anything else keeps nothing."""
    try:
        fd = os.open(checkpoint_dir / KEEP_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return set()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return set()
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    lines = raw.decode("ascii", "replace").split()
    if len(lines) > MAX_KEPT_STEPS or not all(line.isdecimal() for line in lines):
        return set()
    return {int(line) for line in lines if len(line) <= 18}


_OWN_FILES = frozenset({ERRORS_FILE, PRERESTORE_FILE, FAILED_FILE, RANK_FILE})


def is_own_output(name: str) -> bool:
    """Files only the daemon writes: its reports, its markers, a pod's assigned rank
    (``node.rank_files``) and their temp files. Their events never wake it."""
    return name in _OWN_FILES or name.endswith(".restore") or name.startswith(fsutil.TMP_PREFIX)


def cleanup_workload_files(
    checkpoint_dir: Path, store: LocalStore, keep_views: Collection[str] = ()
) -> list[str]:
    """Handshake step 3: remove stale files we published, and the temps our client leaves
    when it is killed mid-save; never data, never jax-init-info.txt nor mtc-rank.json
    (the pod's assigned rank: a handshake comes after it was read). ``keep_views``: the
    incarnations other job directories run, whose views stay."""
    removed = []
    up = _up(checkpoint_dir, store)
    with os.scandir(checkpoint_dir) as it:
        for e in it:
            path = Path(e.path)
            is_dir = e.is_dir(follow_symlinks=False)
            if (is_dir or e.is_file(follow_symlinks=False)) and is_client_temp_name(
                e.name, is_dir=is_dir
            ):
                # No save runs now: the job waits for this handshake before it saves.
                if is_dir:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(e.name)
                continue
            stale = (
                e.name in (PRERESTORE_FILE, ERRORS_FILE, FAILED_FILE, RESULT_FILE, _RESULT_TMP)
                or e.name.endswith(".restore")
                or e.name.startswith(fsutil.TMP_PREFIX)
            )
            if not stale and e.is_symlink():
                # `<N>` / `step=<N>` links that clients made of our markers.
                stale = store.owns_link_target(_rooted(_readlink(e.path), up))
            if stale and not e.is_dir(follow_symlinks=False):
                path.unlink(missing_ok=True)
                removed.append(e.name)
            elif is_dir and e.name.endswith(".restore"):
                # A marker's name is the daemon's alone (contract step 7): a directory a
                # pod left there would be a second marker, or block this one's creation.
                fsutil.discard_tree(path, store.trash)
                removed.append(e.name)
    # No link into a view is left, so the previous incarnations' views are garbage.
    store.drop_views(keep=keep_views)
    return removed


def publish_markers(
    checkpoint_dir: Path,
    store: LocalStore,
    config: JobConfig,
    incarnation_id: str,
    outcome: RoundOutcome,
    *,
    again: bool = False,
) -> None:
    """Handshake steps 6-7: ``replicator.prerestore`` first, then one marker per worker,
    linked to a view (for ``incarnation_id``) of the item holding its data here: its own,
    or a data-parallel equivalent (``outcome.stored_as``). ``again``: the same restore for
    one more process (``core.repeats``), through the view already published when it is
    intact, so that a process still reading it never sees it rebuilt."""
    step, source = outcome.step, outcome.source
    d = checkpoint_dir
    up = _up(checkpoint_dir, store)
    body = "{}\n" if step is None else f"restore-step: {step}\nrestore-source: {source}\n"
    fsutil.atomic_write_bytes(d / PRERESTORE_FILE, body.encode())
    # One view per item: the workers of a step directory share it, and rebuilding it for
    # the next worker would pull it from under a process already loading through its marker.
    targets: dict[ItemId, str] = {}
    for w in range(config.workers_per_node):
        name = d / marker_name(config.job_name, step or 0, config.node_rank, w)
        try:
            name.unlink(missing_ok=True)
        except IsADirectoryError:
            fsutil.discard_tree(name, store.trash)  # a pod's directory under our name
        if step is None:
            # An empty regular file is complete the moment it exists.
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        else:
            wanted = marker_item(config, step, w)
            held = outcome.stored_as.get(wanted, wanted)
            target = targets.get(held)
            if target is None:
                view = _intact_view(store, held, incarnation_id) if again else None
                target = targets[held] = view or store.expose(held, incarnation_id)
            os.symlink(f"{up}/{target}" if up else target, name)


def markers_out(checkpoint_dir: Path, config: JobConfig) -> bool:
    """Whether a restore marker of this job's rank is still there (not taken yet)."""
    with os.scandir(checkpoint_dir) as it:
        for e in it:
            parts = parse_marker_name(e.name)
            if parts and (parts.job, parts.rank) == (config.job_name, config.node_rank):
                return True
    return False


def _intact_view(store: LocalStore, item: ItemId, view: str) -> str | None:
    """The view of ``item`` published for ``view``, when every file of the item is in it as
    a hard link of the store's own (nothing was deleted or replaced through a marker); its
    path for a marker, else None. Only ``lstat``: a pod's symlink there is never read."""
    manifest = store.get(item)
    if manifest is None:
        return None
    rel = view_path(view, item)
    names = [""] if manifest.kind is ItemKind.FILE else [f.path for f in manifest.files]
    try:
        for name in names:
            root = store.checkpoint_dir
            got = os.lstat(root / rel / name if name else root / rel)
            own = os.lstat(store.data_path(item) / name if name else store.data_path(item))
            if not stat.S_ISREG(got.st_mode) or (got.st_ino, got.st_dev) != (
                own.st_ino,
                own.st_dev,
            ):
                return None
    except OSError:
        return None
    return str(rel)


def unlink_links_to(checkpoint_dir: Path, store: LocalStore, items: Collection[ItemId]) -> None:
    """Remove the workload's links (`<N>`, markers) to ``items``, which are being deleted:
    they would dangle."""
    up = _up(checkpoint_dir, store)
    for e in os.scandir(checkpoint_dir):
        if e.is_symlink() and store.item_of_link(_rooted(_readlink(e.path), up)) in items:
            Path(e.path).unlink(missing_ok=True)


def _readlink(path: str) -> str:
    """A listed link's target; "" when the pod removed or replaced it since the listing
    (Orbax deletes its old ``<N>`` links as the daemon's retention runs): never ours."""
    try:
        return os.readlink(path)
    except OSError:
        return ""
