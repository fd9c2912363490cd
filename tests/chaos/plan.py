"""What a chaos trial does, decided from its seed alone: pure, no I/O.

A trial is a job of four ranks that lives through a few incarnations (epochs). In each, the
job saves a few steps while faults hit the nodes; then it restarts, and the harness checks
the restore. The same seed always gives the same plan, so a failing trial replays from its
seed (its timing, on a loaded box, varies around the plan's).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

NODE_FAULTS = ("kill", "lose")
NET_FAULTS = ("isolate", "cut-coordinator", "cut-peers")
PROXY_MODES = ("slowdown", "reset", "cut", "latency")
IN_ROUND = -1
"""``Fault.after_save`` of a fault that hits while the job waits for its restore markers."""


@dataclass(frozen=True)
class Fault:
    kind: str
    """``kill`` (SIGKILL, the RAM disk kept), ``lose`` (SIGKILL and the RAM disk gone: the
    node's CHECKPOINT_DIR and store), ``isolate`` / ``cut-coordinator`` / ``cut-peers``
    (a partition), or ``store`` (the backup misbehaves)."""
    rank: int
    """The node hit (-1 for ``store``)."""
    after_save: int
    """Index of the epoch's save after which it starts, or ``IN_ROUND``."""
    delay: float
    """Seconds after that save (or after the job's restart began)."""
    duration: float
    """Seconds the daemon stays down, the partition or the store fault lasts."""
    mode: str = ""
    """A store fault's mode: one of ``PROXY_MODES``, or ``full`` for ``file://``."""

    def describe(self) -> str:
        when = (
            "in the restore round"
            if self.after_save == IN_ROUND
            else f"after save {self.after_save}"
        )
        what = f"store {self.mode}" if self.kind == "store" else f"{self.kind} rank {self.rank}"
        return f"{what} {when} +{self.delay:.1f}s for {self.duration:.1f}s"


@dataclass(frozen=True)
class Epoch:
    saves: int
    """Steps the incarnation saves (every 10 steps) before it ends."""
    faults: tuple[Fault, ...]
    restart_delay: float
    """Seconds between the last heal (or daemon restart) and the job's restart: 0 is at once."""
    order: tuple[int, ...] = ()
    """The order the ranks' handshakes arrive in at the restart (empty: seeded shuffle)."""
    torn: tuple[int, ...] = ()
    """Ranks that publish one more step just before the restart (the job died mid-save)."""


@dataclass(frozen=True)
class Plan:
    seed: int
    backend: str
    """``file``, ``full`` (``file://`` on a tiny tmpfs), ``s3`` or ``gcs``."""
    interval: int
    """``backup-interval-steps`` of the job."""
    epochs: tuple[Epoch, ...]
    keys: tuple[tuple[str, object], ...] = ()
    """Other ``replicator.yaml`` keys (``config_text``'s spelling), for fixed scenarios."""
    flags: tuple[str, ...] = ()
    """Daemon flags after the fast timers (a fixed scenario's default rescan, say)."""

    def describe(self) -> list[str]:
        lines = [
            f"seed {self.seed}: backup {self.backend}, backup every {self.interval} saves"
            + (f", daemon flags {' '.join(self.flags)}" if self.flags else "")
        ]
        for i, e in enumerate(self.epochs):
            faults = "; ".join(f.describe() for f in e.faults) or "no fault"
            torn = f"; ranks {list(e.torn)} publish one more step and die" if e.torn else ""
            lines.append(
                f"  incarnation {i + 1}: {e.saves} saves; {faults}{torn}; "
                f"restart +{e.restart_delay:.1f}s"
            )
        return lines


def make_plan(seed: int, *, nodes: int, netns: bool, backends: Sequence[str]) -> Plan:
    """The plan of trial ``seed``; ``netns`` says whether partitions can be made here."""
    rng = random.Random(seed)
    backend = rng.choice(sorted(backends))
    kinds = [*NODE_FAULTS, *NODE_FAULTS, *(NET_FAULTS if netns else ())]
    if backend != "file":
        kinds += ["store", "store"]
    epochs = []
    for _ in range(rng.choice((1, 2, 2, 3))):
        saves = rng.randint(2, 4)
        faults: list[Fault] = []
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            kind = rng.choice(kinds)
            if kind == "lose" and any(f.kind == "lose" for f in faults):
                kind = "kill"  # one RAM disk lost per incarnation: two may lose a rank's every copy
            rank = -1 if kind == "store" else rng.randrange(nodes)
            after = rng.randrange(saves)
            delay = rng.uniform(0.0, 1.5)
            if kind in ("kill", *NET_FAULTS) and rng.random() < 0.25:
                after = IN_ROUND
                delay = rng.uniform(0.0, 0.3)  # a round on tiny steps lasts well under a second
            if kind == "cut-coordinator" and rank == 0:
                kind = "cut-peers"
            mode = ""
            if kind == "store":
                mode = "full" if backend == "full" else rng.choice(PROXY_MODES)
            duration = rng.uniform(0.0, 2.0) if kind in NODE_FAULTS else rng.uniform(1.0, 6.0)
            faults.append(Fault(kind, rank, after, delay, duration, mode))
        faults.sort(key=lambda f: (f.after_save == IN_ROUND, f.after_save, f.delay))
        restart = 0.0 if rng.random() < 0.5 else rng.uniform(0.0, 3.0)
        # Drawn apart, so that adding this kept every other draw of the seed as it was.
        tear = random.Random(f"{seed}/torn/{len(epochs)}")
        torn = tuple(sorted(tear.sample(range(nodes), tear.randint(1, nodes - 1))))
        epochs.append(
            Epoch(saves, tuple(faults), restart, torn=torn if tear.random() < 0.3 else ())
        )
    # Half the trials keep the daemons' default rescan (2 s): the fast one hid issue 23's
    # wedge, whose new agent ingested a leftover step before it joined.
    slow = random.Random(f"{seed}/rescan").random() < 0.5
    flags = ("--rescan-seconds", "2") if slow else ()
    return Plan(seed, backend, rng.choice((1, 2)), tuple(epochs), flags=flags)
