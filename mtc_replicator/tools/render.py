"""``mtc render``: a ``CheckpointConfiguration`` file turned into the node stack's manifests
(or, with ``--ray-worker-group``, into what a KubeRay worker group needs: ``render_workload``).

The thin I/O wrapper: ``render_config`` reads and checks the configuration, and
``render_manifests`` builds the objects (both pure); this module reads the file, writes YAML
to stdout or a kustomization directory, and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mtc_replicator.tools.render_config import Manifest, NodeConfig, RenderError, load, parse
from mtc_replicator.tools.render_manifests import manifests
from mtc_replicator.tools.render_workload import ray_worker_group_text


def render(cr: Mapping[str, Any]) -> list[Manifest]:
    """The node stack's manifests for one ``CheckpointConfiguration`` (parsed YAML)."""
    return manifests(parse(cr))


def to_yaml(objects: Sequence[Manifest]) -> str:
    """Multi-document YAML, keys in the order they were built (kind first, as people read)."""
    return yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def _file_name(index: int, obj: Manifest) -> str:
    # Numbered in apply order, and no content hash in the name: a new render overwrites the old.
    return f"{index:02d}-{obj['kind'].lower()}.yaml"


def write_dir(objects: Sequence[Manifest], out: Path) -> list[Path]:
    """One file per object plus a ``kustomization.yaml``: ``kubectl apply -k DIR`` works."""
    out.mkdir(parents=True, exist_ok=True)
    names = [_file_name(i, obj) for i, obj in enumerate(objects)]
    for name, obj in zip(names, objects, strict=True):
        (out / name).write_text(to_yaml([obj]))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": names,
    }
    (out / "kustomization.yaml").write_text(to_yaml([kustomization]))
    return [out / n for n in (*names, "kustomization.yaml")]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``mtc render`` on the operator CLI's subcommands."""
    about = "turn a CheckpointConfiguration into the node stack's Kubernetes manifests"
    p = sub.add_parser("render", help=about, description=about)
    p.add_argument("config", help="the CheckpointConfiguration YAML file, or - for stdin")
    p.add_argument(
        "-o",
        "--output",
        default="-",
        help="- (default): multi-document YAML on stdout; DIR: one file per object and a "
        "kustomization.yaml",
    )
    p.add_argument(
        "--ray-worker-group",
        metavar="JOB",
        help="instead of the node stack, print what a KubeRay worker group of job JOB (a "
        "RayJob's or RayCluster's name) needs to mount the node's checkpoints: its label, "
        "securityContext, affinity, nodeSelector, tolerations, volume, env and volumeMount",
    )


def _print_ray_worker_group(args: argparse.Namespace, config: NodeConfig) -> int:
    if args.output != "-":
        print("mtc render: --ray-worker-group prints to stdout; drop -o", file=sys.stderr)
        return 2
    try:
        text = ray_worker_group_text(config, args.ray_worker_group)
    except RenderError as exc:
        print(f"mtc render: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def run(args: argparse.Namespace) -> int:
    """``mtc render``: 0 on success, 2 when the configuration is invalid or unreadable."""
    try:
        text = sys.stdin.read() if args.config == "-" else Path(args.config).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"mtc render: cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        config = parse(load(text))
    except RenderError as exc:
        print(f"mtc render: {args.config}: {exc}", file=sys.stderr)
        return 2
    for name in config.ignored:
        print(f"mtc render: warning: spec.{name} has no effect here (GKE-only)", file=sys.stderr)
    if not config.allowed_namespaces and not config.allowed_service_accounts:
        print(
            "mtc render: warning: no spec.allowedNamespaces or spec.allowedServiceAccounts: "
            "pods of every namespace may mount the node's checkpoints",
            file=sys.stderr,
        )
    if args.ray_worker_group is not None:
        return _print_ray_worker_group(args, config)
    objects = manifests(config)
    if args.output == "-":
        sys.stdout.write(to_yaml(objects))
        return 0
    try:
        written = write_dir(objects, Path(args.output))
    except OSError as exc:
        print(f"mtc render: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path, file=sys.stderr)
    return 0
