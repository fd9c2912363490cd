#!/usr/bin/env bash
# Issue 38's figures that need more cores than the build box has, in one run on a lent
# machine (16 cores there): how a node's replication scales with 1, 2, 8 and 16 cores
# (bench_cores.py), and peer restores between two nodes with 8 cores each against the raw
# copy (bench_restore.py --node-cores). Sized to end within one device call (10 minutes);
# each bench has its own time limit, so what finished comes back when one runs over.
#
#   scripts/device_wheels.sh          # here, first: the packages that machine lacks, in .whl
#   device run, carry [".whl"]:  OUT=$OUT bash scripts/device_cores.sh
#
# Locally, smaller: CORES=1,2 NODE_CORES=1 STEP_MIB=256 RESTORE_MIB=256 scripts/device_cores.sh
# (FILES, 16 by default, sets the files of each step bench_cores.py saves.)
# Results: $OUT/cores.json, $OUT/restore.txt, $OUT/log (everything printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
CORES=${CORES:-1,2,8,16}
NODE_CORES=${NODE_CORES:-8}
STEP_MIB=${STEP_MIB:-512}
FILES=${FILES:-16}  # FILES=1: an item of one file (a PyTorch rank), whose upload goes in ranges
RESTORE_MIB=${RESTORE_MIB:-1024}
exec > >(tee "$OUT/log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! "$PY" -c 'import mtc_replicator.node.daemon' 2>/dev/null; then
  # The daemon's packages from .whl (scripts/device_wheels.sh), at the versions tested.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
  "$PY" -c 'import mtc_replicator.node.daemon' || exit 1
fi
"$PY" -c 'import os, platform; print("python", platform.python_version(), "cores", len(os.sched_getaffinity(0)), "kernel", platform.release())'
# Whether a pinned process is held to its core here (a sandbox may accept the call and
# not enforce it): four busy threads under taskset -c 0 should keep about 1 core busy.
"$PY" - <<'PY'
import os, subprocess, sys, time
code = "import hashlib, threading\nb = bytes(64 << 20)\nts = [threading.Thread(target=lambda: [hashlib.sha256(b) for _ in range(6)]) for _ in range(4)]\n[t.start() for t in ts]; [t.join() for t in ts]"
t0, c0 = time.perf_counter(), os.times()
subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], check=True)
wall, c1 = time.perf_counter() - t0, os.times()
busy = (c1.children_user - c0.children_user + c1.children_system - c0.children_system) / wall
print(f"taskset -c 0, four hashing threads: {busy:.2f} cores busy ({'enforced' if busy < 1.3 else 'NOT enforced: the per-core figures below do not isolate'})")
PY
timeout 330 "$PY" scripts/bench_cores.py --cores "$CORES" --step-mib "$STEP_MIB" --files "$FILES" \
  --saves 2 --warmup 1 --rounds 2 --json > "$OUT/cores.json"
echo "bench_cores: exit $?"; cat "$OUT/cores.json"
timeout 180 "$PY" scripts/bench_restore.py --node-cores "$NODE_CORES" --size-mib "$RESTORE_MIB" \
  --rounds 3 --backup-rounds 0 > "$OUT/restore.txt"
echo "bench_restore: exit $?"; cat "$OUT/restore.txt"
