"""The ``replicator.yaml`` handshake against a real daemon: fresh start, invalid configs,
non-atomic writers and the empty "stop this job" file."""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc_replicator.core.backup_layout import item_prefix
from mtc_replicator.core.manifest import ItemId
from tests.daemon_process import DaemonProcess
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    CONFIG,
    ERRORS,
    FAILED,
    FAST_ARGS,
    PRERESTORE,
    backup_commits,
    config_text,
    holds,
    item_dir,
    make_step,
    marker_names,
    payload,
    read_prerestore,
    read_tree,
    stored_steps,
    top_level_step_dirs,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
    write_yaml_in_place,
)

pytestmark = pytest.mark.integration


def test_fresh_start_then_saves_are_taken_and_committed(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    (ckpt / "jax-init-info.txt").write_text("0\n10.0.0.1:1234\n")
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(
        ckpt, config_text(job, workers_per_node=2, peer_ranks="[]", backup_interval_steps=1)
    )

    # Order of the handshake as a client polling the directory sees it: the yaml goes
    # first, the prerestore file comes next, and only then the markers, all of them.
    def markers_published() -> bool:
        names = set(os.listdir(ckpt))
        found = sorted(n for n in names if n.endswith(".restore"))
        if found:
            assert CONFIG not in names, f"markers {found} appeared before the yaml was deleted"
            assert PRERESTORE in names, f"markers {found} appeared before {PRERESTORE}"
        return len(found) == 2

    wait_until(markers_published, "both markers", daemon=daemon, interval=0.001)
    markers = wait_markers(ckpt, job, 0, daemon, workers=2)
    for m in markers:
        st = os.lstat(m)
        assert stat.S_ISREG(st.st_mode), f"{m.name} must be a regular file, not a link"
        assert st.st_size == 0
    assert read_prerestore(ckpt) == {}
    assert not (ckpt / CONFIG).exists(), "the yaml is the client's cue and must be deleted"
    assert not (ckpt / FAILED).exists()
    assert (ckpt / "jax-init-info.txt").read_text() == "0\n10.0.0.1:1234\n"

    first, second = payload(1, seed=job), payload(2, seed=job)
    make_step(ckpt, 1, first)
    data = wait_ingested(ckpt, job, 1, daemon)
    assert read_tree(data) == first
    assert (data.parent / "MANIFEST.json").is_file()
    wait_until(
        lambda: 1 in backup_commits(backup_dir, job), "backup COMMIT of step 1", daemon=daemon
    )

    make_step(ckpt, 2, second)
    data = wait_ingested(ckpt, job, 2, daemon)
    assert read_tree(data) == second
    wait_until(
        lambda: 2 in backup_commits(backup_dir, job), "backup COMMIT of step 2", daemon=daemon
    )
    # Local retention keeps the newest complete step only; the backup keeps both.
    wait_until(lambda: stored_steps(ckpt, job) == {2}, "step 1 dropped locally", daemon=daemon)
    assert backup_commits(backup_dir, job) == {1, 2}
    assert read_tree(backup_dir / item_prefix(ItemId(job, 1, 0, 0))) == first
    assert top_level_step_dirs(ckpt) == set()


# --- invalid configs ---------------------------------------------------------------------------

INVALID = {
    "bad-job-name": ({"job-name": "../escape"}, "job-name"),
    "unknown-framework": ({"framework": "tensorflow"}, "framework"),
    "rank-not-below-nodes": ({"node-rank": 2, "nodes": 2}, "node-rank"),
    "zero-nodes": ({"nodes": 0}, "nodes"),
    "peer-is-self": ({"nodes": 2, "peer-ranks": "[0]"}, "peer-ranks"),
    "duplicate-peers": ({"nodes": 3, "peer-ranks": "[1, 1]"}, "peer-ranks"),
    "both-intervals": (
        {"backup-interval-minutes": 5, "backup-interval-steps": 10},
        "backup-interval",
    ),
    "zero-interval": ({"backup-interval-minutes": 0}, "backup-interval-minutes"),
    "dp-not-dividing-nodes": (
        {"nodes": 3, "assume-data-parallelism": 2},
        "assume-data-parallelism",
    ),
    "zero-workers": ({"workers-per-node": 0}, "workers-per-node"),
}


def _yaml_with(job: str, overrides: dict[str, object]) -> str:
    keys: dict[str, object] = {"job-name": job, "framework": "orbax", "node-rank": 0, "nodes": 1}
    keys.update(overrides)
    return "".join(f"{k}: {v}\n" for k, v in keys.items())


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_config_fails_without_touching_data(
    ckpt: Path, job: str, start_daemon: StartDaemon, case: str
) -> None:
    overrides, key = INVALID[case]
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 7, payload(7, seed=job))
    data = wait_ingested(ckpt, job, 7, daemon)
    before = read_tree(data.parent)

    write_yaml_atomic(ckpt, _yaml_with(job, overrides))
    wait_until((ckpt / FAILED).exists, f"{FAILED} written", daemon=daemon)
    text = (ckpt / FAILED).read_text()
    assert f"'{key}" in text, f"{FAILED} must name the key {key!r}: {text!r}"
    assert "invalid" in text
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the invalid yaml deleted", daemon=daemon)
    assert read_tree(data.parent) == before, "committed data changed after an invalid yaml"

    # The next valid handshake works, and its clean-up removes the old failure.
    write_yaml_atomic(ckpt, config_text(job))
    (marker,) = wait_markers(ckpt, job, 7, daemon)
    assert not (ckpt / FAILED).exists()
    assert read_tree(marker) == payload(7, seed=job)
    assert read_tree(item_dir(ckpt, job, 7)) == before


# --- non-atomic writers ------------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["half", "mid-job-name"])
def test_partial_yaml_written_in_place_is_read_complete(
    ckpt: Path, job: str, start_daemon: StartDaemon, cut: str
) -> None:
    daemon = start_daemon()
    text = config_text(job, workers_per_node=1)
    if cut == "half":
        split = len(text) // 2
        assert "nodes:" not in text[:split], "the half must lack a required key"
    else:
        # The nastiest cut: the half parses as a complete config, for a truncated job name.
        text = f"framework: orbax\nnode-rank: 0\nnodes: 1\njob-name: {job}\n"
        split = text.index(job) + 3
    write_yaml_in_place(ckpt, text, split=split, pause=0.3)

    wait_markers(ckpt, job, 0, daemon)
    assert marker_names(ckpt) == [f"{job}-s0-n0-w0.restore"]
    assert not (ckpt / CONFIG).exists()
    assert not (ckpt / FAILED).exists()
    assert read_prerestore(ckpt) == {}


def test_empty_yaml_that_stays_empty_stops_the_job(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()  # --config-wait-seconds 1.5
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 1, payload(1, seed=job))
    wait_ingested(ckpt, job, 1, daemon)

    written = time.monotonic()
    (ckpt / CONFIG).write_bytes(b"")
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the empty yaml deleted", daemon=daemon)
    assert time.monotonic() - written >= 1.5 - 0.1, "deleted before --config-wait-seconds"
    assert not (ckpt / FAILED).exists(), "an empty yaml is a stop request, not an error"
    wait_until(lambda: "stopping incarnation" in daemon.log(), "the incarnation stopped")

    # Stopped: a new step is no longer taken, and the committed one is kept.
    make_step(ckpt, 2, payload(2, seed=job))
    holds(lambda: 2 in top_level_step_dirs(ckpt), "step 2 left alone", 1.5, daemon=daemon)
    assert stored_steps(ckpt, job) == {1}
    assert not (ckpt / FAILED).exists()
    assert daemon.running

    # A later handshake takes the waiting (finished) step first, then restores it.
    write_yaml_atomic(ckpt, config_text(job))
    (marker,) = wait_markers(ckpt, job, 2, daemon)
    assert read_prerestore(ckpt)["restore-step"] == 2
    assert read_tree(marker) == payload(2, seed=job)
    assert top_level_step_dirs(ckpt) == set()


# --- the first MaxText multi-tier generation: no framework key --------------------------------

MAXTEXT_FIRST = (
    "job-name: {job}\nnode-rank: 0\nnodes: 1\nworkers-per-node: 1\npeer-ranks: []\n"
    "backup-interval-minutes: 30"
)


def test_maxtext_first_generation_yaml_works_as_orbax(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    """Byte for byte what that release writes: no framework, a flow list, no trailing
    newline, renamed into place. It restores, and its steps are taken and backed up."""
    daemon = start_daemon(backup=backup_dir)
    write_yaml_atomic(ckpt, MAXTEXT_FIRST.format(job=job))
    wait_markers(ckpt, job, 0, daemon)
    assert not (ckpt / FAILED).exists()
    errors = (ckpt / ERRORS).read_text()
    assert "no 'framework' key: assuming 'orbax'" in errors, errors
    assert "assuming 'orbax'" in daemon.log()

    make_step(ckpt, 1, payload(1, seed=job))
    wait_ingested(ckpt, job, 1, daemon)
    # The first complete step is backed up at once (then every 30 minutes).
    wait_until(lambda: backup_commits(backup_dir, job) == {1}, "step 1 backed up", daemon=daemon)
    assert read_tree(item_dir(ckpt, job, 1) / "data") == payload(1, seed=job)


def test_a_settled_yaml_missing_a_key_fails_at_once(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon()  # --config-wait-seconds 1.5: the old verdict came after that
    text = MAXTEXT_FIRST.format(job=job).replace("nodes: 1\n", "")
    written = time.monotonic()
    write_yaml_atomic(ckpt, text)
    wait_until((ckpt / FAILED).exists, f"{FAILED} written", daemon=daemon, interval=0.01)
    assert time.monotonic() - written < 1.0, "a renamed-in file was waited on as if partial"
    failed = (ckpt / FAILED).read_text()
    assert "'nodes'" in failed, failed
    assert "required key is missing" in failed, failed
    wait_until(lambda: not (ckpt / CONFIG).exists(), "the yaml deleted", daemon=daemon)


def test_an_open_in_place_writer_still_gets_its_patience(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """The PyTorch reference writes in place: a part lacking a key, left open for longer
    than any settle time, is not judged until the writer is done."""
    daemon = start_daemon()
    text = config_text(job)
    split = text.index("nodes:")
    write_yaml_in_place(ckpt, text, split=split, pause=1.0)
    wait_markers(ckpt, job, 0, daemon)
    assert not (ckpt / FAILED).exists()


# --- $VAR expansion: an allow-list, never the daemon's secrets ---------------------------------


def test_var_expansion_never_reads_the_daemons_secrets(ckpt: Path, job: str) -> None:
    """The daemon's environment holds its credentials; a pod's ``replicator.yaml`` naming them
    gets nothing: unexpanded, refused, and ``replicator.failed`` quotes what was written."""
    # AWS's documented example keys; the first is a valid job name, so expanded it would be
    # taken: markers named after it, or the key in replicator.failed.
    env = {
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY",
        "AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE",
    }
    with running_daemon_env(ckpt, env) as daemon:
        for text in (
            config_text("$AWS_SECRET_ACCESS_KEY"),
            config_text("${AWS_ACCESS_KEY_ID}"),
        ):
            write_yaml_atomic(ckpt, text)
            wait_until((ckpt / FAILED).exists, f"{FAILED} written", daemon=daemon)
            failed = (ckpt / FAILED).read_text()
            assert "'job-name'" in failed, failed
            assert "AWS_" in failed, failed  # the name as written
            for value in env.values():
                assert value not in failed
                assert value not in daemon.log()
                assert not any(value in p.name for p in ckpt.iterdir())
            (ckpt / FAILED).unlink()


def test_a_cluster_job_without_a_registry_fails_in_one_line(
    ckpt: Path, job: str, start_daemon: StartDaemon
) -> None:
    """A daemon with neither --backup nor --registry cannot find a coordinator: the job is
    told at once, and the log says why in one line, not a traceback."""
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job, nodes=2))
    wait_until((ckpt / FAILED).exists, f"{FAILED} written", daemon=daemon)
    assert "needs the daemon's --registry (or --backup)" in (ckpt / FAILED).read_text()
    wait_until(lambda: "incarnation failed" in daemon.log(), "the error", daemon=daemon)
    assert "Traceback" not in daemon.log()


def test_an_allowed_variable_expands(ckpt: Path, job: str) -> None:
    with running_daemon_env(ckpt, {"NODE_NAME": "node-7"}) as daemon:
        write_yaml_atomic(
            ckpt, config_text(job).replace(f"job-name: {job}", f"job-name: {job}-$NODE_NAME")
        )
        wait_markers(ckpt, f"{job}-node-7", 0, daemon)


@contextlib.contextmanager
def running_daemon_env(ckpt: Path, env: dict[str, str]) -> Iterator[DaemonProcess]:
    daemon = DaemonProcess(ckpt, extra_args=FAST_ARGS, env=env)
    try:
        yield daemon.start()
    finally:
        if daemon.running:
            daemon.stop(timeout=10)
