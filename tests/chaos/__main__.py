"""``make chaos``: run seeded chaos trials against real daemons and summarise them.

``python -m tests.chaos --trials 100 --seed 0`` runs seeds 0..99; a failing trial prints its
seed, its plan, the daemons' log tails and the command that replays it alone. Needs root for
the per-node tmpfs and network namespaces (without, it runs on loopback, no partitions).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos import network
from tests.chaos.harness import Result, Trial
from tests.chaos.nodes import Servers
from tests.chaos.plan import make_plan
from tests.integration.cluster import NODES

BACKENDS = ("file", "full", "s3", "gcs") if os.geteuid() == 0 else ("file", "s3", "gcs")
"""``full`` fills a tmpfs of its own, which only root can mount."""


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _timing(values: list[float]) -> str:
    if not values:
        return "none"
    return (
        f"median {statistics.median(values):.1f}s, p99 {_percentile(values, 0.99):.1f}s, "
        f"max {max(values):.1f}s ({len(values)} samples)"
    )


def log_tails(root: Path, lines: int = 25) -> str:
    """The last lines of each node's daemon log in a trial's directory."""
    out = []
    for r in range(NODES):
        log = root / f"node{r}.log"
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- node {r} ({log}) ---\n" + "\n".join(tail))
    return "\n".join(out)


def report(result: Result) -> str:
    """One trial's outcome; a failure with its replay command and the daemons' logs."""
    head = f"seed {result.seed}: {'ok' if result.ok else 'FAILED'} in {result.seconds:.0f}s"
    times = " ".join(f"{t:.1f}" for t in result.fault_to_marker)
    head += f"; steps lost {result.steps_lost}; fault to last marker (s): {times or '-'}"
    if result.ok:
        return head
    known = f"\n  known bug: {result.known}" if result.known else ""
    replay = f"PYTHONPATH=$PWD .venv/bin/python -m tests.chaos --trials 1 --seed {result.seed}"
    logs = log_tails(result.logs) if result.logs else ""
    return f"{head}\n  {result.message}{known}\n  replay: {replay}\n  logs: {result.logs}\n{logs}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the first trial's seed")
    parser.add_argument("--dir", type=Path, default=None, help="where trials run (kept on failure)")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: each trial's daemons, mounts and namespaces are removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    base = args.dir or Path(tempfile.mkdtemp(prefix="mtc-chaos-"))
    netns = network.available()
    where = "a network namespace per node" if netns else "loopback, no partitions"
    print(f"chaos: {args.trials} trials from seed {args.seed} in {base}; {where}")
    servers = Servers(base)
    results: list[Result] = []
    start = time.monotonic()
    try:
        for seed in range(args.seed, args.seed + args.trials):
            plan = make_plan(seed, nodes=NODES, netns=netns, backends=BACKENDS)
            print("\n".join(plan.describe()), flush=True)
            result = Trial(plan, base / f"seed-{seed}", servers, netns=netns).run()
            results.append(result)
            print(report(result), flush=True)
    finally:
        servers.close()
    passed = sum(r.ok for r in results)
    known = sum(bool(r.known) for r in results)
    failed = [r.seed for r in results if not r.ok]
    print(f"\ntrials passed: {passed}/{len(results)} in {time.monotonic() - start:.0f}s")
    print(f"failed seeds: {failed or 'none'} ({known} with a known bug's signature)")
    print(f"steps lost: {sum(r.steps_lost for r in results)}")
    print(f"steps rolled back by faults: {sum(r.rolled_back for r in results)}")
    print(f"fault to last marker: {_timing([t for r in results for t in r.fault_to_marker])}")
    print(f"restart to last marker: {_timing([t for r in results for t in r.restart_to_marker])}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
