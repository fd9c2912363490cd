"""Client library for training jobs: the handshake with the node's replicator, and saving
and loading steps in the layout it expects (docs/protocol.md).

Importing it needs only the standard library and PyYAML; the torch helpers import torch
when they are called, and the Ray checkpointer (``RayCheckpointer``, docs/ray.md) imports Ray
and torch only when it runs. It never imports gRPC, inotify or cloud SDKs.
"""

from mtc_replicator.client.async_save import (
    AsyncSaveError,
    AsyncSaver,
    PendingSave,
    Staged,
    WhenBusy,
)
from mtc_replicator.client.election import NotLocalRankZero
from mtc_replicator.client.finish import finish_job
from mtc_replicator.client.handshake import (
    DEFAULT_POLL_INTERVAL,
    DEFAULT_TIMEOUT,
    ConfigFields,
    HandshakeError,
    HandshakeTimeout,
    RenameStyle,
    ReplicatorFailed,
    RestorePlan,
    RestoreResult,
    await_restore,
    handshake,
    job_config,
    plan_restore,
    publish_config,
    restore_name,
    wait_config_consumed,
)
from mtc_replicator.client.ray_train import RayCheckpointer, RayTrainRefused, Restored
from mtc_replicator.client.ray_tune import TuneCheckpointer, TuneRestored
from mtc_replicator.client.torch_io import (
    CheckpointDirFull,
    load_distributed,
    load_state_dict,
    node_process_group,
    save_distributed,
    save_file,
    save_state_dict,
    share_restore,
)
from mtc_replicator.core.contract import ConfigError, Framework, JobConfig

__all__ = [
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_TIMEOUT",
    "AsyncSaveError",
    "AsyncSaver",
    "CheckpointDirFull",
    "ConfigError",
    "ConfigFields",
    "Framework",
    "HandshakeError",
    "HandshakeTimeout",
    "JobConfig",
    "NotLocalRankZero",
    "PendingSave",
    "RayCheckpointer",
    "RayTrainRefused",
    "RenameStyle",
    "ReplicatorFailed",
    "RestorePlan",
    "RestoreResult",
    "Restored",
    "Staged",
    "TuneCheckpointer",
    "TuneRestored",
    "WhenBusy",
    "await_restore",
    "finish_job",
    "handshake",
    "job_config",
    "load_distributed",
    "load_state_dict",
    "node_process_group",
    "plan_restore",
    "publish_config",
    "restore_name",
    "save_distributed",
    "save_file",
    "save_state_dict",
    "share_restore",
    "wait_config_consumed",
]
