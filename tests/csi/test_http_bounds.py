"""The CSI plugin's metrics and health port is bounded like the daemon's (one server,
``obs.httpserver``): 300 unfinished requests against the real plugin process hold a bounded
number of threads, and a probe still gets through. The closing deadline is tested on the
daemon (``tests/integration/test_http_bounds.py``)."""

from __future__ import annotations

import re
import time

import pytest

from mtc_replicator.csi.plugin import READY_LINE
from mtc_replicator.obs.httpserver import MAX_CONNECTIONS
from tests.csi.conftest import StartPlugin, requires_root
from tests.integration.test_http_bounds import get, partial_requests, threads

_METRICS_RE = re.compile(rf"{READY_LINE}:.* metrics=(\S+)")


@requires_root
def test_the_plugin_holds_bounded_threads_under_300_unfinished_requests(
    start_plugin: StartPlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTC_CSI_METRICS", "127.0.0.1:0")
    plugin = start_plugin("16Mi")
    found = _METRICS_RE.search(plugin.log())
    assert found, plugin.log()
    assert plugin.proc is not None
    pid = plugin.proc.pid
    before = threads(pid)
    with partial_requests(found[1], 300):
        time.sleep(1.0)
        held = threads(pid)
        assert held <= before + MAX_CONNECTIONS + 2, (before, held)
        assert get(found[1]) == (200, b"ok\n")
    assert plugin.stop() == 0
