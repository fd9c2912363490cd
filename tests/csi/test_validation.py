"""NodePublishVolume / NodeUnpublishVolume validation: the spec's order, clear messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtc_replicator.csi._pb.csi.v1 import csi_pb2 as pb
from mtc_replicator.csi.errors import InvalidRequest
from mtc_replicator.csi.owner import PodInfo
from mtc_replicator.csi.validation import (
    EPHEMERAL_KEY,
    NAMESPACE_KEY,
    POD_NAME_KEY,
    POD_UID_KEY,
    SERVICE_ACCOUNT_KEY,
    Publish,
    Unpublish,
    validate_publish,
    validate_unpublish,
)

Mode = pb.VolumeCapability.AccessMode

MOUNT = pb.VolumeCapability(
    mount=pb.VolumeCapability.MountVolume(), access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER)
)
BLOCK = pb.VolumeCapability(
    block=pb.VolumeCapability.BlockVolume(), access_mode=Mode(mode=Mode.SINGLE_NODE_WRITER)
)
EPHEMERAL = {
    EPHEMERAL_KEY: "true",
    POD_NAME_KEY: "trainer-0",
    NAMESPACE_KEY: "team-a",
    POD_UID_KEY: "6f1c2a9e-0b1d-4c8e-9a55-2d3c4b5a6e7f",
    SERVICE_ACCOUNT_KEY: "default",
}
POD = PodInfo("team-a", "trainer-0", "6f1c2a9e-0b1d-4c8e-9a55-2d3c4b5a6e7f", "default")
TARGET = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~mtc_replicator/csi/ckpt/mount"


def publish(**fields: object) -> pb.NodePublishVolumeRequest:
    base: dict[str, object] = {
        "volume_id": "csi-abc",
        "target_path": TARGET,
        "volume_capability": MOUNT,
        "volume_context": EPHEMERAL,
    }
    base.update(fields)
    return pb.NodePublishVolumeRequest(**{k: v for k, v in base.items() if v is not None})


def test_a_kubelet_request_passes() -> None:
    assert validate_publish(publish()) == Publish("csi-abc", Path(TARGET), readonly=False, pod=POD)


@pytest.mark.parametrize("key", [NAMESPACE_KEY, POD_NAME_KEY, POD_UID_KEY, SERVICE_ACCOUNT_KEY])
def test_the_pod_kubelet_names_is_required(key: str) -> None:
    context = {k: v for k, v in EPHEMERAL.items() if k != key}
    with pytest.raises(InvalidRequest, match=f"no {key}: give the CSIDriver podInfoOnMount"):
        validate_publish(publish(volume_context=context))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (NAMESPACE_KEY, ""),
        (NAMESPACE_KEY, "Team-A"),
        (NAMESPACE_KEY, "a" * 64),
        (NAMESPACE_KEY, "team/a"),
        (NAMESPACE_KEY, "team.a"),
        (POD_NAME_KEY, "../x"),
        (POD_NAME_KEY, "x\n"),
        (POD_UID_KEY, "u id"),
        (SERVICE_ACCOUNT_KEY, "sa\u0000"),
    ],
)
def test_pod_names_that_kubernetes_never_makes_are_refused(key: str, value: str) -> None:
    with pytest.raises(InvalidRequest, match="is not a valid name"):
        validate_publish(publish(volume_context={**EPHEMERAL, key: value}))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # Each case breaks everything after its own field too: the first check must win.
        ({"volume_id": None, "target_path": None, "volume_capability": BLOCK}, "volume_id"),
        ({"target_path": None, "volume_capability": BLOCK, "volume_context": {}}, "target_path"),
        ({"target_path": "relative/mount", "volume_capability": None}, "absolute"),
        ({"target_path": "/a/\0b"}, "absolute"),
        ({"volume_capability": None, "volume_context": {}}, "volume_capability is required"),
        ({"volume_capability": BLOCK, "volume_context": {}}, "block access"),
        ({"volume_capability": pb.VolumeCapability()}, "mount access"),
        ({"volume_context": {}}, "ephemeral"),
        ({"volume_context": {EPHEMERAL_KEY: "false"}}, "ephemeral"),
        ({"volume_context": {EPHEMERAL_KEY: "True"}}, "ephemeral"),
    ],
)
def test_checks_in_the_specs_order(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        validate_publish(publish(**fields))


def test_an_unset_capability_is_told_apart_from_an_empty_one() -> None:
    request = publish(volume_capability=None)
    assert request.volume_capability is not None  # protobuf hands out a default instance
    with pytest.raises(InvalidRequest, match="volume_capability is required"):
        validate_publish(request)


@pytest.mark.parametrize(
    ("readonly", "mode", "expected"),
    [
        (False, Mode.SINGLE_NODE_WRITER, False),
        (True, Mode.SINGLE_NODE_WRITER, True),
        (False, Mode.SINGLE_NODE_READER_ONLY, True),
        (False, Mode.MULTI_NODE_READER_ONLY, True),
        (False, Mode.MULTI_NODE_MULTI_WRITER, False),
        (False, Mode.UNKNOWN, False),
    ],
)
def test_read_only_from_the_flag_or_the_access_mode(
    readonly: bool, mode: pb.VolumeCapability.AccessMode.Mode.ValueType, expected: bool
) -> None:
    capability = pb.VolumeCapability(
        mount=pb.VolumeCapability.MountVolume(), access_mode=Mode(mode=mode)
    )
    result = validate_publish(publish(readonly=readonly, volume_capability=capability))
    assert result.readonly is expected


def test_target_paths_are_normalised() -> None:
    assert validate_publish(publish(target_path=TARGET + "/")).target == Path(TARGET)
    assert validate_publish(publish(target_path="/a//b/./c")).target == Path("/a/b/c")


def test_unpublish() -> None:
    request = pb.NodeUnpublishVolumeRequest(volume_id="csi-abc", target_path=TARGET)
    assert validate_unpublish(request) == Unpublish("csi-abc", Path(TARGET))
    with pytest.raises(InvalidRequest, match="volume_id"):
        validate_unpublish(pb.NodeUnpublishVolumeRequest())
    with pytest.raises(InvalidRequest, match="target_path is required"):
        validate_unpublish(pb.NodeUnpublishVolumeRequest(volume_id="csi-abc"))
    with pytest.raises(InvalidRequest, match="absolute"):
        validate_unpublish(pb.NodeUnpublishVolumeRequest(volume_id="v", target_path="x"))
