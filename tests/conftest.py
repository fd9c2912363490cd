"""What every test directory shares: how the suite's tests are spread over pytest-xdist's
workers (``make test`` runs two, ``--dist loadgroup``).

Most tests wait on real daemons more than they compute, so two workers on two cores cut
the suite's wall time. Tests that share something one machine has once stay on one
worker, one after the other: the Ray tests (one Ray cluster at a time: its nodes have
fixed loopback addresses, and Ray's autoscaling requests outlive a test, see
``tests/ray/test_ray_train.py``) and the controller's (one real kube-apiserver and etcd
is enough).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_ONE_WORKER = {"ray": "ray", "controller": "kube-apiserver"}
"""Test directories whose tests run on one worker, by the group that keeps them there."""
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = item.path.relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        if (group := _ONE_WORKER.get(top)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
