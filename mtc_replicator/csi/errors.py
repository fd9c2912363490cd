"""Why a CSI call failed, as specific exception types; no I/O.

The gRPC layer (``mtc_replicator.csi.csi_servicer``) maps each type to one status code in one place,
so the core never imports gRPC and every failure path is testable without a socket.
"""

from __future__ import annotations


class CsiError(Exception):
    """Base of the errors a CSI call answers with."""


class InvalidRequest(CsiError):
    """The request is malformed or asks for something we never serve (INVALID_ARGUMENT)."""


class PublishConflict(CsiError):
    """The target is already published in an incompatible way (ALREADY_EXISTS)."""


class OperationPending(CsiError):
    """Another call for the same target path is still in flight (ABORTED: retry later)."""


class OwnerBusy(CsiError):
    """A pod of another namespace still has the checkpoint directory (UNAVAILABLE: kubelet
    retries, and the publish goes through once that pod's volume is unpublished)."""


class MountDenied(CsiError):
    """The pod's namespace and service account are not allowed to mount (PERMISSION_DENIED)."""


class CheckpointDirError(CsiError):
    """The checkpoint directory is unsafe (a symlink, not a directory) or cannot be prepared
    or emptied (FAILED_PRECONDITION)."""


class RamDiskMissing(CsiError):
    """The RAM disk is not mounted, so there is nothing to publish (FAILED_PRECONDITION)."""


class MountError(CsiError):
    """A mount, remount or unmount failed (INTERNAL)."""


class TargetCleanupError(CsiError):
    """The target directory could not be created or removed (INTERNAL)."""


class RamDiskError(Exception):
    """The RAM disk cannot be set up at start (the plugin exits)."""
