"""The committed gRPC stubs are exactly what the pinned grpcio-tools and mypy-protobuf make of
proto/."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _generator() -> ModuleType:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra")
    pytest.importorskip("mypy_protobuf", reason="mypy-protobuf is in the dev extra")
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("package", ["mtc_replicator._pb", "mtc_replicator.csi._pb"])
def test_stubs_are_current(tmp_path: Path, package: str) -> None:
    gen = _generator()
    (target,) = [t for t in gen.TARGETS if t.package == package]
    committed = ROOT / target.directory
    fresh = gen.generate(target, tmp_path / "_pb")
    fresh_rel = {p.relative_to(tmp_path / "_pb") for p in fresh}
    committed_rel = {
        p.relative_to(committed)
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert fresh_rel == committed_rel, f"run scripts/gen_protos.py and commit {target.directory}"
    for rel in sorted(fresh_rel):
        assert (tmp_path / "_pb" / rel).read_text() == (committed / rel).read_text(), (
            f"{target.directory}/{rel} is stale: run scripts/gen_protos.py"
        )


def test_the_type_stub_plugins_are_found_beside_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mypy-protobuf's protoc plugins need no PATH: the venv's bin/ is not always on it."""
    gen = _generator()
    monkeypatch.setenv("PATH", "")
    for name in gen.PLUGINS:
        path = gen.plugin(name)
        assert path.name == name
        assert os.access(path, os.X_OK)


def test_stubs_import_without_a_top_level_proto_package() -> None:
    from mtc_replicator._pb.mtc.v1 import peer_pb2, peer_pb2_grpc

    assert peer_pb2.DESCRIPTOR.package == "mtc.v1"
    assert hasattr(peer_pb2_grpc, "PeerServicer")
    assert "proto" not in sys.modules


def test_csi_stubs_keep_the_spec_package_and_field_numbers() -> None:
    """Kubelet sends csi.v1 messages: the names and numbers must be the spec's (v1.12.0)."""
    from mtc_replicator.csi._pb.csi.v1 import csi_pb2, csi_pb2_grpc

    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    assert hasattr(csi_pb2_grpc, "NodeServicer")
    publish = csi_pb2.NodePublishVolumeRequest.DESCRIPTOR.fields_by_name
    numbers = {name: field.number for name, field in publish.items()}
    assert numbers == {
        "volume_id": 1,
        "target_path": 4,
        "volume_capability": 5,
        "readonly": 6,
        "volume_context": 8,
    }
    capability = csi_pb2.VolumeCapability.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in capability.items()} == {
        "block": 1,
        "mount": 2,
        "access_mode": 3,
    }
    assert csi_pb2.ProbeResponse.DESCRIPTOR.fields_by_name["ready"].number == 1
    assert "proto" not in sys.modules
