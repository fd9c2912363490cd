"""The committed gRPC stubs are exactly what the pinned grpcio-tools makes of proto/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "replicator" / "_pb"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def test_stubs_are_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the dev extra")
    fresh = _generator().generate(tmp_path / "_pb")
    fresh_rel = {p.relative_to(tmp_path / "_pb") for p in fresh}
    committed_rel = {
        p.relative_to(COMMITTED)
        for p in COMMITTED.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert fresh_rel == committed_rel, "run scripts/gen_protos.py and commit replicator/_pb"
    for rel in sorted(fresh_rel):
        assert (tmp_path / "_pb" / rel).read_text() == (COMMITTED / rel).read_text(), (
            f"replicator/_pb/{rel} is stale: run scripts/gen_protos.py"
        )


def test_stubs_import_without_a_top_level_proto_package() -> None:
    from replicator._pb.mtc.v1 import peer_pb2, peer_pb2_grpc

    assert peer_pb2.DESCRIPTOR.package == "mtc.v1"
    assert hasattr(peer_pb2_grpc, "PeerServicer")
    assert "proto" not in sys.modules
