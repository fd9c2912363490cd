"""``mtc backups download``: one committed step into a directory, verified. Wiring only.

The download itself, and every check on it, is ``mtc_replicator.storage.step_download``.
"""

from __future__ import annotations

import argparse
import json

from mtc_replicator.core import argtypes
from mtc_replicator.core.humanize import human_bytes
from mtc_replicator.core.manifest import CorruptItem
from mtc_replicator.storage import step_download as dl
from mtc_replicator.storage.backup import BackupStore
from mtc_replicator.storage.objectstore import ObjectStore
from mtc_replicator.tools import progress_bars

DownloadError = dl.DownloadError


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--step", type=argtypes.count, required=True, help="the committed step")
    c.add_argument(
        "--rank",
        type=argtypes.count,
        help="only this node rank's items (default: every rank's)",
    )
    c.add_argument(
        "--to",
        type=argtypes.path,
        required=True,
        metavar="DIR",
        help="where the items go, one per worker as DIR/n<rank>-w<worker>",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="download into a non-empty DIR, replacing the items' names there",
    )
    c.add_argument("--json", action="store_true", help="one JSON document on stdout")


def run(args: argparse.Namespace, objects: ObjectStore, now: float) -> int:
    """Plan, check the target, download; raises what ``mtc backups`` turns into exit 1."""
    store = BackupStore(objects, args.trust)
    dl.check_target(args.to, force=args.force)
    try:
        plan = dl.plan_download(store, args.job, args.step, args.rank, args.attested)
    except CorruptItem as exc:
        raise DownloadError(f"{exc}: nothing was written to {args.to}") from None
    bar = progress_bars.bar(args, plan.total_bytes, f"download {args.job} step {args.step}")
    try:
        made = dl.download(store, plan, args.to, force=args.force, progress=bar)
    except CorruptItem as exc:
        raise DownloadError(f"{exc}: nothing was written to {args.to}") from None
    except OSError as exc:
        raise DownloadError(
            f"cannot write to {args.to}: {exc}; nothing was left there, and names it "
            "already held are as they were"
        ) from None
    finally:
        bar.close()
    if args.json:
        body = {
            "url": objects.url,
            "job": args.job,
            "step": args.step,
            "to": str(args.to),
            "bytes": plan.total_bytes,
            "items": [
                {"rank": i.rank, "worker": i.worker, "path": str(p), "bytes": m.total_bytes}
                for (i, m), p in zip(plan.items, made, strict=True)
            ],
        }
        print(json.dumps(body, indent=2, sort_keys=True))
    else:
        size = human_bytes(plan.total_bytes)
        print(
            f"job {args.job} step {args.step}: {len(made)} item(s), {size}, verified, in {args.to}"
        )
    return 0
