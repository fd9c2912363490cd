"""Jittered exponential backoff, and the bounded storage retries built on it. Pure.

``Backoff`` is the one delay schedule of the project: the agent's waits for its coordinator
and its peers, and the few storage retries the SDKs do not make themselves (a body the
server stored damaged, a download cut off mid-body: ``resend_policy``); the SDKs retry
everything else, within ``--storage-timeout`` (``parse_storage_timeout``). Whether an error
is worth another try is the caller's decision (each storage backend has one function for
it); ``RetryState`` counts tries and gives up after so many, or so long. Clock, sleep and
randomness are injected so tests never wait.
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


class Backoff:
    """Waits that grow from ``first`` by ``multiplier`` up to ``cap``, each one jittered.

    "Equal jitter": the n-th wait is drawn from [step/2, step] with step = first *
    multiplier**(n-1), capped, so waits still grow under throttling while a cluster's
    clients spread out instead of retrying in step. The defaults suit control-plane calls
    (the coordinator, the registry). ``rand`` gives uniform numbers in [0, 1).
    """

    def __init__(
        self,
        first: float = 0.1,
        cap: float = 3.0,
        *,
        multiplier: float = 2.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 0 <= first <= cap:
            raise ValueError(f"need 0 <= first <= cap, got first={first}, cap={cap}")
        if multiplier < 1:
            raise ValueError(f"need multiplier >= 1, got {multiplier}")
        self.first = first
        self.cap = cap
        self.multiplier = multiplier
        self.rand = rand
        # The step itself, not a count of waits: a count would overflow ``multiplier**n``
        # after about a thousand waits, which a dead peer retried forever does reach.
        self._step = first

    def next(self) -> float:
        """Seconds to wait now; the next call's step is larger, up to ``cap``."""
        step = self._step
        self._step = min(self.cap, step * self.multiplier)
        return step / 2 + step / 2 * self.rand()

    def reset(self) -> None:
        """Start again from ``first``, after a success."""
        self._step = self.first


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

    def backoff(self, rand: Callable[[], float] = random.random) -> Backoff:
        """The waits between this policy's tries, the first one before the second try."""
        return Backoff(self.first_delay, self.max_delay, multiplier=self.multiplier, rand=rand)


NO_RETRY = RetryPolicy(attempts=1)

DEFAULT_STORAGE_TIMEOUT = 300.0
"""``--storage-timeout``: seconds one object-store request may take with its retries."""
MAX_STORAGE_TIMEOUT = 86_400.0


def parse_storage_timeout(text: str) -> float:
    """``--storage-timeout`` as given: seconds, more than 0 and at most a day."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds, e.g. 300, got {text!r}") from None
    if not 0 < value <= MAX_STORAGE_TIMEOUT:  # NaN fails too
        raise ValueError(f"must be more than 0 and at most {MAX_STORAGE_TIMEOUT:g} s, got {text!r}")
    return value


def resend_policy(deadline: float) -> RetryPolicy:
    """For what the SDKs do not retry: bytes a server reports damaged after a successful
    request, and downloads cut off mid-body (resumed where they stopped)."""
    return RetryPolicy(attempts=3, first_delay=0.2, max_delay=2.0, deadline=deadline)


class RetryState:
    """The retry state of one operation: call ``failed`` with each error it raises.

    Usable around a plain call (``call_with_retry``) and inside loops that resume where
    they stopped, such as a download that reopens at the last byte it received (such a
    loop calls ``reset`` when the try that failed had made progress).
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
        self.backoff = policy.backoff(rand)
        self.failures = 0
        self.started = clock()

    def reset(self) -> None:
        """A fresh budget from now: tries, deadline and waits start again.

        For a resuming loop whose last try made progress (a download that received bytes
        before it was cut): the budget bounds each stretch without progress, not the
        whole operation, which may rightly last far longer than the deadline.
        """
        self.backoff.reset()
        self.failures = 0
        self.started = self.clock()

    def failed(self, exc: BaseException) -> None:
        """Wait before the next try, or re-raise ``exc`` when it is final."""
        self.failures += 1
        if not self.is_transient(exc):
            raise exc
        wait = self.backoff.next()
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
    state = RetryState(policy, is_transient, what=what, clock=clock, sleep=sleep, rand=rand)
    while True:
        try:
            return fn()
        except Exception as exc:  # is_transient decides; anything else is re-raised
            state.failed(exc)


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
