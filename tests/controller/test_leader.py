"""Two controller processes, one Lease: one reconciles; kill it and the other takes over."""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.controller.conftest import NAMESPACE, Controller, wait_for
from tests.controller.test_controller import Cluster, config

LEASE_SECONDS = 3.0
RETRY_SECONDS = 0.5
TAKEOVER_BOUND = LEASE_SECONDS + RETRY_SECONDS + 5.0
"""The stated failover time: the Lease's duration, one retry, and the new leader's start
(kopf's watches up, the configuration reconciled) in 5 s."""


def _holder(api: Any) -> str | None:
    from kubernetes import client

    lease = client.CoordinationV1Api(api).read_namespaced_lease("mtc-controller", NAMESPACE)
    return str(lease.spec.holder_identity) if lease.spec.holder_identity else None


def _metrics(c: Controller) -> str:
    with urllib.request.urlopen(f"http://{c.health}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_one_leader_reconciles_and_the_other_takes_over_when_it_is_killed(
    api: Any, start_controller: Callable[..., Controller]
) -> None:
    args = (
        f"--lease-duration={LEASE_SECONDS}",
        "--renew-deadline=2",
        f"--retry-period={RETRY_SECONDS}",
    )
    first = start_controller(*args, "--identity=first", name="first")
    leader = wait_for("a leader", lambda: _holder(api), timeout=60)
    assert leader == "first"
    second = start_controller(*args, "--identity=second", name="second")
    wait_for("the second one follows", lambda: "waiting for the Lease" in second.text(), timeout=60)
    cluster = Cluster(api)
    cluster.create(config("leader"))
    try:
        wait_for("the leader reconciles", lambda: cluster.daemonset("leader"))
        time.sleep(1)
        assert _holder(api) == "first"
        assert "Handler 'on_change'" not in second.text()  # the follower did nothing
        assert "mtc_controller_leader 1.0" in _metrics(first)
        assert "mtc_controller_leader 0.0" in _metrics(second)
        assert 'mtc_controller_reconciles_total{outcome="Applied"}' in _metrics(first)
        first.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for("the second one leads", lambda: _holder(api) == "second", timeout=TAKEOVER_BOUND)
        # It reconciles: an edit made after the kill rolls out.
        cluster.patch_spec("leader", {"image": "mtc-replicator:after-failover"})
        wait_for(
            "the edit rolled by the new leader",
            lambda: (
                (ds := cluster.daemonset("leader"))
                and ds["spec"]["template"]["spec"]["containers"][0]["image"]
                == "mtc-replicator:after-failover"
            ),
            timeout=TAKEOVER_BOUND,
        )
        took = time.monotonic() - killed
        assert took < 2 * TAKEOVER_BOUND, took
    finally:
        cluster.delete("leader")
        wait_for("deleted", lambda: cluster.get("leader") is None, timeout=30)
    # A clean stop frees the Lease at once.
    second.stop()
    wait_for("the Lease freed", lambda: _holder(api) is None, timeout=5)
