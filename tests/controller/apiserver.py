"""A real etcd and kube-apiserver (and kube-controller-manager when built) on loopback ports.

The binaries come from ``scripts/k8s_testbed.sh`` (``make test`` runs it first): Kubernetes
1.20.2 built once from Debian's source package into ``~/.cache/mtc-replicator/k8s-1.20.2``,
etcd from Debian's ``etcd-server``. One admin bearer token (``system:masters``) and, for
RBAC tests, a few more users in the token file; a kubeconfig for kubectl, the Python client
and the controller.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(
    os.environ.get("MTC_K8S_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "mtc-replicator"
    / "k8s-1.20.2"
)
BIN = CACHE / "bin"
ADMIN_TOKEN = "mtc-test-admin-token"  # noqa: S105 (a throwaway token of a loopback server)
CONTROLLER_TOKEN = "mtc-test-controller-token"  # noqa: S105
USERS = {
    # token: (user, groups). The controller's ServiceAccount, as RBAC names it: its
    # ClusterRole (deploy/components/controller/rbac.yaml) is all it may use.
    CONTROLLER_TOKEN: (
        "system:serviceaccount:mtc-system:mtc-controller",
        "system:serviceaccounts,system:serviceaccounts:mtc-system,system:authenticated",
    ),
}


def missing_reason() -> str | None:
    """Why the test bed cannot run, or None when it can."""
    failed = CACHE / "FAILED"
    if not (BIN / "kube-apiserver").is_file():
        why = failed.read_text().strip() if failed.is_file() else "it was not built"
        return (
            f"no kube-apiserver in {BIN} ({why}); scripts/k8s_testbed.sh builds it once "
            "(make test runs it)"
        )
    if shutil.which("etcd") is None:
        return "no etcd on PATH (Debian's etcd-server); scripts/k8s_testbed.sh installs it"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(  # noqa: S310 (http(s) only)
        url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited {proc.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(request, timeout=2, context=ctx) as response:  # noqa: S310
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:]
            raise RuntimeError(f"{url} not ready after {timeout} s: {tail}")
        time.sleep(0.2)


def _service_account_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )


@dataclass
class ApiServer:
    """etcd, kube-apiserver and, when built, kube-controller-manager; ``stop`` ends them."""

    root: Path
    url: str = ""
    kubeconfig: Path = field(init=False)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    controller_manager: bool = False
    """Whether kube-controller-manager runs (DaemonSets then get pods on registered Nodes)."""

    def __post_init__(self) -> None:
        self.kubeconfig = self.root / "kubeconfig"

    def _spawn(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.root / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc, log

    def start(self) -> ApiServer:
        self.root.mkdir(parents=True, exist_ok=True)
        client, peer, secure = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client}"
        etcd, etcd_log = self._spawn(
            "etcd",
            [
                "etcd",
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                etcd_url,
                "--advertise-client-urls",
                etcd_url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
            ],
        )
        _wait_http(f"{etcd_url}/health", 30, etcd, etcd_log)
        key = self.root / "sa.key"
        _service_account_key(key)
        tokens = self.root / "tokens.csv"
        lines = [f"{ADMIN_TOKEN},admin,admin-uid,system:masters"]
        lines += [f'{t},{u},{u}-uid,"{g}"' for t, (u, g) in USERS.items()]
        tokens.write_text("\n".join(lines) + "\n")
        apiserver, api_log = self._spawn(
            "kube-apiserver",
            [
                str(BIN / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                f"--secure-port={secure}",
                "--insecure-port=0",
                f"--cert-dir={self.root / 'certs'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={key}",
                f"--service-account-signing-key-file={key}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                "--service-cluster-ip-range=10.96.0.0/24",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--event-ttl=10m",
            ],
        )
        self.url = f"https://127.0.0.1:{secure}"
        _wait_http(f"{self.url}/readyz", 90, apiserver, api_log)
        self.kubeconfig.write_text(yaml.safe_dump(self.kubeconfig_for(ADMIN_TOKEN, "admin")))
        self._start_controller_manager()
        return self

    def kubeconfig_for(self, token: str, user: str) -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "test",
                    # The serving certificate kube-apiserver made itself, with its CA: TLS
                    # is verified as against a real cluster.
                    "cluster": {
                        "server": self.url,
                        "certificate-authority": str(self.root / "certs" / "apiserver.crt"),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
            "current-context": "test",
        }

    def _start_controller_manager(self) -> None:
        binary = BIN / "kube-controller-manager"
        if not binary.is_file():
            return
        port = free_port()
        proc, log = self._spawn(
            "kube-controller-manager",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--port=0",
                "--leader-elect=false",
                "--controllers=daemonset,garbagecollector,serviceaccount-token",
                f"--service-account-private-key-file={self.root / 'sa.key'}",
                "--use-service-account-credentials=false",
            ],
        )
        _wait_http(f"https://127.0.0.1:{port}/healthz", 60, proc, log)
        self.controller_manager = True

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                # Throwaway servers: no reason to wait out kube-apiserver's graceful drain.
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
