"""The holder must stop leading within ``renew_deadline`` (+ one retry) of its last renewal
whatever the API server does: refuse connections, or accept them and never answer. Otherwise
it keeps reconciling after another replica took the expired Lease (two leaders)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from kubernetes import client

from mtc_replicator.controller.leader import LeaseElector, Timing

TIMING = Timing(duration=3.0, renew_deadline=1.0, retry=0.2)
BOUND = TIMING.renew_deadline + TIMING.retry + 1.0
"""Lost well before another replica could take the Lease (``duration``)."""


def _elector(host: str) -> LeaseElector:
    cfg = client.Configuration()
    cfg.host = host
    e = LeaseElector(client.ApiClient(cfg), "ns", "lease", "me", TIMING)
    # As after a successful acquire: it holds the Lease.
    e._seen = ("me", object())
    e.leading.set()
    return e


def _keep_until_lost(e: LeaseElector) -> float:
    stop, lost = threading.Event(), threading.Event()
    start = time.monotonic()
    t = threading.Thread(target=e.keep, args=(stop, lost), daemon=True)
    t.start()
    try:
        assert lost.wait(BOUND + 5), "the holder never noticed it lost the Lease"
        return time.monotonic() - start
    finally:
        stop.set()


def test_an_unreachable_api_server_stops_the_leader() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens: connection refused (urllib3's error, not an ApiException)
    took = _keep_until_lost(_elector(f"http://127.0.0.1:{port}"))
    assert took < BOUND, took


def test_an_api_server_that_never_answers_stops_the_leader() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # accepts (the kernel's backlog) and never answers
    try:
        took = _keep_until_lost(_elector(f"http://127.0.0.1:{s.getsockname()[1]}"))
        assert took < BOUND, took
    finally:
        s.close()


def test_timings_that_allow_two_leaders_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # A renew deadline at or past the Lease's duration lets a leader renew after a follower
    # took the expired Lease: refused at the command line, as client-go does.
    from mtc_replicator.controller.main import parse_args

    assert parse_args(["--lease-duration", "15", "--renew-deadline", "10"]).renew_deadline == 10
    for argv in (
        ["--lease-duration", "10", "--renew-deadline", "10"],
        ["--lease-duration", "15", "--renew-deadline", "20"],
        ["--renew-deadline", "10", "--retry-period", "10"],
        ["--retry-period", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--renew-deadline < --lease-duration" in capsys.readouterr().err
