"""One real API server for the session; controller processes started per module."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controller.apiserver import (
    CONTROLLER_TOKEN,
    REPO,
    ApiServer,
    free_port,
    missing_reason,
)

kubernetes = pytest.importorskip(
    "kubernetes", reason="the controller extra is not installed: pip install '.[controller]'"
)
pytest.importorskip("kopf", reason="the controller extra is not installed")

NAMESPACE = "mtc-system"
CRD = REPO / "deploy" / "base" / "crd.yaml"
RBAC = REPO / "deploy" / "components" / "controller" / "rbac.yaml"
"""The controller runs as its ServiceAccount under this RBAC: the tests show it is enough."""


# Package scope, not session: etcd, kube-apiserver and kube-controller-manager stop once
# this package's tests are done, instead of running (and taking CPU) under the rest of the
# suite, whose timing-bound tests they made miss (a paced push took 8.8 s for 4.2 s).
@pytest.fixture(scope="package")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    why = missing_reason()
    if why is not None:
        pytest.skip(why)
    server = ApiServer(tmp_path_factory.mktemp("k8s"))
    try:
        server.start()
        api = _client(server)
        _bootstrap(api)
        yield server
    finally:
        server.stop()


def _client(server: ApiServer) -> Any:
    from kubernetes import config

    return config.new_client_from_config(str(server.kubeconfig))


def _bootstrap(api: Any) -> None:
    """The CRD (Established) and the controller's namespace, as an install makes them."""
    from kubernetes import client, utils

    client.CoreV1Api(api).create_namespace(
        {"metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "mtc"}}}
    )
    utils.create_from_dict(api, yaml.safe_load(CRD.read_text()))
    for obj in yaml.safe_load_all(RBAC.read_text()):
        utils.create_from_dict(api, obj)
    ext = client.ApiextensionsV1Api(api)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        crd = ext.read_custom_resource_definition("checkpointconfigurations.checkpointing.mtc.dev")
        if any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or []):
            return
        time.sleep(0.2)
    raise AssertionError("the CRD was not Established within 30 s")


@pytest.fixture(scope="package")
def api(apiserver: ApiServer) -> Any:
    return _client(apiserver)


class Controller:
    """One ``mtc-controller`` process; its log is kept for failures."""

    def __init__(
        self, server: ApiServer, log: Path, *args: str, env_extra: dict[str, str] | None = None
    ) -> None:
        self.log = log
        self.health = f"127.0.0.1:{free_port()}"
        # As the controller's ServiceAccount (deploy/components/controller/rbac.yaml).
        kubeconfig = log.with_suffix(".kubeconfig")
        kubeconfig.write_text(
            yaml.safe_dump(server.kubeconfig_for(CONTROLLER_TOKEN, "mtc-controller"))
        )
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "PYTHONPATH": str(REPO),
            **(env_extra or {}),
        }
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.controller.compat_main",  # the 1.20 server's one difference
                    "--health-listen",
                    self.health,
                    *args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ready(c: Controller) -> bool:
    """Whether the controller answers ``/readyz`` (it fails the test if it exited)."""
    assert c.proc.poll() is None, c.text()
    try:
        with urllib.request.urlopen(f"http://{c.health}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def running_controller(server: ApiServer, log: Path, env: dict[str, str]) -> Controller:
    """One controller process without leader election, with ``env``, once it is ready."""
    c = Controller(server, log, "--no-leader-elect", env_extra=env)
    wait_for("the controller is ready", lambda: ready(c), timeout=60)
    return c


@pytest.fixture
def start_controller(apiserver: ApiServer, tmp_path: Path) -> Iterator[Callable[..., Controller]]:
    started: list[Controller] = []

    def start(*args: str, name: str = "controller") -> Controller:
        c = Controller(apiserver, tmp_path / f"{name}-{len(started)}.log", *args)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0, every: float = 0.2) -> Any:
    """``check()``'s first truthy value; fails naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last!r})")
