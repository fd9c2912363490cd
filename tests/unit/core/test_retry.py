"""Backoff and retries (``mtc_replicator.core.retry``), and GCS's one error classifier (S3's:
``test_s3_errors``).

Pure: a fake clock and sleep, no sockets; vendor exceptions are built in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mtc_replicator.core.retry import Backoff, RetryPolicy, RetryState, call_with_retry
from mtc_replicator.storage.objectstore import (
    BucketNotFound,
    DamagedInTransit,
    NoCredentials,
    ObjectNotFound,
    ObjectStoreError,
    PermissionDenied,
    PreconditionFailed,
    TransientError,
)


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, ObjectStoreError) and exc.transient


def failing(errors: list[Exception], result: str = "ok") -> Callable[[], str]:
    """A call that raises ``errors`` in turn, then returns ``result``."""
    calls = iter(errors)

    def fn() -> str:
        error = next(calls, None)
        if error is not None:
            raise error
        return result

    return fn


def retry(fn: Callable[[], str], policy: RetryPolicy, t: FakeTime, rand: float = 0.5) -> str:
    return call_with_retry(
        fn, policy, is_transient, what="test op", clock=t.clock, sleep=t.sleep, rand=lambda: rand
    )


# --- the backoff -----------------------------------------------------------------------------


def waits(backoff: Backoff, n: int) -> list[float]:
    return [backoff.next() for _ in range(n)]


def test_delays_grow_exponentially_up_to_the_cap() -> None:
    # rand=1 is the top of each jitter range: the full exponential step.
    backoff = Backoff(1.0, 5.0, multiplier=2.0, rand=lambda: 1.0)
    assert waits(backoff, 5) == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_jitter_keeps_at_least_half_the_step() -> None:
    def third_wait(rand: float) -> float:
        return waits(Backoff(1.0, 8.0, rand=lambda: rand), 3)[-1]

    assert third_wait(0.0) == 2.0
    assert third_wait(0.5) == 3.0
    assert all(2.0 <= third_wait(r / 10) <= 4.0 for r in range(10))


def test_the_defaults_are_the_coordinator_waits() -> None:
    """From 0.1 s, doubling, capped at 3 s: what agents wait for their coordinator."""
    assert waits(Backoff(rand=lambda: 1.0), 7) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.0, 3.0]
    assert waits(Backoff(rand=lambda: 0.0), 2) == [0.05, 0.1]


def test_reset_starts_again_from_the_first_delay() -> None:
    backoff = Backoff(0.5, 15.0, rand=lambda: 1.0)
    assert waits(backoff, 3) == [0.5, 1.0, 2.0]
    backoff.reset()
    assert waits(backoff, 2) == [0.5, 1.0]


def test_each_wait_draws_its_own_jitter() -> None:
    draws = iter([0.0, 1.0, 0.5])
    assert waits(Backoff(1.0, 10.0, rand=lambda: next(draws)), 3) == [0.5, 2.0, 3.0]


def test_a_backoff_used_forever_stays_at_the_cap() -> None:
    """A dead peer is retried for hours: the thousandth wait must not overflow."""
    backoff = Backoff(0.5, 15.0, rand=lambda: 1.0)
    assert waits(backoff, 5000)[-1] == 15.0
    assert waits(Backoff(0.0, 1.0), 5000)[-1] == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"first": -1.0}, {"first": 5.0, "cap": 1.0}, {"multiplier": 0.5}],
)
def test_bad_backoffs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="need"):
        Backoff(**kwargs)


def test_a_policy_gives_its_own_backoff() -> None:
    policy = RetryPolicy(first_delay=0.25, max_delay=1.0, multiplier=3.0)
    assert waits(policy.backoff(rand=lambda: 1.0), 3) == [0.25, 0.75, 1.0]


# --- the policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"first_delay": -1.0},
        {"first_delay": 5.0, "max_delay": 1.0},
        {"deadline": -1.0},
        {"multiplier": 0.5},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"need|must"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


# --- call_with_retry -------------------------------------------------------------------------


def test_success_needs_no_sleep() -> None:
    t = FakeTime()
    assert retry(failing([]), RetryPolicy(), t) == "ok"
    assert t.sleeps == []


def test_transient_errors_are_retried_until_success() -> None:
    t = FakeTime()
    errors: list[Exception] = [TransientError("503"), TransientError("SlowDown")]
    policy = RetryPolicy(first_delay=1.0, max_delay=10.0)
    assert retry(failing(errors), policy, t, rand=1.0) == "ok"
    assert t.sleeps == [1.0, 2.0]


@pytest.mark.parametrize(
    "error",
    [
        PermissionDenied("403"),
        BucketNotFound("no bucket"),
        ObjectNotFound("k"),
        PreconditionFailed("412"),
        ObjectStoreError("400"),
        ValueError("a bug is not a storage error"),
    ],
)
def test_final_errors_are_raised_at_once(error: Exception) -> None:
    t = FakeTime()
    with pytest.raises(type(error)) as raised:
        retry(failing([error]), RetryPolicy(), t)
    assert raised.value is error
    assert t.sleeps == []


def test_attempts_are_bounded() -> None:
    t = FakeTime()
    errors: list[Exception] = [TransientError(f"503 #{i}") for i in range(10)]
    with pytest.raises(TransientError, match="503 #2") as raised:
        retry(failing(errors), RetryPolicy(attempts=3, first_delay=0.1), t)
    assert len(t.sleeps) == 2  # three tries, two waits
    assert "gave up after 3 attempts" in raised.value.__notes__[0]


def test_time_is_bounded() -> None:
    t = FakeTime()
    errors: list[Exception] = [TransientError("503")] * 100
    policy = RetryPolicy(attempts=100, first_delay=1.0, max_delay=4.0, deadline=10.0)
    with pytest.raises(TransientError):
        retry(failing(errors), policy, t, rand=1.0)
    # Waits 1, 2, 4 (7 s); the next 4 s wait would end past the 10 s deadline.
    assert t.sleeps == [1.0, 2.0, 4.0]
    assert t.now - 100.0 <= policy.deadline


def test_retry_state_serves_a_resuming_loop() -> None:
    """A download that resumes after each transient error shares one budget."""
    t = FakeTime()
    state = RetryState(
        RetryPolicy(attempts=3, first_delay=0.5),
        is_transient,
        clock=t.clock,
        sleep=t.sleep,
        rand=lambda: 0.0,
    )
    state.failed(TransientError("reset"))
    state.failed(TransientError("reset"))
    with pytest.raises(TransientError):
        state.failed(TransientError("reset"))
    assert t.sleeps == [0.25, 0.5]


def test_reset_gives_a_fresh_budget_after_progress() -> None:
    """After ``reset`` the tries, the deadline and the waits count from then on."""
    t = FakeTime()
    state = RetryState(
        RetryPolicy(attempts=2, first_delay=1.0, deadline=5.0),
        is_transient,
        clock=t.clock,
        sleep=t.sleep,
        rand=lambda: 1.0,
    )
    state.failed(TransientError("cut"))
    t.now += 60.0  # far past the deadline: a long stretch of progress
    state.reset()
    state.failed(TransientError("cut"))  # the first try of a new stretch: one wait
    with pytest.raises(TransientError, match="stuck") as raised:
        state.failed(TransientError("stuck"))
    assert "gave up after 2 attempts in 1.0s" in raised.value.__notes__[0]
    assert t.sleeps == [1.0, 1.0]  # the waits start again from the first delay


# --- the GCS classifier ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "message", "expected"),
    [
        (429, "rate limit", TransientError),
        (503, "backend error", TransientError),
        (500, "internal", TransientError),
        (408, "timeout", TransientError),
        (403, "forbidden", PermissionDenied),
        (401, "login required", PermissionDenied),
        (404, "no such object", ObjectNotFound),
        (412, "conditionNotMet", PreconditionFailed),
        (400, 'Provided CRC32C "AAAA" doesn\'t match calculated CRC32C "BBBB".', DamagedInTransit),
        (400, "invalid argument", ObjectStoreError),
    ],
)
def test_gcs_errors_are_classified(status: int, message: str, expected: type[Exception]) -> None:
    pytest.importorskip("google.cloud.storage")
    from google.api_core import exceptions as gapi

    from mtc_replicator.storage.gcs import translate

    error = gapi.from_http_status(status, message)  # type: ignore[no-untyped-call]
    mapped = translate(error, "get b/k")
    assert type(mapped) is expected


def test_gcs_transport_errors_are_transient() -> None:
    pytest.importorskip("google.cloud.storage")
    import google.auth.exceptions as gauth
    import requests
    from google.cloud.storage.exceptions import DataCorruption

    from mtc_replicator.storage.gcs import translate

    for exc in [
        requests.ConnectionError("reset"),
        requests.Timeout("slow"),
        requests.exceptions.ChunkedEncodingError("cut"),
        gauth.TransportError("dns"),  # type: ignore[no-untyped-call]
        DataCorruption(None, "crc32c mismatch"),
        TimeoutError(),
    ]:
        assert isinstance(translate(exc, "op"), TransientError), exc
    no_credentials = gauth.DefaultCredentialsError("none")  # type: ignore[no-untyped-call]
    none = translate(no_credentials, "op")
    assert isinstance(none, NoCredentials)
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(none)
    assert "metadata server" in str(none)
    refused = gauth.RefreshError("revoked")  # type: ignore[no-untyped-call]
    assert type(translate(refused, "op")) is PermissionDenied
    assert translate(KeyError("bug"), "op") is None
