"""The committed gRPC stubs in deployments/proto are what scripts/gen_proto.sh makes of the .proto files."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "deployments" / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _protos() -> list[Path]:
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def test_there_is_an_inference_proto():
    assert Path("deltaserve/v1/inference.proto") in _protos()


def test_committed_stubs_are_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools.protoc", reason="needs grpcio-tools (the test extra)")
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    stale = []
    for proto in _protos():
        stem = str(proto)[: -len(".proto")]
        for suffix in GENERATED_SUFFIXES:
            fresh, committed = tmp_path / (stem + suffix), PROTO_ROOT / (stem + suffix)
            assert fresh.is_file(), f"gen_proto.sh did not generate {stem + suffix} (is {proto} listed in it?)"
            if not committed.is_file() or committed.read_bytes() != fresh.read_bytes():
                stale.append(str(committed.relative_to(ROOT)))
    if stale:
        import grpc_tools

        from importlib.metadata import version

        pytest.fail(
            f"stale generated code: {stale}; run scripts/gen_proto.sh and commit the result "
            f"(generated here with grpcio-tools {version('grpcio-tools')} from {grpc_tools.__file__})"
        )


def test_stubs_import_as_a_package_and_pickle():
    from deployments.proto.deltaserve.v1 import inference_pb2 as pb
    from deployments.proto.deltaserve.v1 import inference_pb2_grpc as pb_grpc

    service = pb.DESCRIPTOR.services_by_name["Inference"]
    assert service.full_name == "deltaserve.v1.Inference"
    assert [m.name for m in service.methods] == ["Generate", "GenerateStream", "ListModels", "ReportTaskOutcome"]
    assert service.methods_by_name["GenerateStream"].server_streaming
    assert hasattr(pb_grpc, "InferenceStub") and hasattr(pb_grpc, "add_InferenceServicer_to_server")
    req = pb.GenerateRequest(model="m", prompt="p", max_tokens=0)
    assert req.HasField("max_tokens") and not req.HasField("temperature")
    # Ray Serve pickles the request from the proxy to the replica: the message classes must
    # name a module that exists.
    assert type(req).__module__ == "deployments.proto.deltaserve.v1.inference_pb2"
    assert pickle.loads(pickle.dumps(req)) == req
