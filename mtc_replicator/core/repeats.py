"""A handshake for the job and rank this node already serves: the same one again, a
conflicting one, or a new start. Pure: the daemon says what it knows of its incarnation.

Several processes of one node that each write ``replicator.yaml`` (a launcher running
``--nproc-per-node=8`` with a client that does not elect local rank 0) send the daemon the
same handshake several times. Taken as new starts, each one restarts the incarnation, which
removes the ``<N>`` link the first process is loading through and, in a job of several nodes,
leaves this rank in a round nobody else joins. The rules here keep the contract's "a new
``replicator.yaml`` starts a new incarnation" wherever it can be a real restart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import yaml

from mtc_replicator.core.contract import JobConfig, render_config

CLIENT_DEADLINE = 300.0
"""Seconds a client waits for its markers after its ``replicator.yaml`` was consumed
(docs/protocol.md, step 8): past it, no process of the accepted handshake is still waiting."""


class Repeat(enum.Enum):
    NEW = "new"
    """Start a new incarnation (the contract's rule for a new ``replicator.yaml``)."""
    SAME = "same"
    """The accepted handshake again: consume it and serve the same restore once more."""
    CONFLICT = "conflict"
    """Another config for the same job and rank while the first one's restore is under way:
    refuse it, in ``replicator.errors``; the running restore goes on."""


@dataclass(frozen=True)
class Serving:
    """What the daemon knows of the incarnation it runs when a handshake arrives."""

    config: JobConfig
    alive: bool
    """Its work goes on: it neither failed nor stopped."""
    restoring: bool
    """Its markers are not out yet."""
    accepted_for: float
    """Seconds since its handshake was accepted (or it was resumed)."""


def judge_repeat(serving: Serving | None, new: JobConfig) -> Repeat:
    """What to do with the handshake ``new`` while ``serving`` runs.

    The same config again is the same start while the restore is under way, whatever the
    job's size: the round in progress serves it. After the markers it is a restart, as the
    contract says, even before the job saved again: in a job of several nodes a restart is
    every node's and this rank must be in the next round with the others, and in any job
    the restart may be the one an operator's restore pin waits for. A different config for
    the same job and rank while the restore is under way and a client of it may still be
    waiting is a conflict, never a restart that would fail the waiting process.
    """
    if serving is None or not serving.alive:
        return Repeat.NEW
    old = serving.config
    if (old.job_name, old.node_rank) != (new.job_name, new.node_rank):
        return Repeat.NEW  # another job (a switch) or another rank (the pod moved)
    if render_config(old) == render_config(new):
        return Repeat.SAME if serving.restoring else Repeat.NEW
    if serving.restoring and serving.accepted_for < CLIENT_DEADLINE:
        return Repeat.CONFLICT
    return Repeat.NEW


def differences(accepted: JobConfig, new: JobConfig) -> list[str]:
    """``key: accepted value -> new value`` for every key of ``replicator.yaml`` that
    differs between the two configs, in the file's order."""
    a, b = _keys(accepted), _keys(new)
    return [
        f"{key}: {_show(a.get(key))} -> {_show(b.get(key))}"
        for key in [*a, *(k for k in b if k not in a)]
        if a.get(key) != b.get(key)
    ]


def _keys(config: JobConfig) -> dict[str, Any]:
    data = yaml.safe_load(render_config(config))
    assert isinstance(data, dict)
    return data


def _show(value: object) -> str:
    return "(none)" if value is None else str(value)
