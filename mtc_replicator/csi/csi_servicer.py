"""The CSI Identity and Node gRPC services over ``NodeVolumes``; no Controller service.

Handlers validate, call the core, and turn its exceptions into status codes in one place
(``_STATUS``). Node RPCs we do not serve answer UNIMPLEMENTED and are not advertised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import NoReturn

import grpc

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi._pb.csi.v1 import csi_pb2_grpc
from mtc_replicator.csi.errors import (
    CheckpointDirError,
    CsiError,
    InvalidRequest,
    MountDenied,
    MountError,
    OperationPending,
    OwnerBusy,
    PublishConflict,
    RamDiskMissing,
    TargetCleanupError,
)
from mtc_replicator.csi.validation import validate_publish, validate_unpublish
from mtc_replicator.csi.volumes import NodeVolumes

log = logging.getLogger(__name__)

DEFAULT_DRIVER_NAME = "multitier-checkpoint.mtc.dev"
"""Ours, never GKE's (``multitier-checkpoint.csi.storage.gke.io``): both may run in one
cluster, and kubelet routes volumes to plugins by this name."""

_STATUS: dict[type[CsiError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    MountDenied: grpc.StatusCode.PERMISSION_DENIED,
    PublishConflict: grpc.StatusCode.ALREADY_EXISTS,
    OperationPending: grpc.StatusCode.ABORTED,
    OwnerBusy: grpc.StatusCode.UNAVAILABLE,
    CheckpointDirError: grpc.StatusCode.FAILED_PRECONDITION,
    RamDiskMissing: grpc.StatusCode.FAILED_PRECONDITION,
    MountError: grpc.StatusCode.INTERNAL,
    TargetCleanupError: grpc.StatusCode.INTERNAL,
}


@contextlib.contextmanager
def _answering(context: grpc.ServicerContext) -> Iterator[None]:
    """Abort the call with the status code of the core's exception."""
    try:
        yield
    except CsiError as exc:
        context.abort(_STATUS.get(type(exc), grpc.StatusCode.INTERNAL), str(exc))


class IdentityServicer(csi_pb2_grpc.IdentityServicer):
    """Who we are; ready while the RAM disk is mounted."""

    def __init__(self, driver_name: str, vendor_version: str, volumes: NodeVolumes) -> None:
        self.driver_name = driver_name
        self.vendor_version = vendor_version
        self.volumes = volumes

    def GetPluginInfo(
        self, request: pb.GetPluginInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=self.driver_name, vendor_version=self.vendor_version)

    def GetPluginCapabilities(
        self, request: pb.GetPluginCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.GetPluginCapabilitiesResponse:
        return pb.GetPluginCapabilitiesResponse()

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        # An error, not ready=false: the livenessprobe sidecar then restarts the plugin,
        # which mounts a fresh RAM disk.
        if not self.volumes.ram_disk_mounted():
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the RAM disk at {self.volumes.ram_dir} is not mounted",
            )
        response = pb.ProbeResponse()
        response.ready.value = True
        return response

    def register(self, server: grpc.Server) -> None:
        csi_pb2_grpc.add_IdentityServicer_to_server(self, server)


class NodeServicer(csi_pb2_grpc.NodeServicer):
    """Publish and unpublish the RAM disk; report the node's name."""

    def __init__(self, volumes: NodeVolumes, node_id: str) -> None:
        self.volumes = volumes
        self.node_id = node_id

    def NodePublishVolume(
        self, request: pb.NodePublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodePublishVolumeResponse:
        with _answering(context):
            publish = validate_publish(request)
            if self.volumes.publish(publish):
                log.info(
                    "published volume %s at %s (%s)",
                    publish.volume_id,
                    publish.target,
                    "read-only" if publish.readonly else "read-write",
                )
        return pb.NodePublishVolumeResponse()

    def NodeUnpublishVolume(
        self, request: pb.NodeUnpublishVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnpublishVolumeResponse:
        with _answering(context):
            unpublish = validate_unpublish(request)
            if self.volumes.unpublish(unpublish):
                log.info("unpublished volume %s from %s", unpublish.volume_id, unpublish.target)
        return pb.NodeUnpublishVolumeResponse()

    def NodeGetCapabilities(
        self, request: pb.NodeGetCapabilitiesRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse()

    def NodeGetInfo(
        self, request: pb.NodeGetInfoRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=self.node_id)

    def NodeStageVolume(
        self, request: pb.NodeStageVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeStageVolumeResponse:
        _unimplemented(context, "NodeStageVolume")

    def NodeUnstageVolume(
        self, request: pb.NodeUnstageVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnstageVolumeResponse:
        _unimplemented(context, "NodeUnstageVolume")

    def NodeGetVolumeStats(
        self, request: pb.NodeGetVolumeStatsRequest, context: grpc.ServicerContext
    ) -> pb.NodeGetVolumeStatsResponse:
        _unimplemented(context, "NodeGetVolumeStats")

    def NodeExpandVolume(
        self, request: pb.NodeExpandVolumeRequest, context: grpc.ServicerContext
    ) -> pb.NodeExpandVolumeResponse:
        _unimplemented(context, "NodeExpandVolume")

    def register(self, server: grpc.Server) -> None:
        csi_pb2_grpc.add_NodeServicer_to_server(self, server)


def _unimplemented(context: grpc.ServicerContext, method: str) -> NoReturn:
    context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not supported by this plugin")
