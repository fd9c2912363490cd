"""``node.checkpoint_dir``: the markers a restore publishes, the handshake's clean-up of
what earlier incarnations published (never data), and links to items being deleted."""

from __future__ import annotations

import os
from pathlib import Path

from mtc_replicator.cluster.rounds import RoundOutcome
from mtc_replicator.core.contract import (
    ERRORS_FILE,
    PRERESTORE_FILE,
    BackupInterval,
    Framework,
    JobConfig,
    marker_name,
)
from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.local.store import LocalStore
from mtc_replicator.node.checkpoint_dir import (
    cleanup_workload_files,
    list_top,
    publish_markers,
    unlink_links_to,
)

CONFIG = JobConfig(
    job_name="job",
    framework=Framework.ORBAX,
    node_rank=1,
    nodes=2,
    peers_per_node=1,
    backup_interval=BackupInterval(minutes=None, steps=10),
    workers_per_node=2,
)
ITEM = ItemId("job", 20, 1, 0)


def store_with_item(
    tmp_path: Path, item: ItemId = ITEM, files: tuple[str, ...] = ("shard",)
) -> tuple[Path, LocalStore]:
    """CHECKPOINT_DIR and its store, holding ``item`` of ``files`` (100 bytes each)."""
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    store = LocalStore(ckpt)
    store.open()
    data = tmp_path / "data"
    for name in files:
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(b"x" * 100)
    manifest = build_manifest(item, data)
    staged = store.new_staging()
    os.rename(data, staged / "data")
    store.commit_staged(staged, manifest)
    return ckpt, store


def outcome(step: int | None) -> RoundOutcome:
    return RoundOutcome(step, None if step is None else "peer", {}, {}, "127.0.0.1:1")


def test_a_fresh_start_publishes_empty_markers(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    publish_markers(ckpt, store, CONFIG, "inc", outcome(None))
    assert (ckpt / PRERESTORE_FILE).read_text() == "{}\n"
    for w in range(2):
        marker = ckpt / marker_name("job", 0, 1, w)
        assert marker.is_file()
        assert not marker.is_symlink()
        assert marker.stat().st_size == 0


def test_a_restored_step_links_every_worker_to_a_view_of_its_item(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    publish_markers(ckpt, store, CONFIG, "inc", outcome(20))
    assert (ckpt / PRERESTORE_FILE).read_text() == "restore-step: 20\nrestore-source: peer\n"
    for w in range(2):  # a step directory: both workers' markers name the node's item
        marker = ckpt / marker_name("job", 20, 1, w)
        assert marker.is_symlink()
        assert (marker / "shard").read_bytes() == b"x" * 100
        assert store.item_of_link(os.readlink(marker)) == ITEM


def test_cleanup_removes_what_we_published_never_data(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    publish_markers(ckpt, store, CONFIG, "inc", outcome(20))
    (ckpt / ERRORS_FILE).write_text("old\n")
    (ckpt / "20").mkdir()  # the workload's own step directory
    # What our client leaves when killed mid-save goes; other clients' temps stay.
    (ckpt / "step=21-unfinished").mkdir()
    (ckpt / "step=21-unfinished" / "state.pt").write_bytes(b"half")
    (ckpt / "job-s21-n1-w0.save.tmp").write_bytes(b"half")
    (ckpt / "step=21").mkdir()
    (ckpt / "21.orbax-checkpoint-tmp-9").mkdir()
    outside = tmp_path / "outside"  # a pod's link with our temp's name is not followed
    outside.mkdir()
    (outside / "keep").write_bytes(b"x")
    os.symlink(outside, ckpt / "step=22-unfinished")
    removed = cleanup_workload_files(ckpt, store)
    assert sorted(removed) == sorted(
        [
            *(
                PRERESTORE_FILE,
                ERRORS_FILE,
                marker_name("job", 20, 1, 0),
                marker_name("job", 20, 1, 1),
            ),
            *("step=21-unfinished", "job-s21-n1-w0.save.tmp"),
        ]
    )
    assert sorted(e.name for e in list_top(ckpt)) == [
        "20",
        "21.orbax-checkpoint-tmp-9",
        "step=21",
        "step=22-unfinished",
    ]
    assert (outside / "keep").read_bytes() == b"x"
    assert store.get(ITEM) is not None


def test_links_to_deleted_items_go(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    publish_markers(ckpt, store, CONFIG, "inc", outcome(20))
    os.symlink(os.readlink(ckpt / marker_name("job", 20, 1, 0)), ckpt / "20")
    unlink_links_to(ckpt, store, {ItemId("job", 30, 1, 0)})
    assert (ckpt / "20").is_symlink()
    unlink_links_to(ckpt, store, {ITEM})
    assert not (ckpt / "20").exists()
    assert not (ckpt / marker_name("job", 20, 1, 0)).exists()


def test_a_job_directorys_markers_climb_to_the_views_and_its_links_are_known(
    tmp_path: Path,
) -> None:
    """A job directory (``jobs/<job>/``, issue 36), reached as the daemon reaches it, by a
    descriptor's path: its markers link through ``../..``, which resolves as the pod sees
    the tree; its clean-up and retention recognise those links, and only those."""
    ckpt, store = store_with_item(tmp_path)
    real = ckpt / "jobs" / "job"
    real.mkdir(parents=True)
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        here = Path(f"/proc/self/fd/{fd}")
        publish_markers(here, store, CONFIG, "inc1", RoundOutcome(20, "local", {}, {}, "c:1"))
        marker = real / marker_name("job", 20, 1, 0)
        assert os.readlink(marker).startswith("../../.mtc/views/inc1/")
        assert (marker / "shard").read_bytes() == b"x" * 100  # resolves from the real tree
        (real / "20").symlink_to(os.readlink(marker))  # Orbax's <N> link of the marker
        (real / "elsewhere").symlink_to("../.mtc/views/inc1")  # not from here: not ours
        unlink_links_to(here, store, {ITEM})
        assert sorted(p.name for p in real.iterdir()) == ["elsewhere", PRERESTORE_FILE]
        publish_markers(here, store, CONFIG, "inc1", RoundOutcome(20, "local", {}, {}, "c:1"))
        removed = cleanup_workload_files(here, store)
        assert marker_name("job", 20, 1, 0) in removed
        assert "elsewhere" not in removed
    finally:
        os.close(fd)


def test_a_new_incarnation_keeps_the_views_other_directories_run_on(tmp_path: Path) -> None:
    ckpt, store = store_with_item(tmp_path)
    publish_markers(ckpt, store, CONFIG, "theirs", RoundOutcome(20, "local", {}, {}, "c:1"))
    publish_markers(ckpt, store, CONFIG, "old", RoundOutcome(20, "local", {}, {}, "c:1"))
    cleanup_workload_files(ckpt, store, keep_views={"theirs"})
    assert sorted(os.listdir(ckpt / ".mtc" / "views")) == ["theirs"]
    cleanup_workload_files(ckpt, store)
    assert os.listdir(ckpt / ".mtc" / "views") == []
