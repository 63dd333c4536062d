"""The committed generated modules match jaxpipe.proto (regenerate with scripts/gen_proto.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ["jaxpipe_pb2.py", "jaxpipe_pb2.pyi", "jaxpipe_pb2_grpc.py"]


def test_generated_code_is_up_to_date(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        str(ROOT / "jaxpipe/protocol/jaxpipe.proto")])
    assert code == 0
    for name in GENERATED:
        fresh = (tmp_path / "jaxpipe/protocol" / name).read_text()
        assert fresh == (ROOT / "jaxpipe/protocol" / name).read_text(), \
            f"{name} is stale: run python scripts/gen_proto.py"


def test_api_is_package_jaxpipe_v1():
    from jaxpipe.protocol import jaxpipe_pb2 as pb

    assert pb.DESCRIPTOR.package == "jaxpipe.v1"
    assert set(pb.DESCRIPTOR.services_by_name["Generation"].methods_by_name) == {
        "Generate", "GenerateBatch", "GetServerInfo"}
