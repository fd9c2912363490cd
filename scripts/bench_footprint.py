"""What one node's stack uses: the figures behind the DaemonSet's resource requests.

Four real daemons (mutual TLS, one rank each, ``peers-per-node: 1``, a backup of every
step to ``file://``), each with its RAM disk on tmpfs (``/dev/shm``), and one real CSI
plugin (``mtc-csi``) serving its socket over a RAM disk of its own. The ranks save a step
of ``--step-mib`` each, ``--saves`` times, waiting for every step to be backed up before
the next. Measured from ``/proc``, per daemon: resident memory idle before the job, the
peak (``VmHWM``) over the run, CPU seconds per GiB of the node's own checkpoint (its
ingest, its push to its peer, the peer's copy it receives, its upload), and CPU while
idle between saves. ``--no-backup``: the same without a backup (the next save waits for
every push), to tell the tiers' shares apart. The plugin: its resident memory and CPU while idle.

    .venv/bin/python scripts/bench_footprint.py --step-mib 512 --saves 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mtc_replicator.tools import certs  # noqa: E402
from scripts.bench_scale import Node, make_tls  # noqa: E402
from tests.proc import cpu_seconds, memory_mib  # noqa: E402

JOB = "footprint"
NODES = 4
BLOCK = os.urandom(1 << 20)


def yaml_text(rank: int) -> str:
    return (
        f"job-name: {JOB}\nframework: orbax\nnode-rank: {rank}\nnodes: {NODES}\n"
        "peers-per-node: 1\nbackup-interval-steps: 1\n"
    )


def save(ckpt: Path, step: int, mib: int) -> None:
    tmp = ckpt / f"{step}.orbax-checkpoint-tmp-footprint"
    tmp.mkdir()
    with (tmp / "state").open("wb") as f:
        for _ in range(mib):
            f.write(BLOCK)
    os.rename(tmp, ckpt / str(step))


def wait_step(logs: list[Path], step: int, backup: bool, timeout: float = 60.0) -> None:
    """Until ``step`` is backed up (every rank's item committed), or without a backup,
    until every rank pushed its item to its peer."""
    if backup:
        pattern, needed = re.compile(rf"backup committed job={JOB} step={step} "), 1
    else:
        pattern, needed = re.compile(rf"pushed {JOB}/s{step}/n\d+-w\d+ to "), NODES
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(len(pattern.findall(p.read_text(errors="replace"))) for p in logs) >= needed:
            return
        time.sleep(0.2)
    tail = "\n".join(logs[0].read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(
        f"step {step} was not {'backed up' if backup else 'pushed'} in time; {logs[0]}:\n{tail}"
    )


def start_plugin(root: Path) -> subprocess.Popen[bytes]:
    """The CSI plugin over a RAM disk (a tmpfs it mounts: root only) of its own."""
    env = {
        **os.environ,
        "MTC_CSI_ENDPOINT": f"unix://{root}/csi/csi.sock",
        "MTC_CSI_NODE_ID": "node-footprint",
        "MTC_RAM_DIR": str(root / "plugin-ram"),
        "MTC_RAM_SIZE": "64Mi",
        "MTC_CSI_ALLOWED_NAMESPACES": "default",
    }
    (root / "csi").mkdir()
    log = (root / "plugin.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtc_replicator.csi.plugin"], env=env, stdout=log, stderr=log
    )
    deadline = time.monotonic() + 30
    while not (root / "csi" / "csi.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((root / "plugin.log").read_text())
        time.sleep(0.05)
    return proc


def measure(args: argparse.Namespace, root: Path) -> dict[str, object]:
    ram = Path(tempfile.mkdtemp(prefix="mtc-footprint-", dir="/dev/shm"))
    backup = root / "backup"
    backup.mkdir()
    ca = certs.new_ca()
    nodes: list[Node] = []
    plugin = None
    try:
        for rank in range(NODES):
            ckpt = ram / f"node{rank}" / "ckpt"
            ckpt.mkdir(parents=True)
            tls = make_tls(root, ca, f"node{rank}")
            argv = [sys.executable, "-m", "mtc_replicator.node.daemon", "--checkpoint-dir"]
            argv += [str(ckpt), "--listen", "127.0.0.1:0"]
            # Without a backup, the bucket's directory is the job's registry alone.
            argv += ["--registry" if args.no_backup else "--backup", backup.as_uri()]
            argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
            argv += ["--tls-ca", str(tls.ca)]
            nodes.append(Node(rank, ckpt, argv, root / f"node{rank}.log"))
        for node in nodes:
            node.start()
        if os.geteuid() == 0:
            plugin = start_plugin(root)
        time.sleep(args.idle_seconds)
        pids = [n.proc.pid for n in nodes if n.proc is not None]
        idle_rss = [memory_mib(p, "VmRSS") for p in pids]
        for node in nodes:
            tmp = node.ckpt / "replicator.yaml.tmp"
            tmp.write_text(yaml_text(node.rank))
            os.rename(tmp, node.ckpt / "replicator.yaml")
        time.sleep(2)
        cpu_before = [cpu_seconds(p) for p in pids]
        started = time.monotonic()
        for i in range(args.saves):
            step = (i + 1) * 10
            for node in nodes:
                save(node.ckpt, step, args.step_mib)
            wait_step([n.log for n in nodes], step, backup=not args.no_backup)
        busy = time.monotonic() - started
        cpu_saves = [cpu_seconds(p) - c for p, c in zip(pids, cpu_before, strict=True)]
        cpu_idle0 = [cpu_seconds(p) for p in pids]
        time.sleep(args.idle_seconds)
        cpu_idle = [cpu_seconds(p) - c for p, c in zip(pids, cpu_idle0, strict=True)]
        peak = [memory_mib(p, "VmHWM") for p in pids]
        after = [memory_mib(p, "VmRSS") for p in pids]
        gib = args.saves * args.step_mib / 1024
        result: dict[str, object] = {
            "backup": "none" if args.no_backup else "file://, every step",
            "step_mib_per_rank": args.step_mib,
            "saves": args.saves,
            "seconds_for_the_saves": round(busy, 1),
            "replicator_rss_idle_mib": [round(x) for x in idle_rss],
            "replicator_rss_after_mib": [round(x) for x in after],
            "replicator_peak_rss_mib": [round(x) for x in peak],
            "replicator_cpu_seconds_per_gib": [round(c / gib, 2) for c in cpu_saves],
            "replicator_idle_cpu_percent": [
                round(100 * c / args.idle_seconds, 2) for c in cpu_idle
            ],
        }
        if plugin is not None:
            c0 = cpu_seconds(plugin.pid)
            time.sleep(args.idle_seconds)
            result["plugin_rss_mib"] = round(memory_mib(plugin.pid, "VmRSS"))
            result["plugin_peak_rss_mib"] = round(memory_mib(plugin.pid, "VmHWM"))
            result["plugin_idle_cpu_percent"] = round(
                100 * (cpu_seconds(plugin.pid) - c0) / args.idle_seconds, 2
            )
        return result
    finally:
        for node in nodes:
            node.stop()
        if plugin is not None:
            plugin.send_signal(signal.SIGTERM)
            plugin.wait(30)
            subprocess.run(["umount", str(root / "plugin-ram")], check=False, capture_output=True)
        shutil.rmtree(ram, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-mib", type=int, default=512, help="each rank's step (MiB)")
    parser.add_argument("--saves", type=int, default=4, help="steps saved (default 4)")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="idle windows (s)")
    parser.add_argument(
        "--no-backup", action="store_true", help="no backup: the local and peer tiers alone"
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mtc-footprint-") as tmp:
        result = measure(args, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
