"""What content digests cost a local restore as the training job sees it, in one run.

Two 2-node jobs of real daemons with mutual TLS on tmpfs (``scripts/bench_restore.py``'s
``Job``), each rank holding its own ``--size-mib`` item: one as this version writes it
(format-2 manifests, every file's BLAKE3 digest, attested by its producer), one whose
stored manifests were rewritten as format 1 (crc32c only, no attestation: what a restore
checked before digests), restored under ``--accept-unsigned-records``. Rounds interleave
the two; each is the job's restart with nothing lost (every rank verifies its own copy),
timed from the handshake to the last rank's marker, as ``bench_restore.py``'s local case.

    .venv/bin/python scripts/bench_restore_digests.py --size-mib 1024 [--rounds 9]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.core.manifest import LEGACY_VERSION, Manifest  # noqa: E402
from scripts.bench_restore import SHM, STEP, Job, first_start  # noqa: E402
from tests.integration.helpers import store_root  # noqa: E402


def legacy_manifests(job: Job) -> int:
    """Rewrite every stored manifest of ``job``'s step as format 1; how many (daemons down)."""
    count = 0
    for d in job.dirs:
        for path in (store_root(d) / "items" / job.name / str(STEP)).glob("*/MANIFEST.json"):
            m = Manifest.from_json(path.read_bytes())
            files = tuple(replace(f, blake3=None) for f in m.files)
            old = replace(m, files=files, version=LEGACY_VERSION, attestation=None)
            path.write_bytes(old.to_json())
            count += 1
    return count


def prepared(root: Path, size_mib: int, *, legacy: bool) -> Job:
    extra = ("--accept-unsigned-records",) if legacy else ()
    job = Job(root, 2, extra=extra)
    for r in range(job.nodes):
        job.start(r)
    first_start(job)
    job.save(STEP, size_mib)
    if legacy:
        job.stop_all()
        if legacy_manifests(job) != 2 * job.nodes:
            raise RuntimeError("expected every rank's item and its peer copy")
        for r in range(job.nodes):
            job.start(r)
    return job


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mtc-bench-digests-", dir=SHM))
    jobs: dict[str, Job] = {}
    try:
        jobs["crc32c only (format 1)"] = prepared(root / "legacy", a.size_mib, legacy=True)
        jobs["digests (format 2, attested)"] = prepared(root / "digests", a.size_mib, legacy=False)
        times: dict[str, list[float]] = {k: [] for k in jobs}
        for i in range(a.rounds):
            order = list(jobs) if i % 2 == 0 else list(jobs)[::-1]
            for name in order:
                job = jobs[name]
                times[name].append(job.restore(STEP))
                if {job.source(r) for r in range(job.nodes)} != {"local"}:
                    raise RuntimeError(f"{name}: a rank did not restore its local copy")
            print(f"round {i + 1}:" + "".join(f"  {k}: {v[-1]:.3f}s" for k, v in times.items()))
        base, new = (statistics.median(v) for v in times.values())
        least_base, least_new = (min(v) for v in times.values())
        print(f"\nlocal restore of {a.size_mib} MiB per rank, 2 ranks, handshake to last marker")
        for name, v in times.items():
            print(f"  {name:32} median {statistics.median(v):.3f}s  least {min(v):.3f}s")
        print(f"  ratio: median {new / base:.2f}x, least {least_new / least_base:.2f}x")
    finally:
        for job in jobs.values():
            job.stop_all()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
