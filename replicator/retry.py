"""Retries with jittered exponential backoff, bounded in attempts and in time. Pure.

Whether an error is worth another try is the caller's decision (each storage backend has one
function for it); this module only decides how long to wait and when to give up. Clock,
sleep and randomness are injected so tests never wait.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one operation before its error is final."""

    attempts: int = 8
    """Tries in all, the first included; 1 means no retry."""
    first_delay: float = 0.2
    """Seconds before the second try (before jitter)."""
    max_delay: float = 10.0
    """No single wait is longer, however many tries failed."""
    deadline: float = 120.0
    """No wait starts that would end later than this many seconds after the first try."""
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if not 0 <= self.first_delay <= self.max_delay:
            raise ValueError(f"need 0 <= first_delay <= max_delay, got {self}")
        if self.deadline < 0 or self.multiplier < 1:
            raise ValueError(f"need deadline >= 0 and multiplier >= 1, got {self}")

    def delay(self, failures: int, rand: float) -> float:
        """The wait after ``failures`` failed tries, for ``rand`` uniform in [0, 1).

        "Equal jitter": half the exponential step is kept, half is random, so waits still
        grow under throttling while many clients spread out instead of retrying in step.
        """
        step = min(self.max_delay, self.first_delay * self.multiplier ** (failures - 1))
        return step / 2 + step / 2 * rand


NO_RETRY = RetryPolicy(attempts=1)


class Backoff:
    """The retry state of one operation: call ``failed`` with each error it raises.

    Usable around a plain call (``call_with_retry``) and inside loops that resume where
    they stopped, such as a download that reopens at the last byte it received.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        is_transient: Callable[[BaseException], bool],
        *,
        what: str = "operation",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.policy = policy
        self.is_transient = is_transient
        self.what = what
        self.clock = clock
        self.sleep = sleep
        self.rand = rand
        self.failures = 0
        self.started = clock()

    def failed(self, exc: BaseException) -> None:
        """Wait before the next try, or re-raise ``exc`` when it is final."""
        self.failures += 1
        if not self.is_transient(exc):
            raise exc
        wait = self.policy.delay(self.failures, self.rand())
        elapsed = self.clock() - self.started
        if self.failures >= self.policy.attempts or elapsed + wait > self.policy.deadline:
            log.warning(
                "giving up on %s after %d attempts in %.1fs: %s",
                self.what,
                self.failures,
                elapsed,
                exc,
            )
            exc.add_note(f"gave up after {self.failures} attempts in {elapsed:.1f}s")
            raise exc
        log.info(
            "retrying %s in %.2fs (attempt %d of %d failed): %s",
            self.what,
            wait,
            self.failures,
            self.policy.attempts,
            exc,
        )
        self.sleep(wait)


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    *,
    what: str = "operation",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
    """``fn()``, tried again after transient errors as ``policy`` allows."""
    backoff = Backoff(policy, is_transient, what=what, clock=clock, sleep=sleep, rand=rand)
    while True:
        try:
            return fn()
        except Exception as exc:  # is_transient decides; anything else is re-raised
            backoff.failed(exc)


def call_translated(
    fn: Callable[[], T],
    policy: RetryPolicy,
    translate: Callable[[BaseException, str], BaseException | None],
    is_transient: Callable[[BaseException], bool],
    *,
    what: str,
) -> T:
    """``fn()`` with a vendor's errors mapped once to ours by ``translate`` (None: not a
    storage error, raised as it is), then retried while ``is_transient`` says so."""

    def attempt() -> T:
        try:
            return fn()
        except Exception as exc:
            mapped = translate(exc, what)
            if mapped is None or mapped is exc:
                raise
            raise mapped from exc

    return call_with_retry(attempt, policy, is_transient, what=what)
