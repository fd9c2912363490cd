"""A rank assigned to one pod is never read by the next (docs/protocol.md, "Assigned
ranks"): the CSI plugin removes ``jax-init-info.txt`` and ``mtc-rank.json`` when it publishes
CHECKPOINT_DIR for a pod they were not written for, before that pod's containers start.
Against the real plugin process and real mounts (root), the pure rule beside it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mtc_replicator.csi.owner import rank_file_pod, rank_files_stale
from tests.csi.conftest import CsiClient, StartPlugin, requires_root
from tests.csi.test_tenancy import pod_target, publish, unpublish

JAX = "jax-init-info.txt"
RANK = "mtc-rank.json"


def uid(pod: str) -> str:
    """The uid ``test_tenancy.publish`` gives a pod of team-a."""
    return f"uid-team-a-{pod}"


def assign(directory: Path, pod: str, rank: int) -> None:
    """What the node's replicator writes for ``pod`` (``node.rank_files``)."""
    (directory / JAX).write_text(f"{rank}\n10.0.0.5:8476\n")
    record = {
        "job": "train",
        "rank": rank,
        "nodes": 4,
        "coordinator": "10.0.0.5:8476",
        "pod_uid": uid(pod),
        "assignment": "a1",
        "source": "holdings",
    }
    (directory / RANK).write_text(json.dumps(record))


@requires_root
def test_a_new_pod_of_the_same_namespace_never_sees_the_previous_pods_rank(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    plugin = start_plugin()
    client, ckpt = connect(plugin.socket_path), plugin.ram_dir / "checkpoint"
    first = pod_target(sandbox, "t0")
    publish(client, first, "team-a", pod="trainer-0")
    assign(first, "trainer-0", 3)
    (first / "7").mkdir()  # the job's data stays: same namespace

    # kubelet publishes again for the same pod (a retry, the plugin restarted): kept.
    unpublish(client, first)
    publish(client, first, "team-a", pod="trainer-0")
    assert (ckpt / JAX).read_text() == "3\n10.0.0.5:8476\n"
    assert json.loads((ckpt / RANK).read_text())["rank"] == 3

    # The job restarts: a new pod (new uid) lands on this node.
    unpublish(client, first)
    second = pod_target(sandbox, "t1")
    publish(client, second, "team-a", pod="trainer-1")
    assert not (second / JAX).exists()
    assert not (second / RANK).exists()
    assert (second / "7").is_dir()


@requires_root
def test_a_jax_init_info_without_a_rank_file_goes_with_the_pod_that_had_the_directory(
    sandbox: Path, start_plugin: StartPlugin, connect: Callable[[Path], CsiClient]
) -> None:
    """A pod that wrote ``jax-init-info.txt`` itself (the shell line of old docs): the next
    pod must not start from it either; the same pod published again keeps it."""
    plugin = start_plugin()
    client = connect(plugin.socket_path)
    target = pod_target(sandbox, "t0")
    publish(client, target, "team-a", pod="trainer-0")
    (target / JAX).write_text("1\n10.0.0.9:8476\n")
    unpublish(client, target)
    publish(client, target, "team-a", pod="trainer-0")
    assert (target / JAX).read_text() == "1\n10.0.0.9:8476\n"
    unpublish(client, target)
    publish(client, target, "team-a", pod="trainer-2")
    assert not (target / JAX).exists()


@pytest.mark.parametrize(
    ("rank_file", "owner", "publishing", "stale"),
    [
        ("p1", "p1", "p1", False),
        ("p1", "p2", "p1", False),  # the rank file names the pod: it wins
        ("p1", "p1", "p2", True),
        (None, "p1", "p1", False),  # no rank file: the pod that had the directory
        (None, "p1", "p2", True),
        (None, None, "p2", True),  # nobody known: a file of nobody we know goes
    ],
)
def test_the_rule(rank_file: str | None, owner: str | None, publishing: str, stale: bool) -> None:
    assert rank_files_stale(rank_file, owner, publishing) is stale


@pytest.mark.parametrize(
    ("data", "uid_"),
    [(b'{"pod_uid": "u1"}', "u1"), (b"{}", None), (b"[1]", None), (b"garbage", None)],
)
def test_rank_file_pod(data: bytes, uid_: str | None) -> None:
    assert rank_file_pod(data) == uid_
