"""What a training pod needs from a ``CheckpointConfiguration``, for a KubeRay worker group.

Pure (a validated ``NodeConfig`` in, dicts or text out). ``mtc render CONFIG
--ray-worker-group NAME`` prints it; ``deploy/examples/rayjob.yaml`` and ``raycluster.yaml``
hold the same values (a test keeps them equal). The rules are the JobSet example's
(docs/deploy.md, "Run a training job on it"): the node's RAM disk as a CSI ephemeral inline
volume at ``MTC_CHECKPOINT_DIR``, the replicator's uid and group, the nodes the node stack
runs on, and one such pod per node.
"""

from __future__ import annotations

import yaml

from mtc_replicator.tools.render_config import DNS_LABEL_RE, Manifest, NodeConfig, RenderError
from mtc_replicator.tools.render_manifests import DRIVER_NAME

CHECKPOINT_ENV = "MTC_CHECKPOINT_DIR"
"""Where the training code finds the node's checkpoint directory (its CHECKPOINT_DIR)."""
MOUNT_PATH = "/local-checkpoints"
VOLUME_NAME = "checkpoints"
JOB_LABEL = "checkpointing.mtc.dev/job"
"""Set on every pod that mounts the RAM disk, valued with its job's name. A RayJob's
RayCluster gets a generated name, so KubeRay's own ``ray.io/cluster`` label cannot be known
in advance; this one is written in the manifest."""
RAY_CONTAINER = "ray-worker"
"""The name the snippet gives the Ray container (KubeRay takes the first container)."""
HOSTNAME_KEY = "kubernetes.io/hostname"


def job_name(name: str) -> str:
    """``name`` checked as the label value ``JOB_LABEL`` takes (a RayJob's name)."""
    if not DNS_LABEL_RE.fullmatch(name):
        raise RenderError(
            "--ray-worker-group", f"{name!r} is not a job name (lowercase letters, digits, -)"
        )
    return name


def pod_security(c: NodeConfig) -> Manifest:
    """The replicator's uid (it renames the step directories the pod writes, which the
    kernel allows only to their owner) and its group, the RAM disk's (mode 2770)."""
    return {"runAsUser": c.run_as_user, "runAsGroup": c.run_as_group, "fsGroup": c.run_as_group}


def one_pod_per_node() -> Manifest:
    """A required anti-affinity over every pod labelled ``JOB_LABEL``, in every namespace:
    a node has one RAM disk and its replicator serves one rank of one job, so a second
    checkpointing pod there, of this job or another, would overwrite ``replicator.yaml``."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "topologyKey": HOSTNAME_KEY,
                    "labelSelector": {
                        "matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]
                    },
                    "namespaceSelector": {},
                }
            ]
        }
    }


def ray_worker_group(c: NodeConfig, job: str) -> Manifest:
    """The parts of a KubeRay ``workerGroupSpecs[]`` entry that the node stack needs: the
    pod template's label, security context, placement and volume, and the Ray container's
    environment and mount (its image, resources and ``rayStartParams`` are the job's)."""
    return {
        "template": {
            "metadata": {"labels": {JOB_LABEL: job_name(job)}},
            "spec": {
                "securityContext": pod_security(c),
                "affinity": one_pod_per_node(),
                "nodeSelector": c.pod_node_selector,
                "tolerations": [dict(t) for t in c.tolerations],
                "containers": [
                    {
                        "name": RAY_CONTAINER,
                        "env": [{"name": CHECKPOINT_ENV, "value": MOUNT_PATH}],
                        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": MOUNT_PATH}],
                    }
                ],
                "volumes": [{"name": VOLUME_NAME, "csi": {"driver": DRIVER_NAME}}],
            },
        }
    }


def ray_worker_group_text(c: NodeConfig, job: str) -> str:
    """``ray_worker_group`` as YAML, after comments saying where it goes."""
    body = yaml.safe_dump(ray_worker_group(c, job), sort_keys=False, default_flow_style=False)
    header = (
        f"# What a KubeRay worker group of job {job} needs from CheckpointConfiguration\n"
        f"# {c.namespace}/{c.name}. Merge it into spec.workerGroupSpecs[] (RayCluster) or\n"
        "# spec.rayClusterSpec.workerGroupSpecs[] (RayJob): env and volumeMounts go to the Ray\n"
        "# container (the first one). Keep replicas = minReplicas = maxReplicas (a fixed set of\n"
        "# nodes, one worker pod each) and a memory limit that covers training, Ray's object\n"
        "# store (/dev/shm) and about two checkpoint steps. The head group needs none of it.\n"
    )
    return header + body
