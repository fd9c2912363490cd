"""When a handshake file (``replicator.yaml``) is settled enough to judge. Pure: no I/O, no
clock; the daemon reads the file, parses it, and passes the times it observed.

A non-atomic writer's half can parse as a whole config (a truncated job name, or `nodes: 1`
of `nodes: 16`), so what was read is judged only once its writer is done with it: renamed
into place (complete by the protocol), closed after writing and unchanged since, or, when
the close event was lost, unchanged for the ``.save`` settle time. A partial or empty file
is re-read until ``config_wait_seconds`` have passed, then judged as it is; an empty file
renamed into place is final at once (a job's end, ``client.finish_job``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Reading(enum.Enum):
    """What the text read parses as (``core.contract.parse_config``)."""

    EMPTY = "empty"
    """Nothing but whitespace: the writer may not have begun."""
    INCOMPLETE = "incomplete"
    """A required key is missing: the writer may not be done."""
    INVALID = "invalid"
    """Wrong whatever comes next."""
    VALID = "valid"


class Act(enum.Enum):
    """What to do with the handshake now."""

    WAIT = "wait"
    """Read it again in ``Judgement.recheck_in`` seconds."""
    ACCEPT = "accept"
    REJECT = "reject"
    """Refuse it (``replicator.failed``) and remove it."""
    CLEAR = "clear"
    """An empty file stayed empty: stop the running job and remove it."""


@dataclass(frozen=True)
class SettleRules:
    settle_seconds: float
    """How long a file must stay unchanged to count as finished without a close event."""
    config_wait_seconds: float
    """How long a partial or empty file is re-read before it is judged as it is."""
    valid_settle: float = 0.1
    """A valid handshake written in place must read the same twice this far apart."""
    invalid_settle: float = 1.0
    """An invalid one, this far apart: a writer between two writes gets that long."""
    poll: float = 0.05
    """The longest wait between two reads of a pending file: an in-place write may come
    without any event, and only a re-read sees it."""


@dataclass(frozen=True)
class Reads:
    """The same handshake text read one or more times (times from a monotonic clock)."""

    text: str
    first_seen: float
    """When a handshake was first read: where a restore's timeline starts."""
    changed_at: float
    """When the text last read differently."""

    def again(self, text: str, now: float) -> Reads:
        """These reads after one more read of ``text`` at ``now``."""
        return self if text == self.text else replace(self, text=text, changed_at=now)


def observe(previous: Reads | None, text: str, now: float) -> Reads:
    """``previous`` after a read of ``text`` at ``now``; a new record when there was none."""
    return Reads(text, now, now) if previous is None else previous.again(text, now)


@dataclass(frozen=True)
class Judgement:
    act: Act
    waited: float
    """Seconds since the handshake was first read."""
    timed_out: bool = False
    """Rejected because a partial file did not complete within ``config_wait_seconds``."""
    recheck_in: float = 0.0
    """With ``Act.WAIT``: when to read it again."""


def judge(
    rules: SettleRules,
    reads: Reads,
    reading: Reading,
    now: float,
    *,
    closed: bool,
    renamed: bool,
) -> Judgement:
    """What to do with the handshake ``reads`` hold, parsed as ``reading``.

    ``closed``: its writer closed it after writing or renamed it into place (the flag
    taken before the read, so that it covers the text read); ``renamed``: renamed into
    place with no write since, so complete as it appeared.
    """
    stable = now - reads.changed_at
    waited = now - reads.first_seen
    finished = closed or stable >= rules.settle_seconds
    if reading is Reading.EMPTY:
        # Renamed into place empty (``client.finish_job``): no writer is coming, it says
        # "stop" as it is. Written in place, it may be a writer that has not begun yet.
        if renamed or waited >= rules.config_wait_seconds:
            return Judgement(Act.CLEAR, waited)
    elif reading is Reading.INCOMPLETE:
        if closed and stable >= rules.valid_settle:
            # Closed or renamed into place and unchanged since: nothing more is coming, so
            # the missing key is final. Without the event (an in-place writer that has not
            # closed it, or a lost event) the bounded wait applies.
            return Judgement(Act.REJECT, waited)
        if waited >= rules.config_wait_seconds:
            return Judgement(Act.REJECT, waited, timed_out=True)
    elif reading is Reading.INVALID:
        if stable >= rules.invalid_settle and finished:
            return Judgement(Act.REJECT, waited)
    elif renamed or (stable >= rules.valid_settle and finished):  # Reading.VALID
        # Renamed into place (Orbax, MaxText, our client): complete by the protocol, so the
        # double read that guards in-place writers would only delay every restore.
        return Judgement(Act.ACCEPT, waited)
    return Judgement(Act.WAIT, waited, recheck_in=_recheck_in(rules, reads, now))


def _recheck_in(rules: SettleRules, reads: Reads, now: float) -> float:
    """The next moment a verdict may change, or the poll interval if that comes first."""
    deadlines = (
        reads.changed_at + rules.valid_settle,
        reads.changed_at + rules.invalid_settle,
        reads.changed_at + rules.settle_seconds,
        reads.first_seen + rules.config_wait_seconds,
    )
    return min([rules.poll, *(d - now for d in deadlines if d > now)])
