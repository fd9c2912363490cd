"""The plugin's ``--metrics``: calls counted by method and status code, scraped over HTTP,
from ``run`` in this process (any user) and from a real plugin process (root)."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.mounter import MemoryMounter
from mtc_replicator.csi.plugin import (
    EXIT_STARTUP_FAILED,
    READY_LINE,
    PluginOptions,
    parse_args,
    run,
)
from tests.csi.conftest import CsiClient, StartPlugin, requires_root

TIMEOUT = 10.0
_METRICS_RE = re.compile(rf"{READY_LINE}:.* metrics=(\S+)")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(address: str) -> Samples:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def calls(samples: Samples, method: str, code: str) -> float | None:
    return samples.get(("mtc_csi_calls_total", (("code", code), ("method", method))))


def seconds_count(samples: Samples, method: str) -> float | None:
    return samples.get(("mtc_csi_call_seconds_count", (("method", method),)))


def make_calls(client: CsiClient) -> None:
    """Two good calls and one that the plugin refuses (INVALID_ARGUMENT)."""
    client.identity.Probe(pb.ProbeRequest(), timeout=TIMEOUT)
    client.node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as refused:
        client.node.NodePublishVolume(pb.NodePublishVolumeRequest(), timeout=TIMEOUT)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def assert_counted(samples: Samples) -> None:
    assert calls(samples, "Probe", "OK") == 1
    assert calls(samples, "NodeGetInfo", "OK") == 1
    assert calls(samples, "NodePublishVolume", "INVALID_ARGUMENT") == 1
    assert seconds_count(samples, "NodePublishVolume") == 1


# --- options -----------------------------------------------------------------------------------

ENV = {
    "MTC_CSI_ENDPOINT": "unix:///csi/csi.sock",
    "MTC_CSI_NODE_ID": "node-a",
    "MTC_RAM_DIR": "/var/lib/mtc/ram",
    "MTC_RAM_SIZE": "64Gi",
}


def test_metrics_are_off_by_default_and_set_by_flag_or_environment() -> None:
    assert parse_args([], ENV).metrics is None
    assert parse_args([], {**ENV, "MTC_CSI_METRICS": ""}).metrics is None
    assert parse_args([], {**ENV, "MTC_CSI_METRICS": "0.0.0.0:9465"}).metrics == "0.0.0.0:9465"
    flagged = parse_args(["--metrics", "127.0.0.1:0"], {**ENV, "MTC_CSI_METRICS": "x:1"})
    assert flagged.metrics == "127.0.0.1:0"


def test_a_bad_metrics_address_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--metrics", "9465"], ENV)
    assert info.value.code == 2
    assert "expected HOST:PORT, got '9465'" in capsys.readouterr().err


# --- run() in this process ---------------------------------------------------------------------


def test_run_serves_call_metrics(
    tmp_path: Path, connect: Callable[[Path], CsiClient], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mtc_replicator.csi.plugin")
    socket_path = tmp_path / "csi.sock"
    opts = PluginOptions(socket_path, "node-a", tmp_path / "ram", 2**20, metrics="127.0.0.1:0")
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run, opts, MemoryMounter(), stop)
        try:
            client = connect(socket_path)
            grpc.channel_ready_future(client.channel).result(TIMEOUT)
            # The socket answers as soon as the server starts; the ready line follows it.
            deadline = time.monotonic() + TIMEOUT
            while not (
                ready := [m for r in caplog.records if (m := _METRICS_RE.search(r.getMessage()))]
            ):
                assert time.monotonic() < deadline, "the ready line names the metrics address"
                time.sleep(0.02)
            address = ready[0][1]
            assert not address.endswith(":0")
            make_calls(client)
            assert_counted(scrape(address))
        finally:
            stop.set()
        assert running.result(TIMEOUT) == 0
    with pytest.raises(urllib.error.URLError, match="refused"):
        scrape(address)  # closed with the plugin


def test_run_fails_when_the_metrics_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        opts = PluginOptions(
            tmp_path / "csi.sock", "node-a", tmp_path / "ram", 2**20, metrics=f"127.0.0.1:{port}"
        )
        assert run(opts, MemoryMounter(), threading.Event()) == EXIT_STARTUP_FAILED
    assert not (tmp_path / "csi.sock").exists()


# --- the real process --------------------------------------------------------------------------


@requires_root
def test_the_plugin_process_serves_call_metrics(
    start_plugin: StartPlugin,
    connect: Callable[[Path], CsiClient],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MTC_CSI_METRICS", "127.0.0.1:0")  # the DaemonSet's way
    plugin = start_plugin("64Mi")
    found = _METRICS_RE.search(plugin.log())
    assert found, plugin.log()
    make_calls(connect(plugin.socket_path))
    samples = scrape(found[1])
    assert_counted(samples)
    # The process, its build and the RAM disk it mounted (64Mi of tmpfs).
    assert samples[("mtc_csi_ram_disk_size_bytes", ())] == 64 * 2**20
    assert 0 < samples[("mtc_csi_ram_disk_free_bytes", ())] <= 64 * 2**20
    assert samples[("process_resident_memory_bytes", ())] > 2**20
    assert [v for (name, _), v in samples.items() if name == "mtc_build_info"] == [1.0]
    with urllib.request.urlopen(f"http://{found[1]}/readyz", timeout=TIMEOUT) as response:
        assert response.read() == b"ok\n"
    assert plugin.stop() == 0
