"""Sticky ranks, measured: a job restarted with its pods on the nodes in a random order.

Real daemons (``--nodes``, 8 by default) on tmpfs (``/dev/shm``), mutual TLS with per-node
certificates, a ``file://`` backup; each rank saves ``--size-mib``. Then, in one run, each
of ``--rounds`` times, the job restarts on a new random placement twice: once with each pod
keeping its index (what a JobSet or Indexed Job does), once with ranks chosen where the
bytes are (the controller's code: every daemon asked what it holds, ``core.ranks``). Per
case: ranks restored from their own node, and the restore round's seconds (first
``replicator.yaml`` to last marker). Then the same with one node replaced (its RAM disk and
store wiped). Larger jobs are simulated (``core.ranks`` on the holdings ``core.layout``
gives each node: its own rank and one peer's copy).

    .venv/bin/python scripts/bench_ranks.py [--nodes 8] [--size-mib 32] [--rounds 3] [--json]

Numbers are only comparable within one run: this machine's two cores are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.core.contract import Framework, JobConfig  # noqa: E402
from mtc_replicator.core.layout import pushers  # noqa: E402
from mtc_replicator.core.ranks import Pod, assign  # noqa: E402
from tests.integration.cluster import Cluster, running  # noqa: E402
from tests.integration.permuted import (  # noqa: E402
    Restart,
    by_index,
    placement,
    restart,
    sticky,
)


def simulated(nodes: int, seeds: int = 5) -> dict[str, float]:
    """Mean fraction of ranks local over ``seeds`` random placements, with one peer per node:
    by index, sticky, and sticky with one node replaced."""
    config = JobConfig("j", Framework.PYTORCH, 0, nodes, peers_per_node=1)
    held = {f"n{r}": {h: {1} for h in (r, *pushers(config, r))} for r in range(nodes)}
    plain, kept, replaced = [], [], []
    for seed in range(seeds):
        placed = placement(nodes, seed)
        pods = [Pod(f"p{i}", i, f"n{node}") for i, node in enumerate(placed)]
        a = assign(pods, held, nodes)
        plain.append(a.by_index / nodes)
        kept.append(a.local / nodes)
        lost = {**held, f"n{placed[0]}": {}}
        replaced.append(assign(pods, lost, nodes).local / nodes)
    return {
        "by_index": statistics.mean(plain),
        "sticky": statistics.mean(kept),
        "one_replaced": statistics.mean(replaced),
    }


SHM = Path("/dev/shm")  # noqa: S108 (tmpfs, where a RAM disk lives)


def measured(nodes: int, size_mib: int, rounds: int) -> dict[str, list[Restart]]:
    base = SHM if SHM.is_dir() else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="bench-ranks-", dir=base))
    out: dict[str, list[Restart]] = {"by_index": [], "sticky": [], "one_replaced": []}
    try:
        cluster = Cluster(root, f"ranks-{uuid.uuid4().hex[:6]}", nodes=nodes)
        # The daemons' log tails, which ``running`` prints at the end, are for tests.
        with contextlib.redirect_stdout(io.StringIO()), running(cluster) as c:
            tls = c.tls[0].material() if c.tls[0] is not None else None
            c.fresh_start()
            c.write_step(5, sizes=dict.fromkeys(range(nodes), size_mib << 20))
            c.wait_saved(5)
            for r in range(rounds):
                out["by_index"].append(restart(c, by_index(placement(nodes, 100 + r)), 5))
                out["sticky"].append(restart(c, sticky(c, placement(nodes, 200 + r), tls), 5))
            c.wipe(nodes - 1)
            out["one_replaced"].append(restart(c, sticky(c, placement(nodes, 300), tls), 5))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--size-mib", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    real = measured(args.nodes, args.size_mib, args.rounds)
    sims = {n: simulated(n) for n in (64, 256, 1024)}
    report: dict[str, Any] = {
        "nodes": args.nodes,
        "size_mib": args.size_mib,
        "measured": {
            case: {
                "local": [r.local for r in runs],
                "seconds": [round(r.seconds, 3) for r in runs],
            }
            for case, runs in real.items()
        },
        "simulated": sims,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.nodes} real daemons, {args.size_mib} MiB per rank, one peer per node")
    print(f"{'case':<14} {'ranks local (per restart)':<28} {'median round s':>14}")
    for case, runs in real.items():
        locals_ = ", ".join(f"{r.local}/{args.nodes}" for r in runs)
        median = statistics.median(r.seconds for r in runs)
        print(f"{case:<14} {locals_:<28} {median:>14.2f}")
    print("\nsimulated (mean fraction of ranks local over 5 placements)")
    print(f"{'nodes':>6} {'by index':>9} {'sticky':>7} {'one replaced':>13}")
    for n, s in sims.items():
        print(f"{n:>6} {s['by_index']:>9.3f} {s['sticky']:>7.3f} {s['one_replaced']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
