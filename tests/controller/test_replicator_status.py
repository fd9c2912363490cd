"""Status as the replicators report it, on a real API server with real daemons.

Two real daemons serve /readyz and /metrics at two loopback addresses (127.0.0.42 and
127.0.0.43, port 9464 as in the DaemonSet), standing for two nodes' pods: their pods get
those IPs the way kubelet would report them. The controller (its own process, as its
ServiceAccount) asks each replicator every second here (30 s by default) and writes what
they say into the configuration's status: a node's own reason for not being ready (its
RAM disk missing, then unreachable), each job's newest step per tier with its time, read
back with ``kubectl get -o yaml``; and Events for a backup that starts failing, a node not
ready for long (its replicator's reason in the message) and a job whose restore is blocked.
"""

from __future__ import annotations

import calendar
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtc_replicator.core.manifest import ItemId
from mtc_replicator.local.hashing import build_manifest
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import FileObjectStore
from tests.controller.apiserver import ApiServer
from tests.controller.conftest import NAMESPACE, Controller, running_controller, wait_for
from tests.controller.test_controller import Cluster, _register_nodes, config
from tests.daemon_process import DaemonProcess
from tests.integration.helpers import (
    FAST_ARGS,
    config_text,
    make_step,
    mount_tmpfs,
    payload,
    unmount,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)

NAME = "reports"
JOB = "rep-job"
ADDRESSES = ("127.0.0.42", "127.0.0.43")
"""Addresses no other test uses: another test file may run beside this one (pytest-xdist);
the Ray tests' nodes have 127.0.0.2 and .3."""
METRICS_PORT = 9464


@pytest.fixture(scope="module")
def controller(
    apiserver: ApiServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Controller]:
    log = tmp_path_factory.mktemp("controller") / "controller.log"
    env = {
        "MTC_CONTROLLER_SCRAPE_SECONDS": "1",
        "MTC_CONTROLLER_NOT_READY_SECONDS": "5",
        "MTC_CONTROLLER_RETRY_SECONDS": "1",
    }
    c = running_controller(apiserver, log, env)
    yield c
    c.stop()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[DaemonProcess]]:
    """Node a: a job backed up to file://; node b: no backup. Their metrics at the pods' IPs."""
    started = []
    for i, ip in enumerate(ADDRESSES):
        backup = tmp_path / "backup" if i == 0 else None
        if backup is not None:
            backup.mkdir()
        d = DaemonProcess(
            tmp_path / f"node{i}" / "ckpt",
            backup=backup.as_uri() if backup else None,
            extra_args=(*FAST_ARGS, "--metrics", f"{ip}:{METRICS_PORT}"),
        )
        started.append(d)
        d.start()
    yield started
    for d in started:
        if d.running:
            d.stop(timeout=10)


def _pods(cluster: Cluster, apiserver: ApiServer, name: str = NAME, count: int = 2) -> list[Any]:
    """The node stack's pods, one per node: the DaemonSet's own where a
    kube-controller-manager runs (on registered Nodes), else made as it would."""
    selector = f"app.kubernetes.io/instance={name}"
    if apiserver.controller_manager:
        _register_nodes(cluster, name, count)
        pods = wait_for(
            "a pod per node",
            lambda: (
                (p := cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)
                and len(p) == count
                and p
            ),
        )
        return sorted(pods, key=_node_of)
    ds = cluster.daemonset(name)
    assert ds is not None
    template = ds["spec"]["template"]
    for i in range(count):
        body = {
            "metadata": {"name": f"mtc-node-{name}-{i}", "labels": template["metadata"]["labels"]},
            "spec": {**template["spec"], "nodeName": f"{name}-node-{i}"},
        }
        cluster.core.create_namespaced_pod(NAMESPACE, body)
    return sorted(
        cluster.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items,
        key=_node_of,
    )


def _node_of(pod: Any) -> str:
    if pod.spec.node_name:
        return str(pod.spec.node_name)
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    return str(terms.node_selector_terms[0].match_fields[0].values[0])


def _running(cluster: Cluster, pod: Any, ip: str, ready: bool) -> None:
    """What kubelet reports of a running pod at ``ip``."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    flag = "True" if ready else "False"
    cluster.core.patch_namespaced_pod_status(
        pod.metadata.name,
        NAMESPACE,
        {
            "status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [
                    {"type": "Ready", "status": flag, "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                ],
                "containerStatuses": [
                    {
                        "name": "replicator",
                        "ready": ready,
                        "restartCount": 0,
                        "image": "mtc-replicator",
                        "imageID": "",
                        "state": {"running": {"startedAt": now}},
                    }
                ],
            }
        },
    )


def _status(cluster: Cluster, name: str = NAME) -> dict[str, Any]:
    return dict((cluster.get(name) or {}).get("status") or {})


def _entry(st: dict[str, Any], node: str) -> dict[str, Any] | None:
    return next((e for e in st.get("nodes", {}).get("notReady", []) if e["node"] == node), None)


def _events(cluster: Cluster, reason: str, name: str = NAME) -> list[Any]:
    return [e for e in cluster.events(name) if e.reason == reason]


def _not_ready_events(cluster: Cluster, node: str) -> list[Any]:
    return [e for e in _events(cluster, "NodeNotReady") if f"node {node} " in e.message]


def test_status_says_what_each_replicator_reports(
    api: Any,
    controller: Controller,
    apiserver: ApiServer,
    daemons: list[DaemonProcess],
    tmp_path: Path,
) -> None:
    for ip in ADDRESSES:  # the daemons answer where the pods' IPs say
        with urllib.request.urlopen(f"http://{ip}:{METRICS_PORT}/readyz", timeout=5) as r:
            assert r.status == 200
    cluster = Cluster(api)
    cluster.create(config(NAME))
    try:
        _check(cluster, apiserver, daemons, tmp_path)
    finally:
        cluster.delete(NAME)
        wait_for("the configuration gone", lambda: cluster.get(NAME) is None)


def _check(
    cluster: Cluster, apiserver: ApiServer, daemons: list[DaemonProcess], tmp_path: Path
) -> None:
    a, b = daemons
    wait_for("the DaemonSet", lambda: cluster.daemonset(NAME))
    pod_a, pod_b = _pods(cluster, apiserver)
    node_a, node_b = _node_of(pod_a), _node_of(pod_b)
    # Node b has lost its RAM disk: kubelet sees only a readiness probe not passing.
    b.checkpoint_dir.rmdir()
    _running(cluster, pod_a, ADDRESSES[0], ready=True)
    _running(cluster, pod_b, ADDRESSES[1], ready=False)

    # Node a runs a job that saves step 5 and backs it up.
    ckpt = a.checkpoint_dir
    write_yaml_atomic(ckpt, config_text(JOB, backup_interval_steps=1))
    wait_markers(ckpt, JOB, 0, a)
    make_step(ckpt, 5, payload(5, seed=JOB))
    wait_ingested(ckpt, JOB, 5, a)

    def reported() -> dict[str, Any] | None:
        st = _status(cluster)
        jobs = {j["job"]: j for j in st.get("jobs", [])}
        entry = _entry(st, node_b)
        job = jobs.get(JOB)
        if (
            entry is None
            or "replicator" not in entry
            or job is None
            or job.get("backup", {}).get("step") != 5
        ):
            return None
        return st

    st = wait_for("the replicators' word in the status", reported, timeout=60)
    assert st["nodes"]["reporting"] == 2
    entry = _entry(st, node_b)
    assert entry is not None
    assert entry["reason"] == "replicator: running, readiness probe not passing"  # kubelet's
    assert entry["replicator"] == (  # the daemon's own
        f"CHECKPOINT_DIR {b.checkpoint_dir} is missing or not a directory"
    )
    assert _entry(st, node_a) is None
    (job,) = [j for j in st["jobs"] if j["job"] == JOB]
    assert job["nodes"] == 1
    assert job["local"]["step"] == 5
    assert job.get("replicated", job["local"])["step"] <= 5
    for tier in ("local", "backup"):
        at = calendar.timegm(time.strptime(job[tier]["at"], "%Y-%m-%dT%H:%M:%SZ"))
        assert abs(time.time() - at) < 120, job

    # Not ready past MTC_CONTROLLER_NOT_READY_SECONDS: one Event, the replicator's reason in it.
    (late,) = wait_for("a NodeNotReady Event", lambda: _not_ready_events(cluster, node_b))
    assert "CHECKPOINT_DIR" in late.message, late.message

    # The backup starts failing on node a: one BackupFailing Event naming the node.
    backup = tmp_path / "backup"
    shutil.rmtree(backup)
    backup.write_text("not a directory any more")
    make_step(ckpt, 6, payload(6, seed=JOB))
    wait_ingested(ckpt, JOB, 6, a)
    (failing,) = wait_for("a BackupFailing Event", lambda: _events(cluster, "BackupFailing"))
    assert failing.type == "Warning"
    assert node_a in failing.message
    newer = wait_for(
        "step 6 local",
        lambda: (
            (j := {x["job"]: x for x in _status(cluster).get("jobs", [])}.get(JOB))
            and j["local"]["step"] == 6
            and j
        ),
    )
    assert newer["backup"]["step"] == 5  # the backup did not move

    # Read back as an operator does.
    if shutil.which("kubectl") is not None:
        kubectl = ["kubectl", "--kubeconfig", str(apiserver.kubeconfig), "-n", NAMESPACE]
        out = subprocess.run(
            [*kubectl, "get", "ckptconfig", NAME, "-o", "yaml"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        read = yaml.safe_load(out)["status"]
        assert {j["job"]: j["local"]["step"] for j in read["jobs"]}[JOB] == 6
        assert _entry(read, node_b) is not None
        described = subprocess.run(
            [*kubectl, "describe", "ckptconfig", NAME],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        print(f"$ kubectl describe ckptconfig {NAME}\n{described}")  # docs/deploy.md's sample
        assert re.search(r"Replicator: +CHECKPOINT_DIR", described), described
        assert "BackupFailing" in described

    # Node b's replicator stops: the status says it cannot be asked.
    b.stop(timeout=10)
    gone = wait_for(
        "node b unreachable",
        lambda: (
            (e := _entry(_status(cluster), node_b))
            and "unreachable" in e.get("replicator", "")
            and e
        ),
    )
    assert gone["replicator"].startswith("unreachable: cannot connect")
    # Still one Event of each: not one per look.
    time.sleep(3)
    assert len(_events(cluster, "BackupFailing")) == 1
    assert len(_not_ready_events(cluster, node_b)) == 1


def test_a_blocked_restore_posts_one_event(
    api: Any, controller: Controller, apiserver: ApiServer, tmp_path: Path
) -> None:
    """A node whose RAM disk (a 2 MiB tmpfs) cannot hold the job's committed 3 MiB step: the
    restore stops with ``replicator.failed``, and a RestoreBlocked Event names job and node."""
    ram = tmp_path / "ram"
    ram.mkdir()
    if not mount_tmpfs(ram, "2m"):
        pytest.skip("a RAM disk smaller than the step needs root (mount -t tmpfs)")
    name, job = "blocked", "blocked-job"
    try:
        data = tmp_path / "step"
        data.mkdir()
        (data / "state.bin").write_bytes(os.urandom(3 << 20))
        backup = tmp_path / "backup"
        store = BackupStore(FileObjectStore(backup))
        item = ItemId(job, 7, 0, 0)
        store.upload_item(build_manifest(item, data), data)
        assert store.try_commit(job, 7, [item.key]) is not None
        daemon = DaemonProcess(
            ram / "ckpt",
            backup=backup.as_uri(),
            extra_args=(*FAST_ARGS, "--metrics", f"{ADDRESSES[0]}:{METRICS_PORT}"),
        ).start()
        cluster = Cluster(api)
        cluster.create(config(name))
        try:
            wait_for("the DaemonSet", lambda: cluster.daemonset(name))
            (pod,) = _pods(cluster, apiserver, name, 1)
            _running(cluster, pod, ADDRESSES[0], ready=True)
            # The controller's first answer from the node is the baseline: no job yet.
            wait_for(
                "the replicator asked",
                lambda: (
                    (cluster.get(name) or {}).get("status", {}).get("nodes", {}).get("reporting")
                ),
            )
            write_yaml_atomic(daemon.checkpoint_dir, config_text(job, backup_interval_steps=1))
            failed = daemon.checkpoint_dir / "replicator.failed"
            wait_until(failed.exists, "replicator.failed", daemon=daemon)
            assert "could not be restored" in failed.read_text()
            (blocked,) = wait_for(
                "a RestoreBlocked Event", lambda: _events(cluster, "RestoreBlocked", name)
            )
            assert blocked.type == "Warning"
            assert f"job {job}" in blocked.message
            assert f"node {_node_of(pod)}" in blocked.message
        finally:
            daemon.stop(timeout=10)
            cluster.delete(name)
            wait_for("the configuration gone", lambda: cluster.get(name) is None)
    finally:
        unmount(ram)
