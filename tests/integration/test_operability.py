"""What an operator reads from a real daemon: JSON logs, the process and RAM-disk metrics,
and the ``/healthz`` and ``/readyz`` probes beside ``/metrics``."""

from __future__ import annotations

import http.client
import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from mtc_replicator import __version__
from mtc_replicator.node.daemon import Daemon
from mtc_replicator.node.options import DaemonOptions
from mtc_replicator.obs.health import Health, Heartbeat, Readiness
from mtc_replicator.obs.metrics import PrometheusMetrics
from mtc_replicator.obs.metrics_endpoint import serve
from tests.integration.conftest import StartDaemon
from tests.integration.helpers import (
    config_text,
    make_step,
    payload,
    wait_ingested,
    wait_markers,
    wait_until,
    write_yaml_atomic,
)
from tests.integration.test_metrics import METRICS, sample, scrape_daemon
from tests.integration.test_status import mtc_status

pytestmark = pytest.mark.integration

RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)")


def get(address: str, path: str) -> tuple[int, str]:
    """Status and body of ``GET http://address/path``, errors included."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_json_logs_are_json_lines_with_the_job_as_keys(
    ckpt: Path, backup_dir: Path, job: str, start_daemon: StartDaemon
) -> None:
    daemon = start_daemon(backup=backup_dir, extra=("--log-format", "json", "--log-level", "debug"))
    write_yaml_atomic(ckpt, config_text(job, backup_interval_steps=1))
    wait_markers(ckpt, job, 0, daemon)
    make_step(ckpt, 3, payload(3, seed=job))
    wait_ingested(ckpt, job, 3, daemon)
    wait_until(lambda: "backup committed" in daemon.log(), "the backup committed", daemon=daemon)
    # One node: mtc status claims no replication, in JSON or in words.
    status = mtc_status(daemon.address, "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    (about,) = [j for j in json.loads(status.stdout)["jobs"] if j["job"] == job]
    assert (about["nodes"], about["last_replicated"]) == (1, None)
    assert about["local_steps"] == [3]
    table = mtc_status(daemon.address).stdout
    assert "not replicated (one node), last backed up" in table
    assert "last replicated" not in table
    # Ready once its backup was probed (listed, read and written): its line may follow the
    # start line by the readiness loop's second.
    wait_until(lambda: '"message": "ready"' in daemon.log(), "the ready line", daemon=daemon)
    daemon.stop()

    lines = [json.loads(line) for line in daemon.log().splitlines()]  # every line is JSON
    assert len(lines) > 5
    for line in lines:
        assert RFC3339_UTC.fullmatch(line["time"]), line
        assert line["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), line
        assert line["logger"], line
        assert isinstance(line["message"], str), line
    about_the_job = [line for line in lines if line.get("job") == job]
    assert about_the_job, "no line carries the job as a key"
    assert all(line.get("rank", 0) == 0 for line in about_the_job)
    assert any(line.get("step") == 3 for line in about_the_job), "no line carries step 3"
    # The start line says the daemon serves; whether it is ready is its own line, never
    # "daemon ready:" followed by "not ready".
    messages = [line["message"] for line in lines]
    started = next(i for i, m in enumerate(messages) if m.startswith("daemon started: "))
    assert "ready" in messages[started:]
    assert not [m for m in messages if m.startswith("daemon ready")]
    # Every line of ours that names the job (accepted, backup committed, ...) has it as a key.
    naming = [
        line
        for line in lines
        if line["logger"].startswith("mtc_replicator.")
        and re.search(rf"\bjob\b.*\b{re.escape(job)}\b", line["message"])
    ]
    assert any(line["message"].startswith("accepted") for line in naming)
    assert any(line["message"].startswith("backup committed") for line in naming)
    assert [line for line in naming if line.get("job") != job] == []


def test_text_logs_stamp_utc_with_its_zone(ckpt: Path, job: str, start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    write_yaml_atomic(ckpt, config_text(job))
    wait_markers(ckpt, job, 0, daemon)
    ready = next(line for line in daemon.log().splitlines() if "daemon started" in line)
    assert RFC3339_UTC.match(ready.split(" ", 1)[0]), ready
    assert any(f"job={job} rank=0" in line for line in daemon.log().splitlines())


def test_process_build_and_ram_disk_metrics(ckpt: Path, start_daemon: StartDaemon) -> None:
    daemon = start_daemon(extra=METRICS)
    got = scrape_daemon(daemon)
    rss = sample(got, "process_resident_memory_bytes")
    assert rss is not None
    assert rss > 1 << 20
    fds = sample(got, "process_open_fds")
    assert fds is not None
    assert fds > 0
    assert sample(got, "process_cpu_seconds_total") is not None
    build = [
        dict(labels)
        for (name, labels), value in got.items()
        if name == "mtc_build_info" and value == 1
    ]
    assert len(build) == 1
    assert build[0]["version"] == __version__
    assert build[0]["python"].count(".") == 2
    assert build[0]["grpc"][0].isdigit()
    st = os.statvfs(ckpt)
    assert sample(got, "mtc_checkpoint_dir_size_bytes") == st.f_blocks * st.f_frsize
    free = sample(got, "mtc_checkpoint_dir_free_bytes")
    assert free is not None
    assert 0 < free <= st.f_blocks * st.f_frsize
    # Free bytes are read at each scrape: a file written in CHECKPOINT_DIR shows.
    (ckpt / "filler.bin").write_bytes(os.urandom(4 << 20))
    after = wait_until(
        lambda: (
            (v := sample(scrape_daemon(daemon), "mtc_checkpoint_dir_free_bytes")) is not None
            and v <= free - (3 << 20)
        ),
        "free bytes to drop by the file written",
        daemon=daemon,
    )
    assert after


def grpc_health(address: str, service: str) -> str:
    """The gRPC health status of ``service`` at ``address``, as kubelet's probe reads it."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def test_healthz_and_readyz_mean_something(ckpt: Path, start_daemon: StartDaemon) -> None:
    daemon = start_daemon(extra=(*METRICS, "--health-listen", "127.0.0.1:0"))
    address = daemon.metrics
    assert address is not None
    found = re.search(r"daemon started:.* health=(\S+)", daemon.log())
    assert found
    probes = found[1]
    wait_until(lambda: grpc_health(probes, "readiness") == "SERVING", "ready", daemon=daemon)
    assert grpc_health(probes, "") == "SERVING"
    assert get(address, "/healthz") == (200, "ok\n")
    wait_until(lambda: get(address, "/readyz") == (200, "ok\n"), "ready", daemon=daemon)
    status, body = get(address, "/nope")
    assert status == 404
    assert "/readyz" in body
    status, body = get(address, "/metrics")
    assert status == 200
    assert "mtc_build_info" in body

    # CHECKPOINT_DIR gone (an unmounted RAM disk): not ready, and the body says why; alive.
    away = ckpt.with_name(ckpt.name + ".away")
    ckpt.rename(away)
    try:
        status, body = get(address, "/readyz")
        assert status == 503
        assert f"CHECKPOINT_DIR {ckpt} is missing" in body
        assert get(address, "/healthz") == (200, "ok\n")
        # kubelet's readiness probe sees it too; its liveness probe does not.
        wait_until(
            lambda: grpc_health(probes, "readiness") == "NOT_SERVING",
            "not ready over gRPC",
            daemon=daemon,
        )
        assert grpc_health(probes, "") == "SERVING"
    finally:
        away.rename(ckpt)
    wait_until(lambda: get(address, "/readyz") == (200, "ok\n"), "ready", daemon=daemon)
    wait_until(lambda: grpc_health(probes, "readiness") == "SERVING", "ready", daemon=daemon)
    assert "not ready: CHECKPOINT_DIR" in daemon.log()
    wait_until(
        lambda: (
            daemon.log().rfind("mtc_replicator.node.daemon: ready")
            > daemon.log().index("not ready: CHECKPOINT_DIR")
        ),
        "'ready' logged after 'not ready'",
        daemon=daemon,
    )


def test_probes_answer_503_with_the_reasons() -> None:
    """The endpoint itself, in this process: not ready before startup ends, not alive once
    the loop stops beating (a stalled process cannot be asked to say so itself)."""
    now = [0.0]
    heart = Heartbeat(limit=60, clock=lambda: now[0])
    ready = Readiness(stage="opening the store")
    served = serve(CollectorRegistry(), "127.0.0.1:0", Health([heart.check], [ready.check]))
    try:
        assert get(served.address, "/readyz") == (503, "not started yet: opening the store\n")
        assert get(served.address, "/healthz") == (200, "ok\n")
        ready.stage = None
        assert get(served.address, "/readyz") == (200, "ok\n")
        now[0] = 61.0
        expected = "the event loop has not answered for 61s (limit 60s)\n"
        assert get(served.address, "/healthz") == (503, expected)
        assert get(served.address, "/readyz") == (503, expected)
        heart.beat()
        assert get(served.address, "/healthz") == (200, "ok\n")
    finally:
        served.close()


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/nothing"])
def test_head_answers_headers_without_a_body(path: str) -> None:
    """A HEAD answer has the GET answer's status and headers and no body: a body would be
    read by a keep-alive client as the start of the next answer."""
    ready = Readiness(stage="opening the store")
    served = serve(PrometheusMetrics().registry, "127.0.0.1:0", Health([], [ready.check]))
    try:
        host, port = served.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", path)
            got = conn.getresponse()
            get_status, body = got.status, got.read()
            get_headers = {k: got.getheader(k) for k in ("Content-Type", "Content-Length")}
            conn.close()
            conn.connect()
            # Raw, so that the client does not skip what it is not told to expect.
            conn.sock.sendall(f"HEAD {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
            raw = b""
            while chunk := conn.sock.recv(65536):
                raw += chunk
        finally:
            conn.close()
        head, _, rest = raw.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode().split("\r\n")
        headers = dict(line.split(": ", 1) for line in header_lines)
        assert int(status_line.split()[1]) == get_status
        assert {k: headers.get(k) for k in get_headers} == get_headers
        assert get_headers["Content-Length"] == str(len(body))
        assert body
        assert rest == b""
    finally:
        served.close()


def test_readyz_says_stopping_as_soon_as_a_stop_is_asked(tmp_path: Path) -> None:
    """SIGTERM's handler marks the daemon not ready at once, not after the whole shutdown
    (gRPC grace, the incarnation's stop) when nobody asks any more."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    daemon = Daemon(DaemonOptions(checkpoint_dir=ckpt, listen="127.0.0.1:0"))
    try:
        daemon.readiness.stage = None
        assert daemon.health.readiness() == []
        daemon._request_stop()
        assert daemon.health.readiness() == ["stopping"]
    finally:
        daemon.parts.executor.shutdown()
        daemon.parts.store.close()
