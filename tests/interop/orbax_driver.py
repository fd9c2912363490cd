"""Drive the REAL Orbax multi-tier checkpointing client against a checkpoint directory.

Run as a standalone script (the tests start it as a subprocess with ``sys.executable``)::

    python tests/interop/orbax_driver.py --dir CKPT --run-name job --mode train \
        --steps 6 --save-every 2 --backup-interval-steps 1
    python tests/interop/orbax_driver.py --dir CKPT --run-name job --mode resume

What it does, in the order a real JAX training job on a multi-tier-checkpointing node does it:

1. writes ``jax-init-info.txt`` (``"0\\n127.0.0.1:<free port>\\n"``) into the directory, as our
   CSI driver would for process 0 of a one-process job;
2. runs Orbax's own handshake ``initialize_multi_tier_checkpointing(...)``: it reads that file,
   calls ``jax.distributed.initialize``, writes ``replicator.yaml`` (temp + rename), waits for
   the daemon to delete it, then waits for a ``*.restore`` marker and renames the newest one to
   ``<dir>/<N>`` (or deletes the "nothing to restore" marker);
3. builds a ``ReplicatorCheckpointManager`` on the directory (one CPU process, a small pytree
   of ``jax.Array`` whose values are a deterministic function of ``--seed`` and the step);
4. ``train``: restores the latest step if the handshake gave one, then runs steps
   ``start .. --steps - 1``, saving through Orbax's own save policy (``save_interval_steps =
   --save-every``; the last step is always saved); ``resume``: restores the latest step only.

It prints exactly ONE JSON line on stdout, e.g. for ``resume``::

    {"mode": "resume", "restored_step": 4, "checksum": "...", "expected_checksum": "...",
     "step_dir_symlink": ".mtc/...", "saved_steps": [], ...}

``restored_step`` is null when the daemon said there is nothing to restore. ``checksum`` is the
sha256 of the restored arrays (every leaf, in key order: name, dtype, shape, bytes);
``expected_checksum`` is the same digest of what ``train`` saves at that step. Logs go to stderr.
Exit status: 0 on success, 1 on any error (traceback on stderr), 124 when ``--timeout``
expires (the directory listing and every thread's stack on stderr).

Running one CPU process through a handshake written for TPU VMs needs three things (see
``_prepare_environment``): ``num_processes`` must reach ``jax.distributed.initialize`` (Orbax
passes only process id and coordinator address and relies on cluster auto-detection), absl
flags must be parsed (Orbax reads ``experimental_use_distributed_id_for_mesh_consistency``
unguarded during restore), and MaxText's ``experimental_orbax_use_distributed_process_id``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

JAX_INIT_INFO = "jax-init-info.txt"
# Environment that makes JAX's own Slurm cluster detection supply num_processes=1 (and nothing
# that Orbax does not pass itself: Orbax gives process_id and coordinator_address explicitly).
SINGLE_PROCESS_ENV = {
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_NODELIST": "127.0.0.1",
    "SLURM_NTASKS": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, type=Path, help="CHECKPOINT_DIR (the daemon's)")
    p.add_argument("--run-name", required=True, help="job-name written to replicator.yaml")
    p.add_argument("--mode", required=True, choices=("train", "resume"))
    p.add_argument("--steps", type=int, default=4, help="train: run steps 0 .. steps-1")
    p.add_argument("--save-every", type=int, default=1, help="train: save_interval_steps")
    interval = p.add_mutually_exclusive_group()
    interval.add_argument("--backup-interval-minutes", type=int)
    interval.add_argument("--backup-interval-steps", type=int)
    p.add_argument("--timeout", type=float, default=120.0, help="whole-run limit, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size-kib", type=int, default=256, help="approximate pytree size")
    p.add_argument("--cpu-devices", type=int, default=2, help="XLA host devices (mesh size)")
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="train: seconds to sleep after each step"
    )
    p.add_argument(
        "--jax-init",
        choices=("env", "patch"),
        default="env",
        help="how num_processes=1 reaches jax.distributed.initialize: 'env' sets the Slurm "
        "variables JAX's cluster detection reads; 'patch' wraps jax.distributed.initialize",
    )
    p.add_argument(
        "--keep-jax-init-info",
        action="store_true",
        help="do not (re)write jax-init-info.txt when it already exists",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="JAX processes in the job (each its own node and CHECKPOINT_DIR); above 1 the "
        "process index and coordinator come from the jax-init-info.txt the node stack wrote "
        "(--keep-jax-init-info is implied) and CPU collectives run over gloo",
    )
    p.add_argument("--verbose", action="store_true", help="Orbax/JAX INFO logs on stderr")
    args = p.parse_args(argv)
    args.dir = args.dir.absolute()  # Orbax's OCDBT layer rejects relative paths
    if args.backup_interval_minutes is None and args.backup_interval_steps is None:
        args.backup_interval_minutes = 30  # Orbax's own default
    if args.steps < 1 or args.save_every < 1:
        p.error("--steps and --save-every must be >= 1")
    if args.processes > 1:
        args.keep_jax_init_info = True
    return args


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_jax_init_info(directory: Path, *, keep: bool) -> str:
    """Write ``jax-init-info.txt`` as the CSI driver does for process 0 (temp + rename)."""
    path = directory / JAX_INIT_INFO
    if keep and path.exists():
        return path.read_text()
    text = f"0\n127.0.0.1:{free_loopback_port()}\n"
    tmp = directory / f".{JAX_INIT_INFO}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, path)
    return text


def _prepare_environment(args: argparse.Namespace) -> None:
    """Environment that must be set before jax is imported."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        )
    if args.jax_init == "env":
        # Overwrite (a test run inside a real Slurm allocation must still be ONE process) and
        # drop Open MPI's marker: JAX tries its OmpiCluster before SlurmCluster. With several
        # processes only their count matters: Orbax passes the process index itself.
        os.environ.update(SINGLE_PROCESS_ENV)
        os.environ["SLURM_NTASKS"] = str(args.processes)
        os.environ.pop("OMPI_MCA_orte_hnp_uri", None)


def _configure_libraries(args: argparse.Namespace) -> None:
    """absl flags and logging, and (only with --jax-init patch) the initialize wrapper."""
    import logging

    # Orbax defines its absl flags when imported; parse them (defaults) so that flag reads
    # during restore do not raise UnparsedFlagAccessError, then set what MaxText sets.
    import orbax.checkpoint
    import orbax.checkpoint.experimental.emergency.multihost  # noqa: F401  (defines a flag)
    from absl import flags
    from absl import logging as absl_logging

    flags.FLAGS([sys.argv[0]])
    flags.FLAGS.experimental_orbax_use_distributed_process_id = True
    if args.processes > 1:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    level = logging.INFO if args.verbose else logging.WARNING
    absl_logging.set_verbosity(absl_logging.INFO if args.verbose else absl_logging.WARNING)
    logging.getLogger().setLevel(level)
    logging.getLogger("jax").setLevel(level)

    if args.jax_init == "patch":
        import functools

        import jax

        original = jax.distributed.initialize

        @functools.wraps(original)
        def initialize(*a: Any, **kw: Any) -> Any:
            kw.setdefault("num_processes", 1)
            return original(*a, **kw)

        jax.distributed.initialize = initialize


# --- the model state -------------------------------------------------------------------------


def make_state(seed: int, step: int, size_kib: int) -> dict[str, Any]:
    """Host (numpy) values of the pytree at ``step``: a pure function of (seed, step, size)."""
    import numpy as np

    rng = np.random.default_rng([seed, step])
    rows = max(8, int((size_kib * 1024 / 4 / 64) ** 0.5) // 8 * 8)  # float32, even split
    return {
        "dense": {
            "kernel": rng.standard_normal((rows, 64 * 8), dtype=np.float32),
            "bias": rng.standard_normal((64 * 8,), dtype=np.float32),
        },
        "embed": rng.integers(-(2**31), 2**31 - 1, size=(rows, 16), dtype=np.int32),
        "step": np.asarray(step, dtype=np.int32),
    }


def _shardings(mesh: Any, state: dict[str, Any]) -> dict[str, Any]:
    """kernel/embed split along the mesh's one axis (rows divide evenly), the rest replicated."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def spec(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        split = name in ("dense/kernel", "embed") and leaf.shape[0] % mesh.size == 0
        return NamedSharding(mesh, PartitionSpec("data") if split else PartitionSpec())

    return jax.tree_util.tree_map_with_path(spec, state)


def to_device(mesh: Any, host_state: dict[str, Any]) -> dict[str, Any]:
    import jax

    return jax.tree.map(jax.device_put, host_state, _shardings(mesh, host_state))


def checksum(state: dict[str, Any]) -> str:
    """sha256 over every leaf in key-path order: path, dtype, shape, C-order bytes."""
    import jax
    import numpy as np

    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
        arr = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(arr.dtype).encode())
        h.update(repr(arr.shape).encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def local_checksums(restored: dict[str, Any], host: dict[str, Any]) -> tuple[str, str]:
    """With several processes an array is not whole in any one: sha256 over this process's
    shards of the restored state, and over the same slices of ``host`` (what was saved)."""
    import jax
    import numpy as np

    got, want = hashlib.sha256(), hashlib.sha256()
    pairs = zip(
        jax.tree_util.tree_flatten_with_path(restored)[0],
        jax.tree_util.tree_leaves(host),
        strict=True,
    )
    for (path, leaf), expected in sorted(pairs, key=lambda p: jax.tree_util.keystr(p[0][0])):
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            for h, arr in (
                (got, np.asarray(shard.data)),
                (want, np.asarray(expected)[shard.index]),
            ):
                h.update(jax.tree_util.keystr(path).encode() + str(shard.index).encode())
                h.update(np.ascontiguousarray(arr).tobytes())
    return got.hexdigest(), want.hexdigest()


# --- Orbax -----------------------------------------------------------------------------------


def handshake(args: argparse.Namespace) -> float:
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
    )

    started = time.monotonic()
    initialization.initialize_multi_tier_checkpointing(
        args.dir,
        backup_interval_minutes=args.backup_interval_minutes,
        backup_interval_steps=args.backup_interval_steps,
        num_slices=1,
        run_name=args.run_name,
        data_parallelism=1,
        jax_initialization_timeout_seconds=max(1, int(args.timeout)),
        jax_shutdown_timeout_seconds=10,
    )
    return time.monotonic() - started


def make_manager(args: argparse.Namespace, mesh: Any) -> Any:
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm,
    )

    options = rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=args.save_every)
    return rcm.ReplicatorCheckpointManager(args.dir, options, global_mesh=mesh)


def restore(manager: Any, mesh: Any, step: int, host_template: dict[str, Any]) -> Any:
    import jax
    import orbax.checkpoint as ocp

    shardings = _shardings(mesh, host_template)
    abstract = jax.tree.map(
        lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh),
        host_template,
        shardings,
    )
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)
        ),
    )
    return restored["state"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    args.dir.mkdir(parents=True, exist_ok=True)
    write_jax_init_info(args.dir, keep=args.keep_jax_init_info)
    handshake_secs = handshake(args)
    step_link = None
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    result: dict[str, Any] = {
        "mode": args.mode,
        "run_name": args.run_name,
        "restored_step": None,
        "checksum": None,
        "expected_checksum": None,
        "step_dir_symlink": None,
        "saved_steps": [],
        "saved_checksums": {},
        "handshake_secs": round(handshake_secs, 3),
        "devices": jax.device_count(),
    }
    manager = make_manager(args, mesh)
    try:
        latest = manager.latest_step()
        result["steps_seen_at_start"] = list(manager.all_steps())
        if latest is not None:
            step_dir = args.dir / str(latest)
            if step_dir.is_symlink():
                step_link = os.readlink(step_dir)
            template = make_state(args.seed, latest, args.size_kib)
            state = restore(manager, mesh, latest, template)
            if args.processes > 1:
                got, want = local_checksums(state, template)
            else:
                got, want = checksum(state), checksum(template)
            result.update(
                restored_step=int(latest),
                checksum=got,
                expected_checksum=want,
                step_dir_symlink=step_link,
                process_index=jax.process_index(),
            )
        if args.mode == "train":
            start = 0 if latest is None else latest + 1
            last = args.steps - 1
            for step in range(start, last + 1):
                host = make_state(args.seed, step, args.size_kib)
                saved = manager.save(
                    step,
                    args=ocp.args.Composite(state=ocp.args.PyTreeSave(to_device(mesh, host))),
                    force=step == last and not manager.should_save(step),
                )
                if saved:
                    result["saved_steps"].append(step)
                    result["saved_checksums"][str(step)] = checksum(host)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            manager.wait_until_finished()
            result["latest_step_after_train"] = manager.latest_step()
    finally:
        manager.close()
    return result


EXIT_TIMEOUT = 124


def _start_watchdog(args: argparse.Namespace) -> threading.Timer:
    """After --timeout: say what the directory holds (what the client waits for), dump every
    thread's stack, and exit 124 without running atexit hooks (a hung JAX shutdown included)."""

    def expire() -> None:
        try:
            entries = sorted(os.listdir(args.dir))
        except OSError as e:
            entries = [f"<{e}>"]
        sys.stderr.write(
            f"orbax_driver: --timeout {args.timeout:g}s expired in mode {args.mode}; "
            f"{args.dir} holds {entries}\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(args.timeout, expire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watchdog = _start_watchdog(args)
    _prepare_environment(args)
    try:
        _configure_libraries(args)
        result = run(args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    watchdog.cancel()
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
